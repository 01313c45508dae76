"""Where each method's accuracy goes on `arith` / `arith-hard`: wrong steps, overrides, answer length.

    python benchmarks/step_errors.py --pair testbed-hard     # reads pad_vs_sd-testbed-hard/results.jsonl
    python benchmarks/step_errors.py --pair testbed          # needs the testbed run's local results.jsonl
    python benchmarks/step_errors.py --runs benchmarks/results/budget_frontier/test-base \
        benchmarks/results/budget_frontier/test-r1-union-179 --name frontier    # any eval runs' rows

Reads the rows `benchmarks/pad_vs_sd.py` stored (each with its token trace: which tokens the target wrote,
which drafts it kept, which rejected drafts a relaxed rule kept anyway, "override") and, per method, finds
every solution step the arith phrasings write ("x + b = y", "x plus b is y", "adding b to x gives y", ...)
and checks its arithmetic. Prints a table and writes benchmarks/results/step_errors-<pair>.json:
- problems lost and won against `ar` (paired by problem);
- overrides per problem and how many of them are number tokens (a rule keeping a draft's number);
- answer length in tokens (a draft's style can be wordier than the target's);
- steps found per problem, the share with wrong arithmetic, the share with wrong arithmetic among steps
  written after the answer's first override, and how many wrong results contain an overridden token
  (0 means every wrong number was the target's own choice);
- per operation, the steps in the target's own wording and those whose wording holds an override (the draft's
  phrasing of the step), with their wrong shares.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from pivotspec import api

SYMBOLS = {"+": "add", "-": "sub", "*": "mul", "/": "div", "plus": "add", "minus": "sub", "times": "mul",
           "divided by": "div"}
# (pattern, group of x, group of b, group of the operation or the operation itself, group of y)
STEP_PATTERNS = [
    (re.compile(r"(\d+) ([-+*/]) (\d+) (?:=|gives|makes|leaves) (\d+)"), 1, 3, 2, 4),
    (re.compile(r"(\d+) (plus|minus|times|divided by) (\d+) is (\d+)"), 1, 3, 2, 4),
    (re.compile(r"(?i:adding) (\d+) to (\d+) (?:gives|leaves) (\d+)"), 2, 1, "add", 3),
    (re.compile(r"(?i:taking) (\d+) from (\d+) (?:gives|leaves) (\d+)"), 2, 1, "sub", 3),
    (re.compile(r"(?i:multiplying) (\d+) by (\d+) (?:gives|leaves) (\d+)"), 1, 2, "mul", 3),
    (re.compile(r"(?i:dividing) (\d+) by (\d+) (?:gives|leaves) (\d+)"), 1, 2, "div", 3),
]


def correct(op: str, x: int, b: int, y: int) -> bool:
    return {"add": x + b, "sub": x - b, "mul": x * b, "div": x / b if b else None}[op] == y


def steps(text: str) -> list[dict[str, Any]]:
    """Every arithmetic step in ``text``: its span, the span of its result, its operation and whether it is
    right."""
    found = []
    for pattern, gx, gb, gop, gy in STEP_PATTERNS:
        for m in pattern.finditer(text):
            op = gop if isinstance(gop, str) and gop in SYMBOLS.values() else SYMBOLS[m.group(gop)]
            x, b, y = int(m.group(gx)), int(m.group(gb)), int(m.group(gy))
            found.append({"start": m.start(), "result": m.span(gy), "op": op, "right": correct(op, x, b, y)})
    return sorted(found, key=lambda s: s["start"])


def by_operation(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Steps and wrong steps per operation, split by whether the step's own wording (its start up to its
    result) holds an overridden token: the draft's phrasing of that step, kept over the target's."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"steps": 0, "wrong": 0})
    for row in rows:
        text, overrides = trace_spans(row["trace"])
        for s in steps(text):
            drafted = any(a < s["result"][0] and s["start"] < b for a, b in overrides)
            cell = counts[f"{s['op']}, {'draft' if drafted else 'target'} wording"]
            cell["steps"] += 1
            cell["wrong"] += not s["right"]
    return dict(sorted(counts.items()))


def trace_spans(trace: list[list[str]]) -> tuple[str, list[tuple[int, int]]]:
    """The text of a trace and the character span of every override in it."""
    text, overrides = "", []
    for token, kind in trace:
        if kind == "override":
            overrides.append((len(text), len(text) + len(token)))
        text += token
    return text, overrides


def method_report(rows: list[dict[str, Any]], ar_score: dict[str, float]) -> dict[str, Any]:
    n_steps = wrong = after = wrong_after = wrong_with_override = 0
    n_overrides = numeric = 0
    for row in rows:
        text, overrides = trace_spans(row["trace"])
        n_overrides += len(overrides)
        numeric += sum(any(c.isdigit() for c in text[a:b]) for a, b in overrides)
        first = overrides[0][0] if overrides else None
        for s in steps(text):
            n_steps += 1
            wrong += not s["right"]
            if first is not None and first < s["start"]:
                after += 1
                wrong_after += not s["right"]
            lo, hi = s["result"]
            wrong_with_override += not s["right"] and any(a < hi and lo < b for a, b in overrides)
    n = len(rows)
    return {
        "problems": n,
        "accuracy": sum(r["score"] for r in rows) / n,
        "lost_vs_ar": sum(1 for r in rows if ar_score[r["problem_id"]] > r["score"]),
        "won_vs_ar": sum(1 for r in rows if ar_score[r["problem_id"]] < r["score"]),
        "overrides_per_problem": n_overrides / n,
        "numeric_overrides": numeric,
        "overrides": n_overrides,
        "mean_new_tokens": statistics.mean(r["stats"]["new_tokens"] for r in rows),
        "steps_per_problem": n_steps / n,
        "step_error_rate": wrong / n_steps if n_steps else None,
        "steps_after_first_override": after,
        "step_error_rate_after_first_override": wrong_after / after if after else None,
        "wrong_results_containing_an_override": wrong_with_override,
        "by_operation": by_operation(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="testbed-hard", help="testbed or testbed-hard (which pad_vs_sd run)")
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--runs", type=Path, nargs="+", help="eval run directories to read instead (one holds ar); "
                    "a method of any but the first is named after its directory, e.g. test-r0:pad@0.1")
    ap.add_argument("--name", help="the JSON is step_errors-<name>.json (default: the pair)")
    args = ap.parse_args()
    if args.runs:
        rows = []
        for k, run in enumerate(args.runs):
            rows += [r if k == 0 else {**r, "method": f"{run.name}:{r['method']}"}
                     for r in api.read_results(run / "results.jsonl")]
        path = ", ".join(map(str, args.runs))
    else:
        name = "pad_vs_sd" if args.pair == "testbed" else f"pad_vs_sd-{args.pair}"
        path = args.results / name / "results.jsonl"
        rows = api.read_results(path)
    if not rows:
        raise SystemExit(f"no rows in {path}: run `python benchmarks/pad_vs_sd.py --pair {args.pair}` first")
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_method[row["method"]].append(row)
    ar_score = {r["problem_id"]: r["score"] for r in by_method["ar"]}
    done = set(ar_score)
    for m in by_method:
        done &= {r["problem_id"] for r in by_method[m]}
    report = {m: method_report([r for r in v if r["problem_id"] in done], ar_score)
              for m, v in by_method.items() if m != "draft"}

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    print(f"{len(done)} problems every method finished ({path})")
    print("| method | accuracy | lost / won vs ar | overrides per problem | of them numbers | answer tokens | "
          "steps per problem | wrong steps | wrong after first override | wrong results with an override |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m, r in report.items():
        print(f"| {m.partition(' g=')[0]} | {r['accuracy']:.3f} | {r['lost_vs_ar']} / {r['won_vs_ar']} | "
              f"{r['overrides_per_problem']:.1f} | {r['numeric_overrides']} | {r['mean_new_tokens']:.1f} | "
              f"{r['steps_per_problem']:.2f} | {pct(r['step_error_rate'])} | "
              f"{pct(r['step_error_rate_after_first_override'])} | {r['wrong_results_containing_an_override']} |")
    print("\nwrong steps per operation, by whose wording the step is in (steps, wrong share):")
    for m, r in report.items():
        cells = "; ".join(f"{k} {c['steps']} {pct(c['wrong'] / c['steps'])}" for k, c in r["by_operation"].items())
        print(f"- {m.partition(' g=')[0]}: {cells}")
    out = args.results / f"step_errors-{args.name or args.pair}.json"
    out.write_text(json.dumps({"source": str(path), "problems": len(done), "methods": report}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
