"""Target accuracy per CPU dtype against float32, paired by problem (issue 29's quality check).

    python benchmarks/dtype_quality.py --dtypes int8 --n 300 --out benchmarks/results/dtype_quality.json

Per pair (testbed, testbed-hard) and dtype (float32 first, then each of ``--dtypes``): ``ar`` on the ``--n``
test problems, greedy, decoded in batches of ``--batch-size`` (rows equal their batch-1 decodes within a dtype,
tested), written to RESULTS/dtype_quality/<pair>-<dtype>/ (<pair>-int8-rowwise for int8 on the row-wise
kernel; resumable, like ``pivotspec eval --out``). The table gives each dtype's accuracy with its 95%
Wilson interval, the problems only float32 or only the dtype got right, McNemar's exact p, and how many
completions are identical to float32's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pivotspec import api

PAIRS = ("testbed", "testbed-hard")


def run(pair_name: str, dtype: str, n: int, batch: int, results: Path) -> dict[str, dict]:
    """``ar`` rows of one pair in one dtype, by problem id (read back when the run is already complete), in
    ``results``/<pair>-<dtype>, or <pair>-int8-rowwise for int8 on the row-wise kernel."""
    pair = api.load_pair(pair=pair_name, dtype=dtype, needs_draft=False)
    out = results / f"{pair_name}-{pair.target.placement.split(' ', 1)[1].replace(' ', '-')}"
    settings = api.EvalSettings(task=api.pair_task(pair_name), split="test", n=n, seed=0, out=out,
                                batch_size=batch)
    api.evaluate(pair, settings, methods="ar")
    return {r["problem_id"]: r for r in api.read_results(out / "results.jsonl") if r["method"] == "ar"}


def compare(base: dict[str, dict], other: dict[str, dict]) -> dict:
    ids = sorted(base.keys() & other.keys())
    right = sum(other[i]["score"] > 0.5 for i in ids)
    only_base = sum(base[i]["score"] > 0.5 >= other[i]["score"] for i in ids)
    only_other = sum(other[i]["score"] > 0.5 >= base[i]["score"] for i in ids)
    return {"n": len(ids), "accuracy": right / len(ids), "ci95": api.wilson_ci(right, len(ids)),
            "only_float32_right": only_base, "only_this_right": only_other,
            "p_mcnemar": api.mcnemar_exact(only_base, only_other),
            "identical_completions": sum(base[i]["completion"] == other[i]["completion"] for i in ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="int8", help="comma-separated dtypes to compare with float32")
    ap.add_argument("--pairs", default=",".join(PAIRS))
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results/dtype_quality"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/dtype_quality.json"))
    args = ap.parse_args()
    rows = []
    for pair_name in args.pairs.split(","):
        runs = {d: run(pair_name, d, args.n, args.batch_size, args.results)
                for d in ["float32", *args.dtypes.split(",")]}
        for dtype, got in runs.items():
            rows.append({"pair": pair_name, "dtype": dtype, **compare(runs["float32"], got)})
    print(f"{'pair':13} {'dtype':9} {'accuracy (95% CI)':>22} {'f32 only / this only':>21} {'McNemar p':>10} "
          f"{'identical':>10}")
    for r in rows:
        lo, hi = r["ci95"]
        print(f"{r['pair']:13} {r['dtype']:9} {r['accuracy']:8.3f} ({lo:.3f}-{hi:.3f}) "
              f"{r['only_float32_right']:>10} / {r['only_this_right']:<8} {r['p_mcnemar']:10.2f} "
              f"{r['identical_completions']:>6}/{r['n']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": api.cpu_capabilities(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
