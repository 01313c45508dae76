"""What continuing the rollouts under PAD changes in a label, on the very same candidates (issue 30).

    python benchmarks/label_shift.py labels/testbed_hard_validation.jsonl labels/testbed_hard_validation_round1.jsonl

Two labels files of the same problems, the first with target-only rollouts (round 0), the second with rollouts
under PAD (an on-policy round), find many of the same candidates: the same problem, prefix, draft token d and
target token t. On those, this compares the two files' Monte-Carlo success rates after keeping d (U_acc) and
after taking t (U_rej), how many labels agree, and how many flip, beside the share of pivots under a stricter
rule (``--rule``, e.g. mul:0.8). Nothing is decoded; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pivotspec.classifier.training import parse_pivot_rule
from pivotspec.labels.walk import is_pivot
from pivotspec.store import read_records


def candidates(path: Path) -> dict[tuple, dict]:
    """The candidates of a labels file (plain or .gz) by (problem, prefix, d, t)."""
    return {(r["problem_id"], tuple(r["prefix_ids"]), r["d"], r["t"]): r
            for r in read_records(path, repair=False) if r.get("type") == "candidate"}


def summary(rows: list[dict], rule: tuple[str, float]) -> dict:
    return {"u_acc": statistics.mean(r["u_acc"] for r in rows), "u_rej": statistics.mean(r["u_rej"] for r in rows),
            "gap": statistics.mean(r["u_rej"] - r["u_acc"] for r in rows),
            "pivots": sum(r["label"] for r in rows),
            "pivots_by_rule": sum(is_pivot(r["u_acc"], r["u_rej"], *rule) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path, help="labels with target-only rollouts")
    ap.add_argument("after", type=Path, help="labels of the same problems with rollouts under a policy")
    ap.add_argument("--rule", default="mul:0.8", help="a stricter pivot rule to count beside the files' own")
    ap.add_argument("--out", type=Path, default=None, help="JSON (default benchmarks/results/label_shift-<after>.json)")
    args = ap.parse_args()
    rule = parse_pivot_rule(args.rule)
    a, b = candidates(args.before), candidates(args.after)
    common = sorted(set(a) & set(b))
    if not common:
        raise SystemExit("label_shift: the two files share no candidate: give labels of the same problems")
    before, after = summary([a[k] for k in common], rule), summary([b[k] for k in common], rule)
    flips = {"to_pivot": sum(not a[k]["label"] and b[k]["label"] for k in common),
             "to_nonpivot": sum(a[k]["label"] and not b[k]["label"] for k in common)}
    print(f"{len(common)} candidates in both ({len(a)} in {args.before.name}, {len(b)} in {args.after.name})")
    print(f"| rollouts | mean U_acc | mean U_rej | mean U_rej - U_acc | pivots (file's rule) | pivots ({args.rule}) |")
    print("|---|---|---|---|---|---|")
    for name, s in (("target only", before), ("under the policy", after)):
        print(f"| {name} | {s['u_acc']:.3f} | {s['u_rej']:.3f} | {s['gap']:.3f} | {s['pivots']} | "
              f"{s['pivots_by_rule']} |")
    print(f"labels flipped: {flips['to_pivot']} to pivot, {flips['to_nonpivot']} to non-pivot")
    out = args.out or Path("benchmarks/results") / f"label_shift-{args.after.name.split('.')[0]}.json"
    out.write_text(json.dumps({"before": str(args.before), "after": str(args.after), "common": len(common),
                               "rule": args.rule, "target_only": before, "under_policy": after, "flips": flips},
                              indent=1))


if __name__ == "__main__":
    main()
