"""PAD vs SD vs relaxed baselines on the testbed: accuracy, tau, eta, speedup over ar and over SD.

    python benchmarks/pad_vs_sd.py --n 200 --gammas 3,5,8 --main-gamma 5 --sigmas 0.05,0.5,0.9

One `pivotspec eval` run (greedy), every method interleaved per problem so that machine drift hits all
alike: `ar` and `draft` once; `sd` and `pad` at the classifier's calibrated sigma for each gamma; a PAD
sigma sweep and every training-free baseline at two knob values at the main gamma. Rows are appended to
benchmarks/results/pad_vs_sd/results.jsonl as they come: rerun the same command to resume after a stop.
`--summarize` decodes nothing and summarises the problems that every method has finished (the table of a
run stopped early). Writes benchmarks/results/pad_vs_sd.json and prints the table. Needs the shipped
testbed classifier.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pivotspec.acceptance import Lossless
from pivotspec.baselines import label as baseline_label
from pivotspec.baselines import make_baseline
from pivotspec.cli import build_parser, load_models, make_policy
from pivotspec.evaluation import MethodSpec, evaluate, fmt, summarize
from pivotspec.store import read_records
from pivotspec.tasks import get_task
from pivotspec.testbed.artifacts import shipped_classifier

BASELINES = ["typical:epsilon=0.09,delta=0.3", "typical:epsilon=0.3,delta=0.6", "topk:k=3,ratio=0.3",
             "topk:k=5,ratio=0.1", "threshold:threshold=0.3", "threshold:threshold=0.1", "ensemble:w=0.7",
             "ensemble:w=0.5", "divergence:threshold=0.3,divergence=js", "divergence:threshold=0.6,divergence=js"]


def method_specs(ns: argparse.Namespace, target, gammas: list[int], main_gamma: int,
                 sigmas: list[float]) -> list[MethodSpec]:
    calibrated = make_policy(ns, "pad", target)
    specs = [MethodSpec("ar", "ar"), MethodSpec("draft", "draft")]
    for g in gammas:
        specs += [MethodSpec(f"sd g={g}", "sd", Lossless(), g),
                  MethodSpec(f"pad@{calibrated.sigma:.3g} g={g}", "pad", calibrated, g)]
    for sigma in sigmas:
        if abs(sigma - calibrated.sigma) > 1e-9:
            specs.append(MethodSpec(f"pad@{sigma:g} g={main_gamma}", "pad", make_policy(ns, "pad", target, sigma),
                                    main_gamma))
    for spec in BASELINES:
        policy = make_baseline(spec)
        specs.append(MethodSpec(f"{baseline_label(policy)} g={main_gamma}", "pad", policy, main_gamma))
    return specs


def complete_rows(results: Path, labels: list[str]) -> list[dict]:
    """Rows of the problems every method has finished (a stopped run leaves its last problem partial)."""
    rows = read_records(results, repair=False)  # never cut the line a running benchmark is writing
    have: dict[str, set[str]] = {}
    for r in rows:
        have.setdefault(r["problem_id"], set()).add(r["method"])
    done = {p for p, methods in have.items() if methods >= set(labels)}
    return [r for r in rows if r["problem_id"] in done and r["method"] in labels]


def table(summary: dict, labels: list[str]) -> str:
    lines = ["| method | gamma | accuracy | 95% CI | eta | tau | speedup vs ar | IQR | speedup vs sd (same gamma) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label in labels:
        s = summary[label]
        name, _, gamma = label.partition(" g=")
        sd = summary.get(f"sd g={gamma}", {}).get("speedup") if gamma else None
        vs_sd = s["speedup"] / sd if s["speedup"] and sd else None
        iqr = "-" if not s["speedup_iqr"] else f"{s['speedup_iqr'][0]:.2f}-{s['speedup_iqr'][1]:.2f}"
        lines.append(f"| {name} | {gamma or '-'} | {s['accuracy']:.3f} | [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}] | "
                     f"{fmt(s['eta'], '.3f')} | {fmt(s['tau'], '.2f')} | {fmt(s['speedup'], '.2f', 'x')} | {iqr} | "
                     f"{fmt(vs_sd, '.2f', 'x')} |")
    return "\n".join(lines)


def step_costs(rows: list[dict], labels: list[str]) -> tuple[str, dict]:
    """Where a decoding step's time goes, and the speedup each gamma would reach if every draft token were
    kept (tau = gamma + 1 at the same cost per step): the ceiling no acceptance rule can pass."""
    ar = [r["stats"] for r in rows if r["method"] == "ar"]
    ar_ms = 1000 * sum(s["wall_s"] for s in ar) / sum(s["new_tokens"] for s in ar)
    lines = ["| method | gamma | ms/step: draft | target verify | policy | all | tau | ms/token | "
             "ceiling vs ar (all drafts kept) |", "|---|---|---|---|---|---|---|---|---|"]
    costs = {}
    for label in labels:
        stats = [r["stats"] for r in rows if r["method"] == label]
        steps = sum(s["target_forwards"] for s in stats)
        if not steps:
            continue
        name, _, gamma = label.partition(" g=")
        ms = {k: 1000 * sum(s[k] for s in stats) / steps for k in ("draft_s", "target_s", "policy_s", "wall_s")}
        tau = sum(s["new_tokens"] for s in stats) / steps
        ceiling = ar_ms / (ms["wall_s"] / (int(gamma) + 1)) if gamma else None
        costs[label] = {**ms, "tau": tau, "ceiling_speedup": ceiling}
        lines.append(f"| {name} | {gamma or '-'} | {ms['draft_s']:.1f} | {ms['target_s']:.1f} | {ms['policy_s']:.1f} | "
                     f"{ms['wall_s']:.1f} | {tau:.2f} | {ms['wall_s'] / tau:.1f} | "
                     f"{fmt(ceiling, '.2f', 'x')} |")
    return "\n".join(lines), costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="test problems")
    ap.add_argument("--gammas", default="3,5,8", help="gammas for sd and pad at the calibrated sigma")
    ap.add_argument("--main-gamma", type=int, default=5, help="gamma of the sigma sweep and the baselines")
    ap.add_argument("--sigmas", default="0.3,0.5,0.7", help="PAD sigma sweep at the main gamma")
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--summarize", action="store_true", help="only summarise the rows already written")
    args = ap.parse_args()
    clf = shipped_classifier()
    if clf is None:
        raise SystemExit("pad_vs_sd: no shipped testbed classifier; train one first (see README)")
    out = args.results / "pad_vs_sd"
    ns = build_parser().parse_args(["eval", "--pair", "testbed", "--methods", "pad", "--classifier", str(clf),
                                    "--n", str(args.n), "--out", str(out), "--threads", str(args.threads)])
    target, draft = load_models(ns, needs_draft=True)
    specs = method_specs(ns, target, [int(g) for g in args.gammas.split(",")], args.main_gamma,
                         [float(s) for s in args.sigmas.split(",")])
    labels = [s.label for s in specs]
    task = get_task("arith")
    if not args.summarize:
        evaluate(ns, task, task.problems("test", args.n, 0), specs, target, draft)
    rows = complete_rows(out / "results.jsonl", labels)
    if not rows:
        raise SystemExit(f"pad_vs_sd: no problem in {out} has rows for every method yet")
    summary = summarize(rows)
    n = summary["ar"]["n"]
    cost_table, costs = step_costs(rows, [x for x in labels if x == "ar" or x.startswith(("sd ", "pad@"))])
    result = {"n_problems": n, "n_requested": args.n, "classifier": str(clf), "methods": summary, "step_costs": costs,
              "command": "python benchmarks/pad_vs_sd.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("summarize", "results"))}
    (args.results / "pad_vs_sd.json").write_text(json.dumps(result, indent=1))
    print(f"{n} test problems (of {args.n} requested), greedy, every method interleaved per problem")
    print(table(summary, labels))
    print()
    print(cost_table)


if __name__ == "__main__":
    main()
