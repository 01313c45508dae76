"""PAD vs SD vs relaxed baselines on the testbed: accuracy, tau, eta, speedup, for several gammas.

    python benchmarks/pad_vs_sd.py --n 200 --gammas 3,5,8 --sigmas 0.3,0.5,0.7

For each gamma it runs one `pivotspec eval` (every method interleaved per problem, greedy) into
benchmarks/results/pad_vs_sd-g{gamma}/ (resumable: rerunning continues where it stopped), then writes
benchmarks/results/pad_vs_sd.json and prints the combined table. Needs the shipped testbed classifier.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pivotspec.cli import build_parser, load_models
from pivotspec.evaluation import evaluate, parse_specs
from pivotspec.tasks import get_task
from pivotspec.testbed.artifacts import shipped_classifier

BASELINES = ["typical:epsilon=0.09,delta=0.3", "typical:epsilon=0.3,delta=0.6", "topk:k=3,ratio=0.3",
             "topk:k=5,ratio=0.1", "threshold:threshold=0.3", "threshold:threshold=0.1", "ensemble:w=0.7",
             "ensemble:w=0.5", "divergence:threshold=0.3,divergence=js", "divergence:threshold=0.6,divergence=js"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--gammas", default="3,5,8")
    ap.add_argument("--sigmas", default="0.3,0.5,0.7")
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    clf = shipped_classifier()
    if clf is None:
        raise SystemExit("pad_vs_sd: no shipped testbed classifier; train one first (see README)")
    task = get_task("arith")
    problems = task.problems("test", args.n, 0)
    combined = {}
    target = draft = None
    for gamma in [int(g) for g in args.gammas.split(",")]:
        out = args.results / f"pad_vs_sd-g{gamma}"
        argv = ["eval", "--pair", "testbed", "--methods", "ar,draft,sd,pad", "--classifier", str(clf),
                "--sigmas", args.sigmas, "--gamma", str(gamma), "--n", str(args.n), "--out", str(out),
                "--threads", str(args.threads)]
        for b in BASELINES:
            argv += ["--baseline", b]
        ns = build_parser().parse_args(argv)
        if target is None:
            target, draft = load_models(ns, needs_draft=True)
        summary = evaluate(ns, task, problems, parse_specs(ns, target), target, draft)
        combined[f"gamma={gamma}"] = summary
    (args.results / "pad_vs_sd.json").write_text(json.dumps(combined, indent=1))
    print("| gamma | method | accuracy | 95% CI | eta | tau | speedup vs ar | speedup vs sd |")
    print("|---|---|---|---|---|---|---|---|")
    for g, summary in combined.items():
        sd = summary["sd"]["speedup"]
        for label, s in summary.items():
            vs_sd = s["speedup"] / sd if s["speedup"] and sd else None
            print(f"| {g.split('=')[1]} | {label} | {s['accuracy']:.3f} | [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}] | "
                  f"{'-' if s['eta'] is None else format(s['eta'], '.3f')} | "
                  f"{'-' if s['tau'] is None else format(s['tau'], '.2f')} | {s['speedup']:.2f}x | "
                  f"{'-' if vs_sd is None else format(vs_sd, '.2f') + 'x'} |")


if __name__ == "__main__":
    main()
