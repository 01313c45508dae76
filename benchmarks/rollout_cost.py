"""What a label costs under PAD's own policy against target-only rollouts (issue 30, item 6), in one run.

    python benchmarks/rollout_cost.py --pair testbed --n-problems 4 --repeats 2

Labels the same first ``--n-problems`` problems twice per repeat, once with every rollout continued by the
target alone (``--rollout-policy target``, round 0's labels) and once under PAD with the pair's shipped
classifier at its calibrated sigma (``--rollout-policy pad``, the on-policy rounds), the order alternating
per repeat, each into a fresh file (nothing resumed). The two walks find other candidates (the PAD walk
follows PAD's greedy trajectory), so the comparable figures are per candidate and per rollout token. Prints
the medians and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pivotspec import api

POLICIES = ("target", "pad")


def one_run(pair: api.Pair, policy: str, args: argparse.Namespace, out: Path) -> dict:
    """Label into ``out`` (overwritten) under ``policy``; wall time, candidates and rollout tokens."""
    start = time.perf_counter()
    records = api.label(pair, out, task=args.task, split=args.split, n_problems=args.n_problems, overwrite=True,
                        concurrency=args.concurrency, rollouts=args.rollouts, temperature=args.temperature,
                        mode="mul", alpha=0.5, max_rollout_tokens=args.max_rollout_tokens, seed=0,
                        rollout_policy=policy)
    wall = time.perf_counter() - start
    cands = [r for r in records if r.get("type") == "candidate"]
    tokens = sum(r.get("rollout_tokens", 0) for r in cands)
    return {"policy": policy, "wall_s": wall, "candidates": len(cands), "rollout_tokens": tokens,
            "s_per_candidate": wall / max(1, len(cands)), "rollout_tokens_per_s": tokens / wall,
            "pivot_share": sum(r["label"] for r in cands) / max(1, len(cands))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="testbed")
    ap.add_argument("--task", default=None, help="default: the pair's task")
    ap.add_argument("--split", default="train")
    ap.add_argument("--n-problems", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-rollout-tokens", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 (default, as the labels files), bfloat16 or auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/rollout_cost.json"))
    args = ap.parse_args()
    args.task = api.task_for(args.task, args.pair)
    pair = api.load_pair(pair=args.pair, threads=args.threads, dtype=args.dtype, needs_draft=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for policy in POLICIES if rep % 2 == 0 else POLICIES[::-1]:
                runs.append({"repeat": rep, **one_run(pair, policy, args, Path(tmp) / f"{policy}.jsonl")})
                print(json.dumps(runs[-1]))
    med = {p: {k: statistics.median(r[k] for r in runs if r["policy"] == p)
               for k in ("wall_s", "candidates", "s_per_candidate", "rollout_tokens_per_s", "pivot_share")}
           for p in POLICIES}
    ratio = med["pad"]["s_per_candidate"] / med["target"]["s_per_candidate"]
    print(f"\n{args.n_problems} {args.task} problems ({args.split}), {args.rollouts} rollouts per branch, "
          f"temperature {args.temperature}, concurrency {args.concurrency}, {args.dtype}; medians of {args.repeats}")
    print("| rollouts | wall s | candidates | s per candidate | candidates per minute | rollout tokens/s | pivots |")
    print("|---|---|---|---|---|---|---|")
    for p in POLICIES:
        m = med[p]
        print(f"| {p} | {m['wall_s']:.1f} | {m['candidates']:g} | {m['s_per_candidate']:.2f} | "
              f"{60 / m['s_per_candidate']:.1f} | {m['rollout_tokens_per_s']:.1f} | {m['pivot_share']:.2f} |")
    print(f"a candidate under PAD's policy costs {ratio:.2f}x a target-only one")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "out"},
                                    "runs": runs, "median": med, "pad_over_target_per_candidate": ratio}, indent=1))


if __name__ == "__main__":
    main()
