"""The fastest exact CPU path for one model on this machine: weight dtype and linear kernels, chosen by
measurement and cached per machine and model.

Why: a transformer's decode step on a CPU is a stream of matrix-vector products, bound by reading the
weights, and PyTorch's plain kernels read them at about a third of the bandwidth; the packed oneDNN linears
(``packing``), the row-wise float32 kernel (``rowwise``) and, for Llama-family models, a lean forward
(``forward``) come closer.

Which kernels win depends on the CPU and on the model's shapes, so :func:`choose` times 1- and 6-token
forwards of each candidate and keeps the fastest, caching the verdict in ``$PIVOTSPEC_CACHE/fastpath.json``
under a key of the CPU, torch version, thread count and model files. Auto weighs bfloat16 (on the row-wise
kernel's AVX512-BF16 dot product, and oneDNN-packed) beside float32 where the CPU has bfloat16 instructions
(AVX512-BF16 or AMX), and takes it only when it saves ``OTHER_DTYPE_SAVING`` of the time; it keeps to
float32 elsewhere and for models with sliding windows; ``--dtype`` pins one. On packed paths two things keep
greedy SD equal to the target alone, and batched rows equal to rows decoded alone, within a dtype (the
row-wise kernel computes each row alone by construction): a lone row is computed at a width that gives it the
many-row kernel's numbers, the fastest such width measured per machine (:func:`packed_linear`,
:func:`exact_lone_widths`), and short blocks attend each query in float32 over exactly its keys
(``attention.sdpa_in_float32``, through the compiled ``query_attention`` kernel where a C compiler is found);
without them both parted at near-ties in bfloat16 (tested on the testbed).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pivotspec.decoding import fused, rowwise
from pivotspec.decoding.attention import attention_in_float32
from pivotspec.decoding.forward import make_lean, model_forward
from pivotspec.decoding.machine import cpu_flags, cpu_name
from pivotspec.decoding.packing import (
    LONE_ROWS,
    LONE_WIDTHS,
    MAX_ROWS,
    ROW_LIMIT,
    exact_lone_widths,
    exact_row_limit,
    pack_linears,
    set_lone_rows,
    set_max_rows,
)
from pivotspec.errors import UsageError

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Weight-only int8 (``packing.quantize``), opt-in only: its weights are not the checkpoint's, so its tokens and
# accuracy are its own (README, "CPU forwards"). Everything else stays float32. Its kernel is the row-wise one
# over int8 panels where that builds (``INT8_ROWWISE``: float32 inputs, each row alone), else PyTorch's, which
# rounds the linears' inputs to bfloat16 (on a 2-core AVX2 AMD EPYC the testbed target's 1-token forward took
# 23-25 ms so in a scratch A/B, against 37 ms with every activation in bfloat16, which that CPU computes
# without bfloat16 instructions). The two compute other numbers, so they are never timed against each other:
# ``PIVOTSPEC_CPU_KERNELS=packed`` pins PyTorch's. On PyTorch's, a model attends per query as bfloat16 does
# (``attention_in_float32``): float32 SDPA sums a query beside others in another order, about 1e-7 apart, and
# the rounding to bfloat16 before the next linear turned that into a whole bfloat16 step; greedy SD parted
# from ar on 1 of 6 testbed problems before.
INT8 = "int8"
DTYPES = (*FLOAT_DTYPES, INT8)
CACHE_FILE = "fastpath.json"
# Auto leaves float32 only for a path that saves at least this share of the forward time: another dtype gives
# other tokens than the README's float32 tables, and smaller savings did not show end to end (an Intel Xeon
# with AVX512-BF16: packed bfloat16 saved 12-20% of the 1- plus 6-token forward time, and `demo` ran 1.03x,
# `label` 1.08x; an AMD EPYC: it saved about half, and they ran 2.27x and 3.26x; benchmarks/end_to_end.py).
OTHER_DTYPE_SAVING = 0.25
# The forward widths a verdict is timed at: a request's latency is a 1-token forward (the draft's step, the
# target alone) and a 6-token one (SD's verification at gamma 5). A server that batches also runs its full
# batch: 8 rows of a 6-token verification, 48 tokens a forward. Its throughput under load goes with that
# forward, where the verdicts part (an Intel Xeon with AMX: the row-wise float32 kernel wins the 1- and 6-token
# forwards, 20/30 ms against packed bfloat16's 21/23 ms, and 8 clients got 2.14x the one-at-a-time server's
# tokens/s on it, 3.06x on packed bfloat16; benchmarks/README.md, "Serving many clients").
LATENCY_WIDTHS = (1, 6)
SERVING_WIDTHS = (1, 6, 48)


def capabilities() -> dict[str, Any]:
    """What decides the candidates: the vector ISA torch dispatches to, the bfloat16 instructions, AMX,
    whether oneDNN runs bfloat16 natively here (it emulates it, slowly, on AVX2-only CPUs) and whether the
    row-wise kernel was built with AVX512-BF16's dot product."""
    flags = cpu_flags()
    return {
        "cpu": cpu_name(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "onednn_bf16": bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "rowwise_bf16": rowwise.native_bf16(),
    }


@dataclass(frozen=True)
class CpuPath:
    """One way to run a model on the CPU: weight dtype, whether its linears are packed ones
    (``packing.PackedCompute``) and, for those, their kernel (oneDNN or the row-wise kernel; int8 weights the
    row-wise kernel or PyTorch's int8 one), how many rows a lone row is computed as and how many one call
    takes at most."""

    dtype: str
    packed: bool
    lone_rows: int = LONE_ROWS
    max_rows: int = MAX_ROWS
    rowwise: bool = False

    @property
    def kernel(self) -> str:
        """The packed linears' kernel (``packing.KERNELS``)."""
        if self.dtype == INT8:
            return "rowwise-int8" if self.rowwise else INT8
        if self.rowwise:
            return "rowwise-bf16" if self.dtype == "bfloat16" else "rowwise"
        return "onednn"

    @property
    def label(self) -> str:
        return f"{self.dtype}{' rowwise' if self.rowwise else ' packed' if self.packed else ''}"


ROWWISE = CpuPath("float32", True, lone_rows=1, max_rows=ROW_LIMIT, rowwise=True)  # exact at any width
INT8_ROWWISE = CpuPath(INT8, True, lone_rows=1, max_rows=ROW_LIMIT, rowwise=True)
# bfloat16 weights on the row-wise kernel, activations float32 but the linears' inputs (``rowwise``)
BF16_ROWWISE = CpuPath("bfloat16", True, lone_rows=1, max_rows=ROW_LIMIT, rowwise=True)


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
    """The paths worth timing. Auto (``dtype`` None): float32, plain and packed, and where the CPU has bfloat16
    instructions and the model no sliding window, bfloat16 on the row-wise kernel (where it runs AVX512-BF16's
    dot product) and packed (where oneDNN runs it natively): there the bfloat16 paths keep the exactness
    promises within their kernel; their accuracy and the shipped classifiers' AUROC were checked against
    float32 (README). Float32 also gets the row-wise kernel where it builds here (``rowwise``). An asked-for
    dtype gets its own kernels: bfloat16 the row-wise one where it builds (emulating the dot product where the
    CPU lacks it), then packed where oneDNN has it natively (AVX512-BF16/AMX), then plain; ``int8`` the
    row-wise kernel where it builds, then PyTorch's, which any CPU runs (the first is taken: see ``INT8``)."""
    if dtype == INT8:
        return [*([INT8_ROWWISE] if rowwise.available() else []), CpuPath(INT8, True)]
    float32 = [CpuPath("float32", False), CpuPath("float32", True), *([ROWWISE] if rowwise.available() else [])]
    if dtype is None:
        bf16 = [*([BF16_ROWWISE] if caps.get("rowwise_bf16") else []),
                *([CpuPath("bfloat16", True)] if native_bf16(caps) else [])]
        return float32 + ([] if sliding else bf16)
    if dtype == "float32":
        return float32
    if dtype == "bfloat16":
        return [*([BF16_ROWWISE] if rowwise.available() else []), CpuPath("bfloat16", False),
                *([CpuPath("bfloat16", True)] if caps["onednn_bf16"] else [])]
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


def time_forwards(model: nn.Module, reps: int = 7, context: int = 64,
                  widths: tuple[int, ...] = LATENCY_WIDTHS) -> dict[str, float]:
    """Median ms of a forward of each of ``widths`` new tokens after ``context`` cached tokens (by default the
    decode step and SD's verification at gamma 5), each rep on a fresh cache of the same contents."""
    from pivotspec.decoding.kvcache import growing_cache

    vocab = int(model.config.vocab_size)
    prompt = torch.arange(context, dtype=torch.long).remainder(vocab).unsqueeze(0)
    out = {}
    with torch.inference_mode():
        for width in widths:
            step = torch.arange(width, dtype=torch.long).remainder(vocab).unsqueeze(0)
            times = []
            for _ in range(reps + 2):
                cache = growing_cache(model.config)
                model_forward(model, prompt, cache)
                start = time.perf_counter()
                model_forward(model, step, cache, keep=width)
                times.append(time.perf_counter() - start)
            out[f"{width}_token_ms"] = statistics.median(times[2:]) * 1e3
    return out


def activation_dtype(path: CpuPath) -> torch.dtype:
    """What a path's activations (and unquantized weights: norms, embeddings) are held in: float32 on the
    row-wise kernel and for int8, else the dtype."""
    return torch.float32 if path.dtype == INT8 or path.rowwise else FLOAT_DTYPES[path.dtype]


def convert(model: nn.Module, path: CpuPath) -> nn.Module:
    """Cast ``model`` in place to ``path``'s dtype and pack its linears if asked, giving a plain Llama the lean
    forward over them, packed or not (``forward.make_lean``)."""
    model.to(activation_dtype(path))
    # Every path that rounds the linears' inputs to bfloat16 attends per query (``attention``): PyTorch's int8
    # kernel too (INT8), and the row-wise bfloat16 one where attention is not the fused layers' own
    if path.dtype == "bfloat16" or (path.dtype == INT8 and not path.rowwise):
        attention_in_float32(model)
    if path.packed:
        pack_linears(model, path.kernel)
        set_lone_rows(model, path.lone_rows)
        set_max_rows(model, path.max_rows)
    make_lean(model)
    return model


def measure(model: nn.Module, paths: list[CpuPath],
            widths: tuple[int, ...] = LATENCY_WIDTHS) -> dict[str, dict[str, Any]]:
    """Forward timings of each path at ``widths`` tokens on copies of ``model`` (a float32 CPU model, left as it
    is). A packed path is timed at each exact lone-row width (:func:`exact_lone_widths`) and reports its fastest, as
    ``lone_rows``, with every width's 1-token ms in ``lone_row_ms``, and the most rows one call keeps exact,
    as ``max_rows`` (:func:`exact_row_limit`)."""
    results: dict[str, dict[str, Any]] = {}
    for path in paths:
        trial = convert(copy.deepcopy(model), path)
        if not path.packed or path.rowwise:  # the row-wise kernel is exact at any width (``rowwise.c``)
            results[path.label] = time_forwards(trial, widths=widths)
            continue
        # Widths interleaved, 3 rounds: timed one after another, 7 forwards each, the verdicts moved with the
        # VM's noise (2 rows 44.9 against 4 rows 33.3 ms in one load, 32.9 against 37.6 in another).
        lone = exact_lone_widths(trial) or [path.lone_rows]
        runs: dict[int, list[dict[str, float]]] = {w: [] for w in lone}
        for _ in range(3):
            for width in lone:
                set_lone_rows(trial, width)
                runs[width].append(time_forwards(trial, reps=3, widths=widths))
        by_width = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
        width = min(by_width, key=lambda w: by_width[w]["1_token_ms"])
        results[path.label] = {**by_width[width], "lone_rows": width, "max_rows": exact_row_limit(trial),
                               "lone_row_ms": {str(w): t["1_token_ms"] for w, t in by_width.items()}}
        del trial
    return results


def present(model: str) -> bool:
    """Whether a verdict's model still exists: a hub id, or a directory that is still there. Verdicts of models
    that are gone (the test suite's temporary checkpoints, a deleted conversion) are dropped when a new one is
    written, so the file does not grow with every directory ever loaded."""
    return not model.startswith("/") or Path(model).exists()


def choose(model: nn.Module, source: Path | str, store: Path, dtype: str | None = None,
           name: str = "model", widths: tuple[int, ...] = LATENCY_WIDTHS) -> CpuPath:
    """The fastest path for this float32 CPU ``model`` (read from the cache, or measured once and cached):
    the least time for one forward of each of ``widths`` tokens (by default a request's 1 and 6; a server's
    ``SERVING_WIDTHS`` add its full batch), where auto takes another dtype than float32 only
    when it saves ``OTHER_DTYPE_SAVING`` of that time. ``dtype`` restricts the choice to that dtype's
    kernels (packed or not); ``$PIVOTSPEC_CPU_KERNELS`` pins the kernels without measuring: plain, packed
    (oneDNN; for int8 PyTorch's int8 kernel) or rowwise (float32, int8 or bfloat16; where it does not build, the
    dtype's first candidate). ``store``: the JSON file of verdicts."""
    paths = candidates(capabilities(), dtype, has_sliding_window(model.config))
    kernels = os.environ.get("PIVOTSPEC_CPU_KERNELS", "auto")
    if kernels not in ("auto", "plain", "packed", "rowwise"):
        raise UsageError(f"PIVOTSPEC_CPU_KERNELS={kernels!r}: use auto, plain, packed or rowwise")
    if kernels != "auto":  # pinned (to compare paths, or to rule the packed kernels out)
        kind = {"plain": (False, False), "packed": (True, False), "rowwise": (True, True)}[kernels]
        paths = [p for p in paths if (p.packed, p.rowwise) == kind] or paths[:1]
    if paths[0].dtype == INT8:
        paths = paths[:1]  # int8's kernels compute other numbers: never timed against each other (``INT8``)
    if len(paths) == 1 and (paths[0].dtype != INT8 or paths[0].rowwise):
        return paths[0]  # PyTorch's int8 kernel is still measured: its exact lone-row widths and row limit
    rule = f"|other dtypes save {OTHER_DTYPE_SAVING}" if len({p.dtype for p in paths}) > 1 else ""
    # "lean": packed paths run the lean Llama forward (``forward``), so verdicts timed before it are timed again
    # "row limit": verdicts before the row limit was measured (``packing.exact_row_limit``) are measured again
    # "plain lean": plain paths run it too since, so their timings (and the verdicts) moved
    rule += f"|lone rows {','.join(map(str, LONE_WIDTHS))}|lean|row limit|plain lean" if any(
        p.packed for p in paths) else ""
    # "fused layers": the row-wise paths run their layers' ops in C (``fused``), so their timings moved
    rule += "|fused layers" if any(p.rowwise for p in paths) and fused.wanted() else ""
    rule += f"|widths {','.join(map(str, widths))}" if widths != LATENCY_WIDTHS else ""
    key = f"{machine_key()}|{model_key(source)}|{','.join(p.label for p in paths)}{rule}"
    try:
        cached = json.loads(store.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    if entry is None:
        timings = measure(model, paths, widths)

        def cost(p: CpuPath) -> float:
            ms = sum(timings[p.label][f"{w}_token_ms"] for w in widths)
            return ms / (1 - OTHER_DTYPE_SAVING) if dtype is None and p.dtype != "float32" else ms

        best = min(paths, key=cost)
        best = CpuPath(best.dtype, best.packed, timings[best.label].get("lone_rows", best.lone_rows),
                       timings[best.label].get("max_rows", best.max_rows), best.rowwise)
        entry = {"choice": asdict(best), "timings": timings, "model": str(source)}
        cached = {k: v for k, v in cached.items() if present(v.get("model", ""))}
        cached[key] = entry
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, store)
        shown = ", ".join(k + " " + "/".join(f"{v[f'{w}_token_ms']:.0f}" for w in widths) + " ms"
                          for k, v in timings.items())
        logging.getLogger("pivotspec").info("%s on this CPU runs as %s (%s-token forward: %s; auto leaves float32 "
                                            "only to save %d%%); kept in %s", name, best,
                                            "/".join(map(str, widths)), shown,
                                            round(OTHER_DTYPE_SAVING * 100), store)
    return CpuPath(**entry["choice"])
