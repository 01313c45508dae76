"""Rollout throughput for labeling: all 2N continuations as one batch vs one continuation at a time.

    python benchmarks/labeling_speed.py --target testbed-target --n-prefixes 3 --rollouts 20 --repeats 3

For each prefix (the prompt plus the first tokens of the target's own greedy answer, so rollouts run in
the middle of a solution as they do when labeling), both ways sample 2N continuations with the same
settings; the table reports rollout tokens per second (median over interleaved repeats) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pivotspec.decoding.loop import decode
from pivotspec.decoding.models import eos_ids, load_lm
from pivotspec.decoding.sampling import SamplingConfig
from pivotspec.labels.rollouts import batched_rollouts
from pivotspec.labels.walk import seeded_generator
from pivotspec.tasks import encode_problem, get_task


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    conts = fn()
    return time.perf_counter() - start, sum(len(c) for c in conts)


def rollouts(way: str, lm, head, firsts, cfg, max_tokens, stop, gen):
    if way == "batched":
        return batched_rollouts(lm, head, firsts, cfg, max_tokens, stop, gen)
    return [c for f in firsts for c in batched_rollouts(lm, head, [f], cfg, max_tokens, stop, gen)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="testbed-target")
    ap.add_argument("--n-prefixes", type=int, default=3)
    ap.add_argument("--rollouts", type=int, default=20, help="N per side: 2N continuations per prefix")
    ap.add_argument("--max-rollout-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/labeling_speed.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_lm(args.target)
    stop = eos_ids(lm)
    cfg = SamplingConfig(0.7)
    prefixes = []
    for p in get_task("arith").problems("train", args.n_prefixes, seed=1):
        ids = encode_problem(lm.tokenizer, p)
        greedy = decode("ar", lm, None, ids, max_new_tokens=12, eos_ids=stop).token_ids
        prefixes.append(ids + greedy[:10])
    rates = {"batched": [], "sequential": []}
    for r in range(args.repeats):
        totals = {"batched": [0.0, 0], "sequential": [0.0, 0]}
        for i, prefix in enumerate(prefixes):
            firsts = [prefix[-1]] * (2 * args.rollouts)
            ways = ["batched", "sequential"] if r % 2 == 0 else ["sequential", "batched"]
            for name in ways:
                secs, tokens = timed(lambda name=name, prefix=prefix, firsts=firsts, i=i, r=r: rollouts(
                    name, lm, prefix[:-1], firsts, cfg, args.max_rollout_tokens, stop, seeded_generator(r, i)))
                totals[name][0] += secs
                totals[name][1] += tokens
        for name, (secs, tokens) in totals.items():
            rates[name].append(tokens / secs)
    result = {name: statistics.median(v) for name, v in rates.items()}
    result["ratio"] = result["batched"] / result["sequential"]
    result["config"] = {k: str(v) for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("| rollouts | tokens/s (median) |\n|---|---|")
    print(f"| batched (2N={2 * args.rollouts} rows, shared prefix cache) | {result['batched']:.1f} |")
    print(f"| one at a time | {result['sequential']:.1f} |")
    print(f"| ratio | {result['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
