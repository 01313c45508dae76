"""Decoding many sequences at once, offline: eval throughput at batch sizes 1, 8 and 32, and the memory a row
costs.

    python benchmarks/batch_throughput.py --pair testbed --n 48 --batch-sizes 1,8,32

For each batch size, `pivotspec eval` (through the API) decodes the same test problems with ar, sd and pad
(greedy): tokens/s per method (all its new tokens over the wall time of its passes), and whether every
completion equals the batch-1 run's. Memory: the KV caches of a full batch of the pair's problems at its
largest (allocated bytes over rows, target and draft together), next to the weights' bytes. Writes
benchmarks/results/batch_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def cache_per_row(pair, rows: int, max_new_tokens: int) -> dict:
    """Decode ``rows`` test problems in one batch with PAD, recording the caches' size at each step."""
    from pivotspec import api

    task = api.get_task(api.pair_task(pair.name))
    batch = api.new_batch(pair)
    for p in task.problems("test", rows, seed=3):
        batch.add(api.make_request(pair, messages=p.messages, method="pad", max_new_tokens=max_new_tokens))
    peak, peak_rows = 0, 0
    while batch.rows:
        if batch.cache_bytes() > peak:
            peak, peak_rows = batch.cache_bytes(), len(batch.rows)
        batch.step()
    weights = sum(p.numel() * p.element_size() for lm in (pair.target, pair.draft) for p in lm.model.parameters())
    return {"rows": rows, "peak_cache_bytes": peak, "rows_at_peak": peak_rows,
            "cache_bytes_per_row": peak / max(1, peak_rows), "weights_bytes": weights}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="testbed")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--methods", default="ar,sd,pad")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default=None, help="auto, cpu, cuda, ... (default: auto)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the device's)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/batch_throughput.json"))
    args = ap.parse_args()
    from pivotspec import api

    pair = api.load_pair(pair=args.pair, threads=args.threads, device=args.device, dtype=args.dtype)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    runs: dict[int, dict] = {}
    for b in sizes:
        out = Path(tempfile.mkdtemp(prefix=f"batch{b}."))
        start = time.perf_counter()
        summary = api.evaluate(pair, methods=args.methods, task=api.pair_task(args.pair), n=args.n,
                               max_new_tokens=args.max_new_tokens, batch_size=b, out=out)
        rows = {(r["problem_id"], r["method"]): r["completion"] for r in api.read_results(out / "results.jsonl")}
        runs[b] = {"wall_s": time.perf_counter() - start, "summary": summary, "completions": rows}
    first = runs[sizes[0]]
    table = []
    for b in sizes:
        for label, s in runs[b]["summary"].items():
            tokens_per_s = s.get("tokens_per_s") or 1000 / s["ms_per_token"]
            same = sum(v == first["completions"].get(k) for k, v in runs[b]["completions"].items() if k[1] == label)
            table.append({"batch_size": b, "method": label, "accuracy": s["accuracy"], "tau": s["tau"],
                          "tokens_per_s": tokens_per_s, "identical_to_first": f"{same}/{s['n']}"})
    base = {r["method"]: r["tokens_per_s"] for r in table if r["batch_size"] == sizes[0]}
    for r in table:
        r["throughput_vs_first"] = r["tokens_per_s"] / base[r["method"]]
    memory = cache_per_row(pair, max(sizes), args.max_new_tokens)
    result = {"meta": {"pair": args.pair, "n": args.n, "max_new_tokens": args.max_new_tokens,
                       "threads": args.threads, "cpu": os.cpu_count(), "device": str(pair.target.device),
                       "dtype": str(pair.target.model.dtype)}, "rows": table, "memory": memory,
              "wall_s": {b: runs[b]["wall_s"] for b in sizes}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.pair} pair, {args.n} test problems, greedy, gamma 5, {args.threads} threads")
    print(f"| batch | method | accuracy | tau | tokens/s | vs batch {sizes[0]} | same completions |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['batch_size']} | {r['method']} | {r['accuracy']:.3f} | {r['tau']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r['throughput_vs_first']:.2f}x | {r['identical_to_first']} |")
    print(f"KV cache per row (PAD, {memory['rows']} rows, target + draft): "
          f"{memory['cache_bytes_per_row'] / 2**20:.1f} MiB at the peak ({memory['peak_cache_bytes'] / 2**20:.0f} MiB "
          f"for {memory['rows_at_peak']} rows); weights {memory['weights_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
