"""How much a batch can gain on this machine: the cost of a forward as rows are added, and the gain it allows.

    python benchmarks/row_scaling.py --pair testbed --batch-sizes 1,4,8,16 --repeats 5

A batched speculative step computes, for each of B rows, what batch 1 computes: the target's verification of
gamma + 1 tokens and gamma draft forwards of one token. So B rows can decode at most B x step(1) / step(B)
times as many tokens a second as one row, whatever the loop around them does: that ratio is the ceiling of
`serve_batching.py`'s throughput ratio and `batch_throughput.py`'s gains. This times both models as the pair
loads them (the CPU fast path's dtype and kernels), B rows x (gamma + 1) tokens for the target and B rows x 1
token for the draft, each after 64 cached tokens per row, interleaved over the batch sizes, medians of
``--repeats``; and the target's forward over the median test prompt of the pair's task, which every request
costs once at any batch size (so the more of a request's time its prompt takes, the less batching can gain).
Prints a table and writes benchmarks/results/row_scaling.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def forward_ms(model: torch.nn.Module, rows: int, width: int, context: int = 64) -> float:
    """One forward of ``rows`` x ``width`` new tokens over ``rows`` caches of ``context`` tokens, in ms."""
    from pivotspec.decoding.forward import model_forward
    from pivotspec.decoding.kvcache import growing_cache

    vocab = int(model.config.vocab_size)
    prompt = torch.arange(context).remainder(vocab).repeat(rows, 1)
    step = torch.arange(width).remainder(vocab).repeat(rows, 1)
    with torch.inference_mode():
        cache = growing_cache(model.config)
        model_forward(model, prompt, cache)
        start = time.perf_counter()
        model_forward(model, step, cache, keep=width)
        return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="testbed")
    ap.add_argument("--batch-sizes", default="1,4,8,16")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds; each times every shape once")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="pin a dtype (default: the fast path's choice)")
    ap.add_argument("--serving", action="store_true",
                    help="the CPU path `pivotspec serve` chooses (timed at a full batch's forward too)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/row_scaling.json"))
    args = ap.parse_args()
    from pivotspec import api

    pair = api.load_pair(pair=args.pair, threads=args.threads, dtype=args.dtype, serving=args.serving)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    shapes = [(name, lm.model, b, width) for b in sizes
              for name, lm, width in (("target", pair.target, args.gamma + 1), ("draft", pair.draft, 1))]
    for _name, model, b, width in shapes:  # warm-up: first calls allocate and build kernels
        forward_ms(model, b, width)
    times: dict[tuple[str, int], list[float]] = {(name, b): [] for name, _, b, _ in shapes}
    # A prompt is computed once per request at any batch size, so it is a cost batching cannot share.
    task = api.get_task(api.pair_task(args.pair))
    prompt = int(statistics.median(len(api.encode(pair.target, messages=p.messages))
                                   for p in task.problems("test", 16, seed=0)))
    times[("prefill", 1)] = []
    for _ in range(args.repeats):
        for name, model, b, width in shapes:
            times[(name, b)].append(forward_ms(model, b, width))
        times[("prefill", 1)].append(forward_ms(pair.target.model, 1, prompt, context=1))
    ms = {key: statistics.median(v) for key, v in times.items()}
    step1 = ms[("target", sizes[0])] + args.gamma * ms[("draft", sizes[0])]
    rows = []
    for b in sizes:
        step = ms[("target", b)] + args.gamma * ms[("draft", b)]
        rows.append({"batch": b, "target_ms": ms[("target", b)], "draft_ms": ms[("draft", b)], "step_ms": step,
                     "step_vs_first": step / step1, "ceiling": b * step1 / step / sizes[0]})
    print(f"{args.pair} pair, {api.cpu_capabilities()['cpu']}, {args.threads} threads, gamma "
          f"{args.gamma}; target {pair.target.model.dtype}, draft {pair.draft.model.dtype}; medians of "
          f"{args.repeats} interleaved repeats")
    print(f"| rows | target forward, rows x {args.gamma + 1} tokens | draft forward, rows x 1 token | "
          f"step (target + {args.gamma} drafts) | step vs {sizes[0]} row(s) | throughput ceiling vs {sizes[0]} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['target_ms']:.1f} ms | {r['draft_ms']:.2f} ms | {r['step_ms']:.1f} ms | "
              f"{r['step_vs_first']:.2f}x | {r['ceiling']:.2f}x |")
    print(f"prefill of the median test prompt ({prompt} tokens), target: {ms[('prefill', 1)]:.1f} ms")
    meta = {"pair": args.pair, "prompt_tokens": prompt, "prefill_ms": ms[("prefill", 1)], "gamma": args.gamma,
            "threads": args.threads, "repeats": args.repeats, "serving": args.serving,
            "target_dtype": str(pair.target.model.dtype), "draft_dtype": str(pair.draft.model.dtype),
            "machine": api.cpu_capabilities(), "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows,
                                    "times_ms": {f"{k[0]} x{k[1]}": v for k, v in times.items()}}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
