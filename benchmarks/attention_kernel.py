"""The per-query attention kernel (``decoding/query_attention.c``) against an earlier version of itself and
against PyTorch, as key counts grow.

    python benchmarks/attention_kernel.py --base 2674f63 --keys 64,160,256,512,1024

One call attends a batch of 8 PAD rows at gamma 5 (8 rows x 6 queries) of the testbed target's shape (9 query
heads over 3 key heads of 64 columns, bfloat16 keys and values, float32 queries), each query over exactly its
keys (the last query of a row over ``keys``). Times, interleaved per repeat and per key count: the kernel built
from this checkout's source; the same kernel built from ``git show BASE:src/pivotspec/decoding/query_attention.c``;
and PyTorch's ``scaled_dot_product_attention``, the peer, once per query over its keys as
``attention.sdpa_in_float32`` calls it (exact) and once for all queries of the call with a causal mask (one call,
not exact: its sums depend on the padding). Checks that the two kernel builds give the same bits. Prints a table
of medians and writes benchmarks/results/attention_kernel.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pivotspec.decoding import compiled, query_attention
from pivotspec.decoding.machine import cpu_name

ROWS, HEADS, KV_HEADS, WIDTH, DIM = 8, 9, 3, 6, 64


def inputs(keys: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(keys)
    q = torch.randn(ROWS, HEADS, WIDTH, DIM, generator=g)
    k = torch.randn(ROWS, KV_HEADS, keys + 32, DIM, generator=g).to(torch.bfloat16)  # spare cache rows, as a batch
    v = torch.randn(ROWS, KV_HEADS, keys + 32, DIM, generator=g).to(torch.bfloat16)
    counts = [[keys - WIDTH + i + 1 for i in range(WIDTH)] for _ in range(ROWS)]
    return q, k, v, counts


def run_kernel(fn, q, k, v, counts) -> torch.Tensor:
    """``query_attention.attend`` with another build of the kernel."""
    saved = query_attention.kernel
    query_attention.kernel = lambda: fn
    try:
        return query_attention.attend(q, k, v, counts, DIM ** -0.5)
    finally:
        query_attention.kernel = saved


def per_query(q, k, v, counts) -> None:
    kf, vf = k.float().repeat_interleave(HEADS // KV_HEADS, 1), v.float().repeat_interleave(HEADS // KV_HEADS, 1)
    for r in range(ROWS):
        for i in range(WIDTH):
            n = counts[r][i]
            F.scaled_dot_product_attention(q[r:r + 1, :, i:i + 1], kf[r:r + 1, :, :n], vf[r:r + 1, :, :n])


def one_call(q, k, v, counts) -> None:
    n = max(max(c) for c in counts)
    kf, vf = k[:, :, :n].float(), v[:, :, :n].float()
    mask = torch.arange(n)[None, :] < torch.tensor(counts[0])[:, None]
    F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, enable_gqa=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="a git revision whose query_attention.c to compare against")
    ap.add_argument("--keys", default="64,160,256,512,1024")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    ap.add_argument("--calls", type=int, default=50, help="calls timed per method, round and key count")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/attention_kernel.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    source = subprocess.run(["git", "show", f"{args.base}:src/pivotspec/decoding/query_attention.c"],
                            capture_output=True, text=True, check=True).stdout
    base_dir = Path(tempfile.mkdtemp())
    (base_dir / "query_attention.c").write_text(source)
    builds = {"kernel": query_attention.kernel(), "base": compiled.load(base_dir / "query_attention.c", "attend",
                                                                          query_attention._ARGS)}
    if None in builds.values():
        raise SystemExit("the kernel did not build here (no C compiler?)")
    keys = [int(x) for x in args.keys.split(",")]
    methods = {"kernel": lambda *a: run_kernel(builds["kernel"], *a), "base": lambda *a: run_kernel(builds["base"], *a),
               "torch per query": per_query, "torch one call": one_call}
    data = {n: inputs(n) for n in keys}
    same = {n: torch.equal(methods["kernel"](*data[n]), methods["base"](*data[n])) for n in keys}
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in methods for n in keys}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for n in keys:
                for name, fn in methods.items():
                    fn(*data[n])  # warm
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        fn(*data[n])
                    times[(name, n)].append((time.perf_counter() - start) / args.calls * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for n in keys:
        flops = ROWS * WIDTH * HEADS * 4 * DIM * (n - WIDTH / 2 + 0.5)  # scores and weighted sum, 2 flops each
        rows.append({"keys": n, **{f"{m}_ms": ms[(m, n)] for m in methods}, "base_vs_kernel": ms[("base", n)]
                     / ms[("kernel", n)], "gflops": flops / ms[("kernel", n)] / 1e6, "same_bits_as_base": same[n]})
    print(f"{cpu_name()}, {args.threads} threads; {ROWS} rows x {WIDTH} queries, {HEADS} heads over {KV_HEADS} key "
          f"heads of {DIM}; medians of {args.repeats} interleaved rounds of {args.calls} calls; base {args.base}")
    print("| keys (last query) | kernel | base | base / kernel | kernel GFLOP/s | torch, one call per query | "
          "torch, one call (not exact) | same bits as base |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['keys']} | {r['kernel_ms']:.3f} ms | {r['base_ms']:.3f} ms | {r['base_vs_kernel']:.2f}x | "
              f"{r['gflops']:.0f} | {r['torch per query_ms']:.2f} ms | {r['torch one call_ms']:.3f} ms | "
              f"{r['same_bits_as_base']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": {"cpu": cpu_name(), "threads": args.threads, "base": args.base,
                                             "repeats": args.repeats, "calls": args.calls, "torch": torch.__version__},
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
