"""Both embedded pairs' PAD-vs-rules frontiers in one figure, side by side, from the JSON pad_vs_sd.py wrote.

    python benchmarks/frontiers.py    # writes benchmarks/results/frontiers.png

Top row `testbed` (arith: the probability rules are already strong), bottom row `testbed-hard` (arith-hard:
the draft writes in its own style). Nothing is decoded: it reads benchmarks/results/pad_vs_sd.json and
pad_vs_sd-testbed-hard.json, so it shows exactly the runs the README's tables come from.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pad_vs_sd import draw_frontier

PAIRS = {"testbed (arith)": "pad_vs_sd.json", "testbed-hard (arith-hard)": "pad_vs_sd-testbed-hard.json"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--main-gamma", type=int, default=5)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for title, name in PAIRS.items():
        path = args.results / name
        if not path.exists():
            raise SystemExit(f"frontiers: {path} not found; run benchmarks/pad_vs_sd.py for that pair first")
        runs[title] = json.loads(path.read_text())
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 4.6 * len(runs)), squeeze=False)
    for row, (title, run) in zip(axes, runs.items(), strict=True):
        summary = run["methods"]
        draw_frontier(row, summary, list(summary), args.main_gamma,
                      f"{title}: {run['n_problems']} test problems, greedy")
    fig.tight_layout()
    out = args.results / "frontiers.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
