"""PAD per token (sigma) against PAD per answer (budget), off- and on-policy, knobs chosen on problems no
classifier saw and measured on the test problems (issue 30).

    python benchmarks/budget_frontier.py --pair testbed-hard --classifier r0=runs/r0 \
        --classifier r1-union=runs/r1-union --sigmas 0.05,0.1,0.2,0.3 --budgets 0.1,0.2,0.4,0.8,1.6 \
        --both 0.2:0.2,0.2:0.4,0.2:0.8,0.3:0.2,0.3:0.4,0.3:0.8

1. Selection: every classifier's sigmas, budgets and (sigma, budget) pairs on ``--select-n`` validation
   problems drawn with ``--select-seed`` (1: problems the labels, drawn with seed 0, never contain), beside
   `ar` and `sd`. Per classifier and per kind (sigma, budget, both), the chosen point is the highest eta within
   ``--within`` of `ar`'s accuracy on those problems (none there: the most accurate one).
2. Test: `ar`, `sd`, the rules (``--rule``, default: knob values from the pair's README table) and every
   chosen point on the ``--n`` test problems (seed 0, the README's), all greedy at gamma 5 and decoded in
   batches of ``--batch-size`` (same tokens as batch 1; eta and tau, not wall-clock speedups: batched rows
   overlap in time). Accuracy differences get McNemar's exact test, paired by problem, against `ar`.

Each classifier's runs go to RESULTS/budget_frontier/<stage>-<name>/ for testbed-hard and to
RESULTS/budget_frontier-<pair>/<stage>-<name>/ for another pair (resumable, like `pivotspec eval --out`); the
table is printed and written to RESULTS/<--name>.json (default budget_frontier.json).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from pivotspec import api

# per pair, the rules of its README table worth measuring beside PAD: on testbed-hard the best rule within 1 point
# of ar and the rule nearest eta 0.75; on testbed (arith) every family's points within 1 point of ar and
# threshold(0.1), the rule whose eta passes PAD's 0.895
RULES = {"testbed-hard": ["ensemble:w=0.5", "threshold:threshold=0.1"],
         "testbed": ["typical:epsilon=0.3,delta=0.5477", "topk:k=5,ratio=0.5", "threshold:threshold=0.3",
                     "threshold:threshold=0.1", "ensemble:w=0.5", "divergence:threshold=0.1,divergence=js"]}


def run(pair: api.Pair, task: str, split: str, n: int, seed: int, batch: int, out: Path,
        specs: list[api.MethodSpec], classifier: str | None) -> list[dict]:
    """One resumable eval run of ``specs``; its rows."""
    settings = api.EvalSettings(task=task, split=split, n=n, seed=seed, classifier=classifier, out=out,
                                batch_size=batch)
    api.evaluate(pair, settings, specs=specs)
    return api.read_results(out / "results.jsonl")


def pad_specs(pair: api.Pair, path: str, sigmas=(), budgets=(), combos=()) -> list[api.MethodSpec]:
    """PAD per budget, per sigma, and per (sigma, budget) pair (the per-token rule inside the budget)."""
    specs = api.method_specs(pair, "pad", budgets=list(budgets), classifier=path) if budgets else []
    specs += api.method_specs(pair, "pad", sigmas=list(sigmas), classifier=path) if sigmas else []
    for sig, b in combos:
        specs += api.method_specs(pair, "pad", sigmas=[sig], budgets=[b], classifier=path)
    return specs


def kind(label: str) -> str:
    """sigma, budget or both, from a PAD label such as r0:pad@0.1, r0:pad-budget@0.2, r0:pad@0.2 budget=0.4."""
    pad = label.split(":", 1)[1]
    return "both" if " budget=" in pad else "budget" if pad.startswith("pad-budget") else "sigma"


def knobs(label: str) -> dict:
    pad = label.split(":", 1)[1]
    if kind(label) == "budget":
        return {"budgets": [float(pad.split("@")[1])]}
    sig = float(pad.split("@")[1].split()[0])
    return {"combos": [(sig, float(pad.split("budget=")[1]))]} if kind(label) == "both" else {"sigmas": [sig]}


def tagged(rows: list[dict], name: str) -> list[dict]:
    """The PAD rows of one classifier's run, named after it (two classifiers' pad@0.1 are other methods)."""
    return [{**r, "method": f"{name}:{r['method']}"} for r in rows if r["method"].startswith("pad")]


def choose(summary: dict, labels: list[str], within: float) -> str:
    """The highest-eta label within ``within`` of ar's accuracy, else the most accurate."""
    ar = summary["ar"]["accuracy"]
    close = [m for m in labels if summary[m]["accuracy"] >= ar - within - 1e-9]
    if close:
        return max(close, key=lambda m: (summary[m]["eta"], summary[m]["accuracy"]))
    return max(labels, key=lambda m: (summary[m]["accuracy"], summary[m]["eta"]))


def table(summary: dict, chosen: set[str]) -> str:
    lines = ["| method | accuracy | 95% CI | vs ar (McNemar) | eta | tau | overrides/answer | predicted drop spent |",
             "|---|---|---|---|---|---|---|---|"]
    for m, s in summary.items():
        p = s["paired"].get("ar")
        vs = f"{p['diff']:+.3f} (p {p['p_mcnemar']:.2g})" if p else "-"
        eta = f"{s['eta']:.3f}" if s["eta"] is not None else "-"
        mark = " (chosen)" if m in chosen else ""
        lines.append(f"| {m}{mark} | {s['accuracy']:.3f} | [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}] | {vs} | {eta} "
                     f"| {s['tau']:.2f} | {s['overrides']:.1f} | {s['spent']} |")
    return "\n".join(lines)


def with_overrides(summary: dict, rows: list[dict]) -> dict:
    for m, s in summary.items():
        mine = [r for r in rows if r["method"] == m]
        s["overrides"] = sum(r["stats"]["override"] for r in mine) / len(mine)
        spent = [r["stats"]["budget_spent"] for r in mine if "budget_spent" in r["stats"]]
        s["spent"] = f"{sum(spent) / len(spent):.3f}" if spent else "-"
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="testbed-hard")
    ap.add_argument("--classifier", action="append", required=True, help="NAME=DIR (repeatable)")
    ap.add_argument("--sigmas", default="0.05,0.1,0.2,0.3")
    ap.add_argument("--budgets", default="0.1,0.2,0.4,0.8,1.6")
    ap.add_argument("--both", default="", help="(sigma:budget) pairs, e.g. 0.2:0.4,0.3:0.4: the per-token rule "
                    "inside the budget")
    ap.add_argument("--more-sigmas", default="", help="sigmas added after a first selection run (their own run)")
    ap.add_argument("--test-kinds", default="sigma,budget,both", help="which kinds' chosen points the test runs")
    ap.add_argument("--rule", action="append", default=None,
                    help="baseline spec, repeatable (default: the pair's README rules: "
                    + "; ".join(f"{p}: {', '.join(r)}" for p, r in RULES.items()) + ")")
    ap.add_argument("--select-n", type=int, default=100)
    ap.add_argument("--select-seed", type=int, default=1)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--within", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 (default, as the stored runs), bfloat16 or auto")
    ap.add_argument("--select-only", action="store_true", help="stop after the selection stage")
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="budget_frontier", help="the JSON's name under RESULTS (one per study)")
    args = ap.parse_args()
    classifiers = dict(c.split("=", 1) for c in args.classifier)
    sigmas = [float(x) for x in args.sigmas.split(",") if x]
    budgets = [float(x) for x in args.budgets.split(",") if x]
    combos = [tuple(float(v) for v in x.split(":")) for x in args.both.split(",") if x]
    more = [float(x) for x in args.more_sigmas.split(",") if x]
    task = api.pair_task(args.pair)
    pair = api.load_pair(pair=args.pair, threads=args.threads, dtype=args.dtype)
    root = args.results / ("budget_frontier" if args.pair == "testbed-hard" else f"budget_frontier-{args.pair}")

    # 1. selection
    base = api.method_specs(pair, "ar,sd")
    sel_rows = [r for r in run(pair, task, "validation", args.select_n, args.select_seed, args.batch_size,
                               root / "select-base", base, None) if r["method"] in ("ar", "sd")]
    picks: dict[str, dict[str, str]] = {}
    for name, path in classifiers.items():
        rows = tagged(run(pair, task, "validation", args.select_n, args.select_seed, args.batch_size,
                          root / f"select-{name}", pad_specs(pair, path, sigmas, budgets), path), name)
        if combos or more:  # a second run, so that the first one's rows stay its own and resume
            rows += tagged(run(pair, task, "validation", args.select_n, args.select_seed, args.batch_size,
                               root / f"select-{name}-more", pad_specs(pair, path, more, combos=combos), path), name)
        sel_rows += rows
        summary = api.summarize(sel_rows)
        labels = sorted({r["method"] for r in rows})
        picks[name] = {k: choose(summary, [m for m in labels if kind(m) == k], args.within)
                       for k in ("sigma", "budget", "both") if any(kind(m) == k for m in labels)}
    sel_summary = with_overrides(api.summarize(sel_rows), sel_rows)
    chosen = {m for p in picks.values() for m in p.values()}
    print(f"selection: {args.select_n} validation problems (seed {args.select_seed})")
    print(table(sel_summary, chosen))
    result = {"pair": args.pair, "classifiers": classifiers, "sigmas": sigmas + more, "budgets": budgets,
              "both": combos,
              "select": {"n": args.select_n, "seed": args.select_seed, "summary": sel_summary, "picks": picks},
              "cpu": os.cpu_count(), "batch_size": args.batch_size}
    out = args.results / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=1))
    if args.select_only:
        return

    # 2. test: ar, sd and the rules once; each classifier's chosen points
    rules = args.rule or RULES.get(args.pair, RULES["testbed-hard"])
    base = api.method_specs(pair, "ar,sd", baselines=rules)
    test_rows = run(pair, task, "test", args.n, 0, args.batch_size, root / "test-base", base, None)
    for name, path in classifiers.items():
        specs = [s for k, m in picks[name].items() if k in args.test_kinds.split(",")
                 for s in pad_specs(pair, path, **knobs(m))]
        test_rows += tagged(run(pair, task, "test", args.n, 0, args.batch_size, root / f"test-{name}", specs, path),
                            name)
    test_summary = with_overrides(api.summarize(test_rows), test_rows)
    print(f"\ntest: {args.n} test problems (seed 0), greedy, gamma 5, batch {args.batch_size}")
    print(table(test_summary, chosen))
    result["test"] = {"n": args.n, "rules": rules, "summary": test_summary}
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
