"""The fastest exact CPU path for one model on this machine: weight dtype and linear kernels, chosen by
measurement and cached per machine and model.

Why: a transformer's decode step on a CPU is a stream of matrix-vector products, bound by reading the
weights. PyTorch's plain ``F.linear`` reaches about a third of the read bandwidth at one row (measured: a
bfloat16 576x1536 layer at 8 GB/s against 28 GB/s for a sum over the same bytes), because it hands oneDNN
the weights in their stored layout on every call and one row of bfloat16 goes through a slow path.
:class:`PackedLinear` reorders each weight once into oneDNN's blocked layout (what ``torch.compile``'s
freezing pass does for CPU linears), which ran those layers at 20-25 GB/s, bfloat16 and float32 alike, and
brought the 6-row verification forward to 1.06-1.11x the 1-row one (benchmarks/cpu_forwards.py).

Which kernels win depends on the CPU and on the model's shapes, so :func:`choose` times 1- and 6-token
forwards of each candidate and keeps the fastest, caching the verdict in ``$PIVOTSPEC_CACHE/fastpath.json``
under a key of the CPU, torch version, thread count and model files. Auto weighs packed bfloat16 beside
float32 where the CPU has bfloat16 instructions (AVX512-BF16 or AMX), and takes it only when it saves
``OTHER_DTYPE_SAVING`` of the time; it keeps to float32 elsewhere and for models with sliding windows;
``--dtype`` pins one. Two things keep greedy SD equal to the target alone, and
batched rows equal to rows decoded alone, within a dtype: a lone row is computed at a width that gives it the
many-row kernel's numbers, the fastest such width measured per machine (:func:`packed_linear`,
:func:`exact_lone_widths`), and short blocks attend one query at a time in float32 over exactly its keys
(``attention.sdpa_in_float32``); without them both parted at near-ties in bfloat16 (tested on the testbed).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pivotspec.decoding.attention import attention_in_float32
from pivotspec.errors import UsageError

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_FILE = "fastpath.json"
# Auto leaves float32 only for a path that saves at least this share of the forward time: another dtype gives
# other tokens than the README's float32 tables, and smaller savings did not show end to end (an Intel Xeon
# with AVX512-BF16: packed bfloat16 saved 12-20% of the 1- plus 6-token forward time, and `demo` ran 1.03x,
# `label` 1.08x; an AMD EPYC: it saved 55%, and they ran 1.58x and 2.47x; benchmarks/end_to_end.py).
OTHER_DTYPE_SAVING = 0.25
LONE_WIDTHS = (1, 2, 4)  # how many rows a lone row may be computed as; which are exact and fastest is measured
LONE_ROWS = 2  # the width before it is measured (and where none is exact): what every earlier number used


def packed_linear(flat: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  lone_rows: int = LONE_ROWS) -> torch.Tensor:
    """``flat @ W.T + bias`` on oneDNN-packed weights. A lone row is computed as ``lone_rows`` rows (the rest
    zeros): oneDNN may sum one row differently from two or more, and where it does the results part at
    rounding, in bfloat16 by a whole step, enough to move greedy SD away from the target alone. Whether it does,
    and which width runs fastest, depend on the CPU, the dtype and the shapes (on an AMD EPYC with AVX512-BF16:
    one row alone kept the many-row numbers for the testbed draft's bfloat16 weights and ran 18% faster, not
    for the target's, where 4 rows ran 3-8% faster than 2; in float32 it parted), so :func:`choose` measures
    it among the exact widths (:func:`exact_lone_widths`)."""
    if flat.shape[0] == 1 and lone_rows > 1:
        padded = F.pad(flat, (0, 0, 0, lone_rows - 1))
        return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")


def pack(weight: torch.Tensor) -> torch.Tensor:
    # The batch-size hint only guides oneDNN's blocking; any number of rows runs on the packed weight.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight is also held in oneDNN's prepacked layout. The original parameter stays
    (shared, so a lm_head tied to the embeddings stays tied, and fingerprints and state dicts see it)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack(linear.weight)
        self.lone_rows = LONE_ROWS

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = packed_linear(x.reshape(-1, x.shape[-1]), self.packed, self.bias, self.lone_rows)
        return out.reshape(*x.shape[:-1], self.out_features)


class FusedLinears:
    """Linears that read the same input (attention's q, k and v; the MLP's gate and up) as one packed
    matrix: one oneDNN call instead of three or two. Measured: the 210 separate calls of a 30-layer
    SmolLM2-shaped stack took 1.7x the time of the 120 fused ones at one row, the weights being the same bytes.
    The first member called with an input computes every member's output; the others take their slice."""

    def __init__(self, linears: list[nn.Linear]):
        self.sizes = [lin.out_features for lin in linears]
        self.in_features, self.dtype = linears[0].in_features, linears[0].weight.dtype
        self.packed = pack(torch.cat([lin.weight.detach() for lin in linears]))
        biases = [lin.bias for lin in linears]
        self.bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
        self.lone_rows = LONE_ROWS
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] = []

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x:  # a new input: compute every member's output once
            out = packed_linear(x.reshape(-1, x.shape[-1]), self.packed, self.bias, self.lone_rows)
            self._outputs = [part.reshape(*x.shape[:-1], part.shape[-1]) for part in out.split(self.sizes, -1)]
            self._input = x
        return self._outputs[index]


class FusedMember(nn.Module):
    """One linear of a :class:`FusedLinears` group, in its place (its parameters stay registered)."""

    def __init__(self, linear: nn.Linear, group: FusedLinears, index: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.output(self.index, x)
        if self.index == len(self.group.sizes) - 1:  # the last member: let go of the input and outputs
            self.group._input, self.group._outputs = None, []
        return out


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # names that read one input in HF models


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU model by a packed one, fusing the groups in ``FUSED`` that a module
    holds (members must agree on input width and on having a bias); returns how many linears were replaced."""
    replaced = 0
    for module in list(model.modules()):
        for names in FUSED:
            linears = [getattr(module, n, None) for n in names]
            if (all(type(lin) is nn.Linear for lin in linears) and len({lin.in_features for lin in linears}) == 1
                    and len({lin.bias is None for lin in linears}) == 1):
                group = FusedLinears(linears)
                for i, (name, lin) in enumerate(zip(names, linears, strict=True)):
                    setattr(module, name, FusedMember(lin, group, i))
                replaced += len(names)
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, PackedLinear(mod))
    return replaced + len(targets)


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, (PackedLinear, FusedMember)) for m in model.modules())


def packed_kernels(model: nn.Module) -> list[PackedLinear | FusedLinears]:
    """Each packed weight of ``model`` once: its packed linears and fused groups."""
    kernels = {}
    for m in model.modules():
        if isinstance(m, PackedLinear):
            kernels[id(m)] = m
        elif isinstance(m, FusedMember):
            kernels[id(m.group)] = m.group
    return list(kernels.values())


def set_lone_rows(model: nn.Module, rows: int) -> None:
    for kernel in packed_kernels(model):
        kernel.lone_rows = rows


def exact_lone_widths(model: nn.Module, widths: tuple[int, ...] = LONE_WIDTHS, rows: int = 6) -> list[int]:
    """The widths at which a lone row gets, bit for bit, the numbers that a block of ``rows`` rows gives it, for
    every packed weight of ``model`` (probed with seeded random rows): the widths that keep greedy SD equal to
    the target alone and batched rows equal to rows alone."""
    gen = torch.Generator().manual_seed(0)
    probes = [(k, torch.randn(rows, k.in_features, generator=gen).to(k.dtype)) for k in packed_kernels(model)]
    exact = []
    with torch.inference_mode():
        for width in widths:
            if all(torch.equal(packed_linear(x, k.packed, k.bias),
                               torch.cat([packed_linear(x[i:i + 1], k.packed, k.bias, width) for i in range(rows)]))
                   for k, x in probes):
                exact.append(width)
    return exact


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def capabilities() -> dict[str, Any]:
    """What decides the candidates: the vector ISA torch dispatches to, the bfloat16 instructions, AMX, and
    whether oneDNN runs bfloat16 natively here (it emulates it, slowly, on AVX2-only CPUs)."""
    flags = cpu_flags()
    return {
        "cpu": cpu_name(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "onednn_bf16": bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }


@dataclass(frozen=True)
class CpuPath:
    """One way to run a model on the CPU: weight dtype, whether linears use packed oneDNN weights, and for
    packed ones how many rows a lone row is computed as (:func:`packed_linear`)."""

    dtype: str
    packed: bool
    lone_rows: int = LONE_ROWS

    @property
    def label(self) -> str:
        return f"{self.dtype}{' packed' if self.packed else ''}"


def native_bf16(caps: dict[str, Any]) -> bool:
    """Whether this CPU has bfloat16 instructions (AVX512-BF16 or AMX) and oneDNN runs bfloat16 on them."""
    return bool(caps["onednn_bf16"] and (caps["avx512_bf16"] or caps["amx_bf16"]))


def has_sliding_window(config: Any) -> bool:
    """Whether some layer of a model with this config attends over a sliding window (Mistral, Gemma, some
    Qwen): those layers attend whole, so in bfloat16 they are not exact (see :func:`sdpa_in_float32`)."""
    if any("sliding" in str(kind) for kind in getattr(config, "layer_types", None) or []):
        return True
    return bool(getattr(config, "sliding_window", None)) and bool(getattr(config, "use_sliding_window", True))


def candidates(caps: dict[str, Any], dtype: str | None = None, sliding: bool = False) -> list[CpuPath]:
    """The paths worth timing. Auto (``dtype`` None): float32, plain and packed, and bfloat16 packed where the
    CPU has bfloat16 instructions and the model no sliding window (where the packed bfloat16 path keeps the
    exactness promises within its dtype; its accuracy and the shipped classifiers' AUROC were checked against
    float32, README). An asked-for dtype gets its own kernels, packed where oneDNN has them for it (bfloat16
    natively only with AVX512-BF16/AMX)."""
    if dtype is None:
        extra = [CpuPath("bfloat16", True)] if native_bf16(caps) and not sliding else []
        return [CpuPath("float32", False), CpuPath("float32", True), *extra]
    if dtype == "float32":
        return [CpuPath("float32", False), CpuPath("float32", True)]
    if dtype == "bfloat16" and caps["onednn_bf16"]:
        return [CpuPath("bfloat16", False), CpuPath("bfloat16", True)]
    return [CpuPath(dtype, False)]


def model_key(source: Path | str) -> str:
    """The model's files as they are now: path, and size and mtime of each weight file."""
    parts = [str(source)]
    folder = Path(source)
    if folder.is_dir():
        for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{int(st.st_mtime)}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def machine_key() -> str:
    caps = capabilities()
    return f"{caps['cpu']}|{caps['isa']}|torch {torch.__version__}|threads {torch.get_num_threads()}"


def time_forwards(model: nn.Module, with_cache: Any, reps: int = 7, context: int = 64) -> dict[str, float]:
    """Median ms of a 1-token and a 6-token forward after ``context`` cached tokens (the decode step and SD's
    verification at gamma 5), each rep on a fresh cache of the same contents."""
    from pivotspec.decoding.kvcache import growing_cache

    vocab = int(model.config.vocab_size)
    prompt = torch.arange(context, dtype=torch.long).remainder(vocab).unsqueeze(0)
    out = {}
    with torch.inference_mode():
        for width in (1, 6):
            step = torch.arange(width, dtype=torch.long).remainder(vocab).unsqueeze(0)
            times = []
            for _ in range(reps + 2):
                cache = growing_cache(model.config)
                model(input_ids=prompt, **with_cache(cache), use_cache=True, logits_to_keep=1)
                start = time.perf_counter()
                model(input_ids=step, **with_cache(cache), use_cache=True, logits_to_keep=width)
                times.append(time.perf_counter() - start)
            out[f"{width}_token_ms"] = statistics.median(times[2:]) * 1e3
    return out


def convert(model: nn.Module, path: CpuPath) -> nn.Module:
    """Cast ``model`` in place to ``path``'s dtype and pack its linears if asked."""
    model.to(FLOAT_DTYPES[path.dtype])
    if path.dtype != "float32":
        attention_in_float32(model)
    if path.packed:
        pack_linears(model)
        set_lone_rows(model, path.lone_rows)
    return model


def measure(model: nn.Module, with_cache: Any, paths: list[CpuPath]) -> dict[str, dict[str, Any]]:
    """Forward timings of each path on copies of ``model`` (a float32 CPU model, left as it is). A packed path
    is timed at each exact lone-row width (:func:`exact_lone_widths`) and reports its fastest, as
    ``lone_rows``, with every width's 1-token ms in ``lone_row_ms``."""
    results: dict[str, dict[str, Any]] = {}
    for path in paths:
        trial = convert(copy.deepcopy(model), path)
        if not path.packed:
            results[path.label] = time_forwards(trial, with_cache)
            continue
        # Widths interleaved, 3 rounds: timed one after another, 7 forwards each, the verdicts moved with the
        # VM's noise (2 rows 44.9 against 4 rows 33.3 ms in one load, 32.9 against 37.6 in another).
        widths = exact_lone_widths(trial) or [path.lone_rows]
        runs: dict[int, list[dict[str, float]]] = {w: [] for w in widths}
        for _ in range(3):
            for width in widths:
                set_lone_rows(trial, width)
                runs[width].append(time_forwards(trial, with_cache, reps=3))
        by_width = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
        width = min(by_width, key=lambda w: by_width[w]["1_token_ms"])
        results[path.label] = {**by_width[width], "lone_rows": width,
                               "lone_row_ms": {str(w): t["1_token_ms"] for w, t in by_width.items()}}
        del trial
    return results


def choose(model: nn.Module, source: Path | str, with_cache: Any, store: Path, dtype: str | None = None,
           name: str = "model") -> CpuPath:
    """The fastest path for this float32 CPU ``model`` (read from the cache, or measured once and cached):
    the least time for a 1-token plus a 6-token forward, where auto takes another dtype than float32 only
    when it saves ``OTHER_DTYPE_SAVING`` of that time. ``dtype`` restricts the choice to that dtype's
    kernels (packed or not); ``$PIVOTSPEC_CPU_KERNELS`` (plain or packed) pins the kernels without measuring.
    ``store``: the JSON file of verdicts."""
    paths = candidates(capabilities(), dtype, has_sliding_window(model.config))
    kernels = os.environ.get("PIVOTSPEC_CPU_KERNELS", "auto")
    if kernels not in ("auto", "plain", "packed"):
        raise UsageError(f"PIVOTSPEC_CPU_KERNELS={kernels!r}: use auto, plain or packed")
    if kernels != "auto":  # pinned (to compare paths, or to rule the packed kernels out)
        paths = [p for p in paths if p.packed == (kernels == "packed")] or paths[:1]
    if len(paths) == 1:
        return paths[0]
    rule = f"|other dtypes save {OTHER_DTYPE_SAVING}" if len({p.dtype for p in paths}) > 1 else ""
    rule += f"|lone rows {','.join(map(str, LONE_WIDTHS))}" if any(p.packed for p in paths) else ""
    key = f"{machine_key()}|{model_key(source)}|{','.join(p.label for p in paths)}{rule}"
    try:
        cached = json.loads(store.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    if entry is None:
        timings = measure(model, with_cache, paths)

        def cost(p: CpuPath) -> float:
            ms = timings[p.label]["1_token_ms"] + timings[p.label]["6_token_ms"]
            return ms / (1 - OTHER_DTYPE_SAVING) if dtype is None and p.dtype != "float32" else ms

        best = min(paths, key=cost)
        best = CpuPath(best.dtype, best.packed, timings[best.label].get("lone_rows", best.lone_rows))
        entry = {"choice": asdict(best), "timings": timings, "model": str(source)}
        cached[key] = entry
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, store)
        shown = ", ".join(f"{k} {v['1_token_ms']:.0f}/{v['6_token_ms']:.0f} ms" for k, v in timings.items())
        logging.getLogger("pivotspec").info("%s on this CPU runs as %s (1-/6-token forward: %s; auto leaves float32 "
                                            "only to save %d%%); kept in %s", name, best, shown,
                                            round(OTHER_DTYPE_SAVING * 100), store)
    return CpuPath(**entry["choice"])
