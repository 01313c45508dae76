"""Prefix caching on and off, in one process: what taking a shared prompt start's keys saves a batch.

    python benchmarks/prefix_caching.py --pair testbed --n 32 --batch-sizes 1,8 --repeats 3

Decodes the same arith test problems (chat prompts that share their system prompt) with PAD, greedy, through
a batch (``api.new_batch(...).decode``) at each batch size, with ``prefix_caching`` on and off, interleaved
over ``--repeats`` (medians). Reports tokens/s, the share of prompt tokens taken from held keys, and whether
every output equals the run without prefix caching. Where the pair's models do not compute each token alike
(``Batch.token_exact``: float32 on a CPU, or PyTorch's per-query attention) nothing is taken and the two
runs are the same. Prints a table and writes benchmarks/results/prefix_caching.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="testbed")
    ap.add_argument("--n", type=int, default=32, help="test problems")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="pin a dtype (default: the fast path's choice)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_caching.json"))
    args = ap.parse_args()
    from pivotspec import api

    pair = api.load_pair(pair=args.pair, threads=args.threads, dtype=args.dtype)
    problems = api.get_task(api.pair_task(args.pair)).problems("test", args.n, seed=0)

    def requests() -> list:
        return [api.make_request(pair, messages=p.messages, method="pad", max_new_tokens=args.max_new_tokens)
                for p in problems]

    api.new_batch(pair).decode(requests()[:2], 2)  # warm-up
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    runs: dict[tuple[int, bool], list[dict]] = {(b, on): [] for b in sizes for on in (True, False)}
    for _ in range(args.repeats):
        for b in sizes:
            for on in (True, False):
                start = time.perf_counter()
                gens = api.new_batch(pair, prefix_caching=on).decode(requests(), b)
                wall = time.perf_counter() - start
                runs[(b, on)].append({"wall_s": wall, "tokens": sum(len(g.token_ids) for g in gens),
                                      "prompt_tokens": sum(g.stats["prompt_tokens"] for g in gens),
                                      "cached_tokens": sum(g.stats["cached_prompt_tokens"] for g in gens),
                                      "outputs": [g.token_ids for g in gens]})
    rows = []
    print(f"{args.pair} pair, {api.cpu_capabilities()['cpu']}, {args.n} test problems, PAD greedy, target "
          f"{pair.target.model.dtype}; medians of {args.repeats} interleaved repeats")
    print("| batch | prefix caching | tokens/s | prompt tokens taken | on vs off | outputs equal to off |")
    print("|---|---|---|---|---|---|")
    for b in sizes:
        off = statistics.median(r["tokens"] / r["wall_s"] for r in runs[(b, False)])
        for on in (True, False):
            rs = runs[(b, on)]
            rate = statistics.median(r["tokens"] / r["wall_s"] for r in rs)
            taken = rs[0]["cached_tokens"] / max(1, rs[0]["prompt_tokens"])
            same = sum(a == o for r, ref in zip(rs, runs[(b, False)], strict=True)
                       for a, o in zip(r["outputs"], ref["outputs"], strict=True))
            rows.append({"batch": b, "prefix_caching": on, "tokens_per_s": rate, "taken_share": taken,
                         "vs_off": rate / off, "equal_outputs": f"{same}/{len(rs) * args.n}",
                         "walls_s": [r["wall_s"] for r in rs]})
            print(f"| {b} | {'on' if on else 'off'} | {rate:.1f} | {taken:.1%} | {rate / off:.2f}x | "
                  f"{same}/{len(rs) * args.n} |")
    meta = {"pair": args.pair, "n": args.n, "repeats": args.repeats, "threads": args.threads,
            "target_dtype": str(pair.target.model.dtype), "machine": api.cpu_capabilities(), "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
