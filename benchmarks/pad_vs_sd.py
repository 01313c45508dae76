"""PAD against SD and every training-free relaxed rule on an embedded pair: frontiers of accuracy vs speed.

    python benchmarks/pad_vs_sd.py --n 200                        # testbed (arith)
    python benchmarks/pad_vs_sd.py --n 200 --pair testbed-hard    # testbed-hard (arith-hard)

One `pivotspec eval` run (greedy, one untimed warm-up problem, method order rotated per problem), every
method interleaved per problem so that machine drift hits all alike: `ar`, `draft` and `sd` once; PAD at
the shipped classifier's calibrated sigma and a sigma sweep; each baseline at several values of its main
knob. Prints and stores (benchmarks/results/pad_vs_sd.json and benchmarks/results/pad_vs_sd/ for the
testbed; pad_vs_sd-<pair>.json and pad_vs_sd-<pair>/ for another pair):
- the table (accuracy, paired McNemar vs `ar` and vs `sd`, eta, tau, speedups);
- per rule: its best accuracy at an acceptance rate (eta) at least PAD's at the calibrated sigma, and the
  highest eta and best speedup it reaches within 1 point of `ar`'s accuracy;
- the goal check: PAD's highest eta within 1 point of `ar` against every rule's, and PAD's speedup over SD;
- frontier.png: accuracy against speedup and against eta, one curve per rule;
- the step-cost table (where a step's time goes, and the speedup ceiling if every draft were kept).
Rows are appended to benchmarks/results/pad_vs_sd/results.jsonl as they come: rerun the same command to
resume. `--summarize` decodes nothing and summarises the problems every method has finished. While the
file named by --pause-file exists, the run waits between problems (untimed; it creates NAME.paused while it
waits), so that a short job can have the CPU without distorting any timed decode.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from pivotspec import api
from pivotspec.api import MethodSpec
from pivotspec.api import format_cell as fmt
from pivotspec.api import format_paired as paired_cell

# The main knob of each rule, from nearly SD (strict) to loose. typical keeps Medusa's delta = sqrt(epsilon).
SWEEPS = {
    "typical": ["typical:epsilon=0.3,delta=0.5477", "typical:epsilon=0.01,delta=0.1"],
    "topk": ["topk:k=5,ratio=0.5", "topk:k=5,ratio=0.05"],
    "threshold": ["threshold:threshold=0.3", "threshold:threshold=0.1", "threshold:threshold=0.01"],
    "ensemble": ["ensemble:w=0.5"],
    "divergence": ["divergence:threshold=0.1,divergence=js"],
}
RULE_OF = {"pad": "pad", **{name: name for name in SWEEPS}}


def method_specs(pair: api.Pair, gammas: list[int], main_gamma: int,
                 sigmas: list[float]) -> tuple[list[MethodSpec], str]:
    calibrated = api.make_policy(pair, "pad")
    main_pad = f"pad@{calibrated.sigma:.4g} g={main_gamma}"
    specs = [MethodSpec("ar", "ar"), MethodSpec("draft", "draft")]
    for g in gammas:
        specs += [MethodSpec(f"sd g={g}", "sd", api.make_policy(pair, "sd"), g),
                  MethodSpec(f"pad@{calibrated.sigma:.4g} g={g}", "pad", calibrated, g)]
    for sigma in sigmas:
        if abs(sigma - calibrated.sigma) > 1e-9:
            specs.append(MethodSpec(f"pad@{sigma:g} g={main_gamma}", "pad",
                                    api.make_policy(pair, "pad", sigma=sigma), main_gamma))
    rules = api.method_specs(pair, "", baselines=[spec for rule_specs in SWEEPS.values() for spec in rule_specs])
    specs += [MethodSpec(f"{rule.label} g={main_gamma}", "pad", rule.policy, main_gamma) for rule in rules]
    return specs, main_pad


def complete_rows(results: Path, labels: list[str]) -> list[dict]:
    """Rows of the problems every method has finished (a stopped run leaves its last problem partial)."""
    rows = api.read_results(results)  # never cuts the line a running benchmark is writing
    have: dict[str, set[str]] = {}
    for r in rows:
        have.setdefault(r["problem_id"], set()).add(r["method"])
    done = {p for p, methods in have.items() if methods >= set(labels)}
    return [r for r in rows if r["problem_id"] in done and r["method"] in labels]


def rule(label: str) -> str:
    name = label.partition(" g=")[0]
    return RULE_OF.get(name.split("(")[0].split("@")[0], name)


def table(summary: dict, labels: list[str]) -> str:
    lines = ["| method | gamma | accuracy | 95% CI | vs ar (McNemar) | vs sd (McNemar) | eta | tau | speedup vs ar | "
             "IQR | speedup vs sd |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in labels:
        s = summary[label]
        name, _, gamma = label.partition(" g=")
        sd = summary.get(f"sd g={gamma}", {}).get("speedup") if gamma else None
        vs_sd = s["speedup"] / sd if s["speedup"] and sd else None
        iqr = "-" if not s["speedup_iqr"] else f"{s['speedup_iqr'][0]:.2f}-{s['speedup_iqr'][1]:.2f}"
        paired = s["paired"]
        lines.append(f"| {name} | {gamma or '-'} | {s['accuracy']:.3f} | [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}] | "
                     f"{paired_cell(paired.get('ar'))} | {paired_cell(paired.get(f'sd g={gamma}'))} | "
                     f"{fmt(s['eta'], '.3f')} | {fmt(s['tau'], '.2f')} | {fmt(s['speedup'], '.2f', 'x')} | {iqr} | "
                     f"{fmt(vs_sd, '.2f', 'x')} |")
    return "\n".join(lines)


def frontier(summary: dict, labels: list[str], main_pad: str, main_gamma: int) -> tuple[str, dict]:
    """Per rule at the main gamma: best accuracy at eta >= PAD's (calibrated sigma), best speedup within
    1 point of ar's accuracy."""
    ar_acc, pad_eta = summary["ar"]["accuracy"], summary[main_pad]["eta"]
    lines = [f"| rule | points | best accuracy at eta >= {pad_eta:.3f} (PAD's) | its eta | highest eta within 1 point "
             f"of ar ({ar_acc:.3f}) | best speedup within 1 point | its accuracy |", "|---|---|---|---|---|---|---|"]
    out = {}
    for r in dict.fromkeys(rule(x) for x in labels if x.endswith(f" g={main_gamma}") and not x.startswith("sd ")):
        mine = [x for x in labels if rule(x) == r and x.endswith(f" g={main_gamma}")]
        wide = [x for x in mine if summary[x]["eta"] is not None and summary[x]["eta"] >= pad_eta - 1e-12]
        best_acc = max(wide, key=lambda x: summary[x]["accuracy"], default=None)
        close = [x for x in mine if summary[x]["accuracy"] >= ar_acc - 0.01 - 1e-12]
        best_speed = max(close, key=lambda x: summary[x]["speedup"] or 0, default=None)
        best_eta = max(close, key=lambda x: summary[x]["eta"] or 0, default=None)
        out[r] = {"points": len(mine), "best_accuracy_at_pad_eta": best_acc and summary[best_acc]["accuracy"],
                  "best_accuracy_method": best_acc, "best_speedup_method": best_speed,
                  "best_speedup_within_1pt": best_speed and summary[best_speed]["speedup"],
                  "best_eta_method": best_eta, "best_eta_within_1pt": best_eta and summary[best_eta]["eta"]}
        acc = ("none reaches it" if best_acc is None
               else f"{summary[best_acc]['accuracy']:.3f} ({best_acc.partition(' g=')[0]})")
        eta = "-" if best_acc is None else f"{summary[best_acc]['eta']:.3f}"
        speed = ("none" if best_speed is None
                 else f"{summary[best_speed]['speedup']:.2f}x ({best_speed.partition(' g=')[0]})")
        sacc = "-" if best_speed is None else f"{summary[best_speed]['accuracy']:.3f}"
        top_eta = ("none" if best_eta is None
                   else f"{summary[best_eta]['eta']:.3f} ({best_eta.partition(' g=')[0]})")
        lines.append(f"| {r} | {len(mine)} | {acc} | {eta} | {top_eta} | {speed} | {sacc} |")
    return "\n".join(lines), out


def goal_check(summary: dict, front: dict, main_gamma: int) -> tuple[str, dict]:
    """Issue 16's goal: PAD within 1 point of ar (McNemar, paired by problem) at an eta no training-free rule
    reaches within 1 point of ar, and PAD >= 1.2x over SD at the main gamma in the same run."""
    pad = front.get("pad", {}).get("best_eta_method")
    sd = summary.get(f"sd g={main_gamma}")
    if pad is None or sd is None:
        return "goal: no PAD point within 1 point of ar", {"met": False, "pad_method": pad}
    s = summary[pad]
    rules = {r: f["best_eta_within_1pt"] for r, f in front.items() if r != "pad"}
    beaten = all(e is None or s["eta"] > e + 1e-12 for e in rules.values())
    over_sd = s["speedup"] / sd["speedup"]
    p = s["paired"]["ar"]
    result = {"pad_method": pad, "pad_accuracy": s["accuracy"], "ar_accuracy": summary["ar"]["accuracy"],
              "mcnemar_p_vs_ar": p["p_mcnemar"], "pad_eta": s["eta"], "rules_best_eta_within_1pt": rules,
              "eta_beyond_every_rule": beaten, "speedup_over_sd": over_sd,
              "met": beaten and over_sd >= 1.2}
    best_rule = max(rules, key=lambda r: rules[r] or 0)
    text = (f"goal: {pad.partition(' g=')[0]} accuracy {s['accuracy']:.3f} vs ar {summary['ar']['accuracy']:.3f} "
            f"(McNemar p {p['p_mcnemar']:.2g}) at eta {s['eta']:.3f}; best rule within 1 point: {best_rule} at eta "
            f"{fmt(rules[best_rule], '.3f')} -> {'beyond' if beaten else 'NOT beyond'} every rule; "
            f"{over_sd:.2f}x over SD ({'>=' if over_sd >= 1.2 else '<'} 1.2x); "
            f"goal {'met' if result['met'] else 'NOT met'}")
    return text, result


def draw_frontier(axes, summary: dict, labels: list[str], main_gamma: int, title: str = "") -> None:
    """Accuracy against speedup (axes[0]) and against eta (axes[1]), one curve per rule, ar's accuracy marked."""
    for r in dict.fromkeys(rule(x) for x in labels if x.endswith(f" g={main_gamma}")):
        pts = sorted((summary[x]["eta"], summary[x]["speedup"], summary[x]["accuracy"]) for x in labels
                     if rule(x) == r and x.endswith(f" g={main_gamma}"))
        style = dict(marker="o", lw=2.5 if r == "pad" else 1.2, label=r)
        axes[0].plot([p[1] for p in pts], [p[2] for p in pts], **style)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], **style)
    for ax in axes:
        ax.axhline(summary["ar"]["accuracy"], color="k", ls="--", lw=1, label="ar accuracy")
        ax.axhline(summary["ar"]["accuracy"] - 0.01, color="grey", ls=":", lw=1, label="ar - 1 point")
        ax.grid(alpha=0.3)
        if title:
            ax.set_title(title, fontsize=10)
    axes[0].set_xlabel(f"speedup over ar (gamma {main_gamma})")
    axes[1].set_xlabel("eta (draft tokens kept / drafted)")
    axes[0].set_ylabel("accuracy")
    axes[1].legend(fontsize=8, loc="lower left")


def frontier_plot(summary: dict, labels: list[str], main_gamma: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    draw_frontier(axes, summary, labels, main_gamma)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    ap.add_argument("--pair", default="testbed", choices=[p for p in api.pair_names() if api.pair_task(p)],
                    help="embedded pair (default testbed); its task and shipped classifier are used")
    ap.add_argument("--n", type=int, default=200, help="test problems (default 200)")
    ap.add_argument("--gammas", default="5", help="gammas for sd and pad at the calibrated sigma (default 5)")
    ap.add_argument("--main-gamma", type=int, default=5, help="gamma of the sweeps (default 5)")
    ap.add_argument("--sigmas", default="0.9,0.995", help="PAD sigmas besides the calibrated one")
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 (default, as the stored runs), bfloat16 or auto")
    ap.add_argument("--pause-file", type=Path, default=Path("/tmp/pivotspec-bench.pause"),
                    help="while this file exists the run waits between problems (untimed)")
    ap.add_argument("--summarize", action="store_true", help="only summarise the rows already written")
    args = ap.parse_args()
    clf = api.default_classifier(args.pair)
    if clf is None:
        raise SystemExit(f"pad_vs_sd: {args.pair} ships no pivot classifier yet; train one first (see README)")
    name = "pad_vs_sd" if args.pair == "testbed" else f"pad_vs_sd-{args.pair}"
    out = args.results / name
    settings = api.EvalSettings(task=api.pair_task(args.pair), n=args.n, classifier=clf, out=out)
    pair = api.load_pair(pair=args.pair, threads=args.threads, dtype=args.dtype)
    gammas = [int(g) for g in args.gammas.split(",")]
    specs, main_pad = method_specs(pair, gammas, args.main_gamma, [float(s) for s in args.sigmas.split(",")])
    labels = [s.label for s in specs]

    paused = args.pause_file.with_suffix(".paused")

    def wait_while_paused(done: int, total: int) -> None:
        if args.pause_file.exists():
            paused.touch()  # tells whoever paused us that no timed decode is running now
            while args.pause_file.exists():
                time.sleep(1)
            paused.unlink(missing_ok=True)

    if not args.summarize:
        api.evaluate(pair, settings, specs=specs, between=wait_while_paused)
    rows = complete_rows(out / "results.jsonl", labels)
    if not rows:
        raise SystemExit(f"pad_vs_sd: no problem in {out} has rows for every method yet")
    summary = api.summarize(rows, references=("ar", *(f"sd g={g}" for g in gammas)))
    n = summary["ar"]["n"]
    front_table, front = frontier(summary, labels, main_pad, args.main_gamma)
    goal_text, goal = goal_check(summary, front, args.main_gamma)
    frontier_plot(summary, labels, args.main_gamma, out / "frontier.png")
    cost_table, costs = step_costs(rows, [x for x in labels if x == "ar" or x.startswith(("sd ", "pad@"))])
    result = {"n_problems": n, "n_requested": args.n, "classifier": str(clf), "calibrated_pad": main_pad,
              "methods": summary, "frontier": front, "goal": goal, "step_costs": costs, "cpu": os.cpu_count(),
              "command": "python benchmarks/pad_vs_sd.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if k not in ("summarize", "results", "pause_file"))}
    (args.results / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"{n} test problems (of {args.n} requested), greedy, every method interleaved per problem")
    print(table(summary, labels))
    print()
    print(front_table)
    print(goal_text)
    print()
    print(cost_table)


if __name__ == "__main__":
    main()
