"""CPU forwards against the time to read the weights and against llama.cpp: one run, one table.

    python benchmarks/cpu_forwards.py --out benchmarks/results/cpu_forwards.json

Per model (testbed target and draft, SmolLM2-135M) and per CPU path (float32 plain, as every pivotspec number
before the fast path; float32 packed; float32 rowwise, the row-wise C kernel, where it builds; bfloat16 plain,
and packed (``--dtype bfloat16``) where oneDNN runs bfloat16 natively, and rowwise (bfloat16 panels, AVX512-BF16's
dot product or its emulation); weight-only int8 (``--dtype int8``,
opt-in) on PyTorch's int8 kernel and on the row-wise one; a packed path once per lone-row width that keeps
the many-row numbers, the widths ``fastpath.choose`` picks among, and once through transformers' forward
where the lean Llama forward applies, to show what it saves; a row-wise path also with PyTorch's ops around
its linears, to show what the fused layers save): median ms of a 1-, 4- and 6-token forward after
64 cached tokens (the decode step, SD's verification at gamma 3 and 5; interleaved repeats), the bytes of
weights, and the time to read them once at this machine's read bandwidth, measured here (median of summing a
512 MB buffer). Then
ms/token of ``ar``, ``sd`` and ``pad`` (gamma 5, the shipped classifier) on the testbed pair per path,
interleaved over arith validation problems; and llama.cpp (llama-cpp-python from a benchmark-only environment,
``--llama-python``) decoding SmolLM2 from the shipped Q4_1 GGUF. Each row says how its tokens compare with
float32's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pivotspec import api
from pivotspec.decoding import fastpath, packing, rowwise
from pivotspec.decoding.fastpath import CpuPath
from pivotspec.decoding.forward import LEAN, is_lean

PATHS = [CpuPath("float32", False), CpuPath("float32", True),
         *([fastpath.ROWWISE] if rowwise.available() else []), CpuPath("bfloat16", False),
         *([CpuPath("bfloat16", True)] if fastpath.capabilities()["onednn_bf16"] else []),  # oneDNN refuses it
         *([fastpath.BF16_ROWWISE] if rowwise.available() else []),
         CpuPath(fastpath.INT8, True), *([fastpath.INT8_ROWWISE] if rowwise.available() else [])]
TORCH_OPS = "PyTorch's layer ops"  # a row-wise path without the fused layers (``fused``)
LLAMA = r"""
import json, sys, time, statistics
from llama_cpp import Llama
path, threads, n, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_ctx=512, verbose=False)
prompt = llm.tokenize(b"Mia has 3 apples and buys 4 more. How many apples does she have now? Answer:")
times = []
for r in range(reps + 1):
    llm.reset(); llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(n):
        tok = llm.sample(temp=0.0); llm.eval([tok])
    times.append((time.perf_counter() - start) / n * 1000)
print(json.dumps({"ms_per_token": statistics.median(times[1:])}))
"""


def read_bandwidth_gbs(reps: int = 7) -> float:
    buf = torch.ones(128 * 1024 * 1024)  # 512 MB, far beyond any cache
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def load_pinned(kernels: str, load: Any, *args: Any, layers: str = "fused", **kwargs: Any) -> Any:
    """``load`` with the CPU kernels pinned (``$PIVOTSPEC_CPU_KERNELS``: plain, as pivotspec before the fast
    path; packed; rowwise), so that a path's row is that path and not what auto would measure fastest; on the
    row-wise paths, ``layers`` (``$PIVOTSPEC_LAYERS``) says whether the layer ops around the linears run fused in
    C (the default) or as PyTorch's ops."""
    os.environ["PIVOTSPEC_CPU_KERNELS"], os.environ["PIVOTSPEC_LAYERS"] = kernels, layers
    try:
        return load(*args, **kwargs)
    finally:
        del os.environ["PIVOTSPEC_CPU_KERNELS"], os.environ["PIVOTSPEC_LAYERS"]


def variants(base: Any) -> dict[str, tuple[Any, int]]:
    """Each path of ``PATHS`` on a copy of ``base``; a packed path once per exact lone-row width (the widths
    ``fastpath.choose`` picks among), as (model, lone rows)."""
    out = {}
    for p in PATHS:
        model = fastpath.convert(copy.deepcopy(base), p)
        if not p.packed or p.rowwise:  # the row-wise kernel takes a lone row alone
            out[p.label] = (model, 0)
            if p.rowwise:  # the same kernel with PyTorch's ops around it: what the fused layers save
                out[f"{p.label}, {TORCH_OPS}"] = (load_pinned("rowwise", fastpath.convert, copy.deepcopy(base), p,
                                                              layers="torch"), 0)
            continue
        widths = packing.exact_lone_widths(model) or [p.lone_rows]
        for width in widths:
            out[f"{p.label}, lone row x{width}"] = (model, width)
        if is_lean(model):  # the same kernels through transformers' forward: what the lean forward saves
            model = fastpath.convert(copy.deepcopy(base), p)
            delattr(model, LEAN)
            out[f"{p.label}, lone row x{widths[0]}, transformers forward"] = (model, widths[0])
    return out


def own_weights(kernel: Any) -> bool:
    """Whether a packed kernel holds weights other than its float32 parameters (int8, row-wise bfloat16)."""
    return kernel.scales is not None or kernel.kernel == "rowwise-bf16"


def weight_bytes(model: Any) -> int:
    """The bytes of weights a forward reads: the parameters, with int8 and row-wise bfloat16 kernels counted as
    what they hold (int8 weights and their scales, bfloat16 panels) in place of the float32 parameters they
    were made from (kept, unread)."""
    held_by = [k for k in packing.packed_kernels(model) if own_weights(k)]
    replaced = {id(t) for m in model.modules() if isinstance(m, (packing.PackedLinear, packing.FusedMember))
                and own_weights(packing.kernel_of(m)) for t in (m.weight, m.bias) if t is not None}
    held = sum(t.numel() * t.element_size() for k in held_by for t in (k.packed, k.scales, k.bias) if t is not None)
    return held + sum(t.numel() * t.element_size() for t in model.parameters() if id(t) not in replaced)


def forwards(name: str, reps: int, bandwidth: float) -> list[dict]:
    lm = load_pinned("plain", api.load_model, name, dtype="float32")
    rows = []
    models = variants(lm.model)
    timings: dict[str, list[dict]] = {k: [] for k in models}
    for r in range(reps):  # interleaved: each repeat times every path
        for label in (list(models) if r % 2 == 0 else list(models)[::-1]):
            model, width = models[label]
            if width:
                packing.set_lone_rows(model, width)
            timings[label].append(fastpath.time_forwards(model, reps=3, widths=(1, 4, 6)))
    for label, (m, _) in models.items():
        nbytes = weight_bytes(m)
        one = statistics.median(t["1_token_ms"] for t in timings[label])
        six = statistics.median(t["6_token_ms"] for t in timings[label])
        four = statistics.median(t["4_token_ms"] for t in timings[label])  # gamma 3's verification
        read_ms = nbytes / bandwidth / 1e6
        rows.append({"model": name, "path": label, "weights_mb": round(nbytes / 1e6), "read_ms": read_ms,
                     "1_token_ms": one, "4_token_ms": four, "6_token_ms": six, "6_over_1": six / one,
                     "1_token_over_read": one / read_ms})
    return rows


def decoding(n: int, reps: int, max_new: int) -> list[dict]:
    pairs = {}
    for p in PATHS:
        kernels = "rowwise" if p.rowwise else "packed" if p.packed else "plain"
        pairs[p.label] = load_pinned(kernels, api.load_pair, pair="testbed", dtype=p.dtype)
        if p.rowwise:
            pairs[f"{p.label}, {TORCH_OPS}"] = load_pinned(kernels, api.load_pair, pair="testbed", dtype=p.dtype,
                                                           layers="torch")
    policies = {k: api.make_policy(pr, "pad", pair_name="testbed") for k, pr in pairs.items()}
    problems = api.get_task("arith").problems("validation", n)
    methods = ["ar", "sd", "pad"]
    walls = {(k, m): [] for k in pairs for m in methods}
    tokens = {}
    for k in pairs:  # warm-up
        api.generate(pairs[k], problems[0].prompt, messages=problems[0].messages or None, max_new_tokens=8)
    for r in range(reps):
        for prob in problems:
            for k in (list(pairs) if r % 2 == 0 else list(pairs)[::-1]):
                for m in methods:
                    g = api.generate(pairs[k], prob.prompt, messages=prob.messages or None, method=m, gamma=5,
                                     policy=policies[k] if m == "pad" else None, max_new_tokens=max_new)
                    walls[k, m].append((g.stats["wall_s"], g.stats["new_tokens"]))
                    if r == 0:
                        tokens.setdefault((k, m), []).append(g.token_ids)
    rows = []
    for k in pairs:
        for m in methods:
            per_rep = [walls[k, m][i * n:(i + 1) * n] for i in range(reps)]
            ms = statistics.median(1000 * sum(w for w, _ in rep) / sum(t for _, t in rep) for rep in per_rep)
            same = sum(a == b for a, b in zip(tokens[k, m], tokens["float32", m], strict=True))
            rows.append({"path": k, "method": m, "ms_per_token": ms, "same_tokens_as_float32": f"{same}/{n}",
                         "sd_equals_ar": (sum(a == b for a, b in zip(tokens[k, "sd"], tokens[k, "ar"], strict=True))
                                          if m == "sd" else None)})
    base = {m: next(r["ms_per_token"] for r in rows if r["path"] == "float32" and r["method"] == m) for m in methods}
    for r in rows:
        r["speedup_vs_float32"] = base[r["method"]] / r["ms_per_token"]
    return rows


def llama_cpp(python: str, threads: int, n: int, reps: int) -> dict | None:
    """llama.cpp's ms/token on SmolLM2 Q4_1, or its failure recorded (seen: a native build on a 2-core AMX Xeon
    VM died with a segmentation fault in ``llama_decode``), so that a crashing peer never loses the other rows."""
    from pivotspec.decoding.models import _smollm2_gguf

    if not Path(python).exists():
        return None
    out = subprocess.run([python, "-c", LLAMA, str(_smollm2_gguf()), str(threads), str(n), str(reps)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {"ms_per_token": None, "error": f"exit {out.returncode}: {out.stderr.strip()[-300:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats of the forward timings")
    ap.add_argument("--n", type=int, default=6, help="arith validation problems for the decoding rows")
    ap.add_argument("--decode-repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--llama-python", default=".venv-llama/bin/python",
                    help="a Python with llama-cpp-python 0.3.36 (benchmark only; absent: the peer row is skipped)")
    ap.add_argument("--paths", default=",".join(p.label for p in PATHS),
                    help="comma-separated paths to time (float32 is always kept: the decoding rows compare with it)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_forwards.json"))
    args = ap.parse_args()
    asked = {p.strip() for p in args.paths.split(",")}
    if asked - {p.label for p in PATHS}:
        ap.error(f"unknown path {sorted(asked - {p.label for p in PATHS})[0]!r}: choose from "
                 f"{', '.join(p.label for p in PATHS)}")
    PATHS[:] = [p for p in PATHS if p.label in asked or p.label == "float32"]
    torch.set_num_threads(args.threads)
    result = {"machine": fastpath.capabilities(), "torch": torch.__version__, "threads": args.threads}
    result["read_bandwidth_gbs"] = bw = read_bandwidth_gbs()
    print(f"{result['machine']['cpu']} ({result['machine']['isa']}), read bandwidth {bw:.1f} GB/s")
    result["forwards"] = []
    for name in ("testbed-target", "testbed-draft", "smollm2-135m-instruct"):
        result["forwards"] += forwards(name, args.repeats, bw)
    print(f"{'model':22} {'path':52} {'MB':>5} {'read ms':>8} {'1-tok ms':>9} {'4-tok ms':>9} {'6-tok ms':>9} "
          f"{'6/1':>5} {'1/read':>7}")
    for r in result["forwards"]:
        print(f"{r['model']:22} {r['path']:52} {r['weights_mb']:5} {r['read_ms']:8.1f} {r['1_token_ms']:9.1f} "
              f"{r['4_token_ms']:9.1f} {r['6_token_ms']:9.1f} {r['6_over_1']:5.2f} {r['1_token_over_read']:7.2f}",
              flush=True)
    peer = llama_cpp(args.llama_python, args.threads, 64, 5)
    result["llama_cpp_smollm2_q4_1"] = peer
    if peer and not peer["ms_per_token"]:
        print(f"llama.cpp SmolLM2 Q4_1 failed ({peer['error']})")
    elif peer:
        ours = min(r["1_token_ms"] for r in result["forwards"] if r["model"] == "smollm2-135m-instruct")
        print(f"llama.cpp SmolLM2 Q4_1: {peer['ms_per_token']:.1f} ms/token; pivotspec's fastest 1-token forward "
              f"{ours:.1f} ms ({ours / peer['ms_per_token']:.2f}x)")
    result["decoding"] = decoding(args.n, args.decode_repeats, args.max_new_tokens)
    print(f"{'path':40} {'method':6} {'ms/token':>9} {'vs f32':>7} {'same as f32':>12} {'sd==ar':>7}")
    for r in result["decoding"]:
        sd_ar = "" if r["sd_equals_ar"] is None else f"{r['sd_equals_ar']}/{args.n}"
        print(f"{r['path']:40} {r['method']:6} {r['ms_per_token']:9.1f} {r['speedup_vs_float32']:6.2f}x "
              f"{r['same_tokens_as_float32']:>12} {sd_ar:>7}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
