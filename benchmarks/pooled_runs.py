"""Several eval runs on disjoint problems as one: each method's accuracy, eta and paired tests over all of them.

    python benchmarks/pooled_runs.py --name hard-t0.7-pooled \\
        benchmarks/results/sampled/hard-t0.7 r1=benchmarks/results/sampled/hard-t0.7-r1-union-400 ...

One 200-problem run gives an interval of about +-7 points; the same command with other ``--seed`` values draws
other problems of the split (problem ids carry the seed), so the rows of runs of several seeds pool into one
table with paired McNemar tests over every problem. A run given as ``PREFIX=DIR`` has its PAD and rule rows
renamed ``PREFIX: label`` (so two classifiers' ``pad@0.1`` stay apart); its ``ar`` and ``sd`` rows join the
others' unprefixed, the first row of a (problem, method) kept. Prints the table per run and pooled, and writes
``benchmarks/results/NAME.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pivotspec import api

REFERENCES = ("ar", "sd")


def run_rows(spec: str) -> tuple[str, list[dict]]:
    """The rows of one run directory (``DIR`` or ``PREFIX=DIR``), PAD and rule rows prefixed."""
    prefix, _, path = spec.rpartition("=")
    rows = api.read_results(Path(path) / "results.jsonl")
    if not rows:
        raise SystemExit(f"{path}: no results.jsonl rows: pass an eval --out directory")
    for row in rows:
        if prefix and row["method"] not in REFERENCES:
            row["method"] = f"{prefix}: {row['method']}"
    return path, rows


def columns(summary: dict) -> dict:
    """Each method's problems, accuracy and interval, tests against ar and sd, eta and tau: no speeds, which runs
    made on other machines or beside other work do not pool into."""
    keep = ("n", "accuracy", "ci95", "paired", "eta", "tau")
    return {m: {k: s[k] for k in keep if k in s} for m, s in summary.items()}


def table(summary: dict) -> str:
    lines = ["| method | problems | accuracy | 95% CI | vs ar (McNemar) | vs sd (McNemar) | eta | tau |",
             "|---|---|---|---|---|---|---|---|"]
    for m, s in summary.items():
        ci = f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]"
        paired = [api.format_paired(s.get("paired", {}).get(ref)) for ref in REFERENCES]
        lines.append(f"| {m} | {s['n']} | {s['accuracy']:.3f} | {ci} | {paired[0]} | {paired[1]} | "
                     f"{api.format_cell(s.get('eta'), '.3f')} | {api.format_cell(s.get('tau'), '.2f')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="eval --out directories, each DIR or PREFIX=DIR")
    ap.add_argument("--name", default="pooled_runs", help="writes benchmarks/results/NAME.json")
    args = ap.parse_args()
    seen: set[tuple[str, str]] = set()
    pooled, per_run = [], {}
    for spec in args.runs:
        path, rows = run_rows(spec)
        per_run[path] = columns(api.summarize(rows, references=REFERENCES))
        print(f"{path}\n{table(per_run[path])}\n")
        for row in rows:
            if (row["problem_id"], row["method"]) not in seen:
                seen.add((row["problem_id"], row["method"]))
                pooled.append(row)
    summary = api.summarize(pooled, references=REFERENCES)
    print(f"pooled: {len({r['problem_id'] for r in pooled})} problems from {len(args.runs)} runs\n")
    print(table(columns(summary)))
    out = Path("benchmarks/results") / f"{args.name}.json"
    out.write_text(json.dumps({"runs": args.runs, "per_run": per_run, "pooled": columns(summary)}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
