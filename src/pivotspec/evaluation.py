"""Methods side by side on a task: utility with a confidence interval, tau, eta and speed.

Methods run interleaved per problem (problem 1: ar, sd, ...; problem 2: ar, sd, ...) so that timing
drift on a shared machine hits every method alike. Speedup is total ``ar`` wall time over the method's
total wall time on the same problems; its spread is the interquartile range of per-problem ratios.
With ``--out DIR`` every (problem, method) row is appended to ``results.jsonl`` as soon as it exists, and a
rerun of the same command resumes after the rows already there.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivotspec.errors import UsageError

if TYPE_CHECKING:
    from pivotspec.models import LM
    from pivotspec.tasks import Problem, Task


@dataclass
class MethodSpec:
    label: str  # how the method is reported, e.g. "pad@0.5"
    method: str  # ar | draft | sd | pad (baselines run as "pad" with their own policy)
    policy: Any = None
    gamma: int | None = None  # draft tokens per step for this method only (None: the run's --gamma)


def wilson_ci(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (sane at 0% and 100%, unlike the normal approximation)."""
    if n == 0:
        return (0.0, 1.0)
    phat = successes / n
    denom = 1 + z * z / n
    centre = (phat + z * z / (2 * n)) / denom
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def run_eval(task: Task, problems: list[Problem], specs: list[MethodSpec], target: LM | None, draft: LM | None, *,
             chat: bool = True, progress: Callable[[int, int], None] | None = None,
             done: set[tuple[str, str]] | None = None, emit: Callable[[dict], None] | None = None,
             warmup: bool = True, **decode_kwargs: Any) -> list[dict[str, Any]]:
    """One row per (problem, method): the completion, its score, its stats and its per-token trace.
    Pairs in ``done`` are skipped; ``emit`` receives each new row as soon as it exists. With ``warmup``,
    every method first decodes the first problem still to do once, untimed and unrecorded; the method
    order then rotates by one per problem."""
    from pivotspec.decoding import decode
    from pivotspec.models import eos_ids
    from pivotspec.tasks import encode_problem

    lm = target or draft
    stop_ids = eos_ids(lm)
    stops = list(getattr(task, "stop_strings", [])) + list(decode_kwargs.pop("stop_strings", None) or [])

    def run(spec: MethodSpec, ids: list[int]) -> Any:
        kwargs = decode_kwargs if spec.gamma is None else {**decode_kwargs, "gamma": spec.gamma}
        return decode(spec.method, target, draft, ids, spec.policy, eos_ids=stop_ids, stop_strings=stops, **kwargs)

    todo = [p for p in problems if not done or any((p.id, s.label) not in done for s in specs)]
    if todo and warmup:  # untimed: the first decode of a process pays for lazy initialisation
        for spec in specs:
            run(spec, encode_problem(lm.tokenizer, todo[0], chat=chat))
    rows = []
    for i, problem in enumerate(problems):
        ids = encode_problem(lm.tokenizer, problem, chat=chat)
        shift = i % len(specs)  # rotate the order, so no method always runs first (or right after another)
        for spec in specs[shift:] + specs[:shift]:
            if done and (problem.id, spec.label) in done:
                continue
            gen = run(spec, ids)
            row = {"problem_id": problem.id, "method": spec.label, "completion": gen.text,
                   "score": task.score(problem, gen.text), "stats": gen.stats,
                   "trace": [[lm.tokenizer.decode([t]), s] for t, s in gen.trace]}
            rows.append(row)
            if emit:
                emit(row)
        if progress:
            progress(i + 1, len(problems))
    return rows


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]] if values else [float("nan")] * 2
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: of the b + c problems where exactly one of two methods is right,
    is the split b : c more uneven than a fair coin's?"""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_comparison(rows: list[dict[str, Any]], method: str, reference: str) -> dict[str, Any] | None:
    """Accuracy of ``method`` against ``reference`` on the problems both ran: the difference, the
    discordant counts (b: only method right, c: only reference right) and the exact McNemar p-value."""
    ref = {r["problem_id"]: r["score"] for r in rows if r["method"] == reference}
    mine = {r["problem_id"]: r["score"] for r in rows if r["method"] == method and r["problem_id"] in ref}
    if not mine:
        return None
    b = sum(1 for p, s in mine.items() if s > 0.5 >= ref[p])
    c = sum(1 for p, s in mine.items() if ref[p] > 0.5 >= s)
    diff = (sum(mine.values()) - sum(ref[p] for p in mine)) / len(mine)
    return {"reference": reference, "n": len(mine), "diff": diff, "only_method": b, "only_reference": c,
            "p_mcnemar": mcnemar_exact(b, c)}


def summarize(rows: list[dict[str, Any]], baseline: str = "ar",
              references: tuple[str, ...] = ("ar", "sd")) -> dict[str, dict[str, Any]]:
    """Aggregate rows per method; ratios of sums, so long completions weigh by their length. Each method's
    accuracy is also compared, paired by problem, with each of ``references`` that ran."""
    out: dict[str, dict[str, Any]] = {}
    base_wall = {r["problem_id"]: r["stats"]["wall_s"] for r in rows if r["method"] == baseline}
    for label in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == label]
        n = len(mine)
        tokens = sum(r["stats"]["new_tokens"] for r in mine)
        wall = sum(r["stats"]["wall_s"] for r in mine)
        fwd = sum(r["stats"]["target_forwards"] for r in mine)
        drafted = sum(r["stats"]["drafted"] for r in mine)
        kept = sum(r["stats"]["accepted"] + r["stats"]["overridden"] for r in mine)
        correct = sum(r["score"] for r in mine)
        ratios = [base_wall[r["problem_id"]] / r["stats"]["wall_s"] for r in mine
                  if r["problem_id"] in base_wall and r["stats"]["wall_s"] > 0]
        paired = [r for r in mine if r["problem_id"] in base_wall]
        out[label] = {
            "n": n,
            "accuracy": correct / n,
            "ci95": list(wilson_ci(correct, n)),
            "tau": tokens / fwd if fwd else None,
            "eta": kept / drafted if drafted else None,
            "target_forwards_per_token": fwd / tokens if tokens else None,
            "ms_per_token": 1000 * wall / tokens if tokens else None,
            "wall_s": wall,
            "new_tokens": tokens,
            "speedup": (sum(base_wall[r["problem_id"]] for r in paired) / sum(r["stats"]["wall_s"] for r in paired)
                        if paired and base_wall else None),
            "speedup_median": statistics.median(ratios) if ratios else None,
            "speedup_iqr": _quartiles(ratios) if ratios else None,
            "paired": {ref: paired_comparison(rows, label, ref) for ref in references if ref != label
                       and any(r["method"] == ref for r in rows)},
        }
    return out


def fmt(x: Any, spec: str, suffix: str = "") -> str:
    """A table cell: ``x`` formatted, or "-" when there is no value."""
    return "-" if x is None else format(x, spec) + suffix


def paired_cell(p: dict[str, Any] | None) -> str:
    """'-0.020 (p 0.25)': accuracy difference and exact McNemar p-value, or '-'."""
    return "-" if not p else f"{p['diff']:+.3f} (p {p['p_mcnemar']:.2g})"


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| method | accuracy | 95% CI | vs ar (McNemar) | vs sd (McNemar) | eta | tau | target fwd/token | "
             "ms/token | speedup | speedup IQR |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, s in summary.items():
        lo, hi = s["ci95"]
        iqr = "-" if not s["speedup_iqr"] else f"{s['speedup_iqr'][0]:.2f}-{s['speedup_iqr'][1]:.2f}"
        paired = s.get("paired", {})
        lines.append(f"| {label} | {s['accuracy']:.3f} | [{lo:.3f}, {hi:.3f}] | {paired_cell(paired.get('ar'))} | "
                     f"{paired_cell(paired.get('sd'))} | {fmt(s['eta'], '.3f')} | "
                     f"{fmt(s['tau'], '.2f')} | {fmt(s['target_forwards_per_token'], '.3f')} | "
                     f"{fmt(s['ms_per_token'], '.1f')} | {fmt(s['speedup'], '.2f', 'x')} | {iqr} |")
    return "\n".join(lines)


def parse_specs(args: argparse.Namespace, target: LM | None = None) -> list[MethodSpec]:
    """ar/draft/sd as named; one pad per --sigmas value; one policy per baseline spec."""
    from pivotspec.baselines import label as baseline_label
    from pivotspec.baselines import make_baseline
    from pivotspec.cli import make_policy
    from pivotspec.decoding import METHODS

    specs = []
    sigmas = [float(x) for x in args.sigmas.split(",")] if getattr(args, "sigmas", None) else [None]
    for m in [m.strip() for m in args.methods.split(",") if m.strip()]:
        if m not in METHODS:
            raise UsageError(f"unknown method {m!r} in --methods: choose from {', '.join(METHODS)}")
        for sigma in sigmas if m == "pad" else [None]:
            policy = make_policy(args, m, target, sigma)
            label = f"pad@{policy.sigma:g}" if m == "pad" and policy is not None else m
            specs.append(MethodSpec(label, m, policy))
    names = [b for b in (getattr(args, "baselines", None) or "").split(",") if b]
    for spec in names + list(getattr(args, "baseline", None) or []):
        policy = make_baseline(spec)
        specs.append(MethodSpec(baseline_label(policy), "pad", policy))
    if not specs:
        raise UsageError("--methods is empty: give e.g. ar,sd")
    return specs


def open_run(out: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Check ``out`` (whose results.jsonl the caller holds open and locked) against ``config`` and record
    it; returns the rows of an earlier run of the same configuration."""
    from pivotspec.store import read_records

    run_file, results = out / "run.json", out / "results.jsonl"
    if run_file.is_file() and results.stat().st_size > 0:  # --overwrite has already emptied results.jsonl
        earlier = json.loads(run_file.read_text())
        if earlier != config:
            diff = sorted(k for k in set(earlier) | set(config) if earlier.get(k) != config.get(k))
            raise UsageError(
                f"{out} holds a run with a different {', '.join(diff)}: pass --overwrite or another --out")
    run_file.write_text(json.dumps(config, indent=1))
    return read_records(results)


def cmd_eval(args: argparse.Namespace) -> None:
    from pivotspec.cli import load_models, validate_decoding
    from pivotspec.tasks import get_task

    validate_decoding(args)
    if args.n < 1:
        raise UsageError(f"--n must be >= 1, got {args.n}")
    task = get_task(args.task, args.data)
    specs = parse_specs(args)  # argument errors before the (slow) model loading
    needs_draft = any(s.method != "ar" for s in specs)
    target, draft = load_models(args, needs_draft)
    specs = parse_specs(args, target)
    if all(s.method == "draft" for s in specs):
        target = None
    problems = task.problems(args.split, args.n, args.seed)
    summary = evaluate(args, task, problems, specs, target, draft)
    if args.json:
        print(json.dumps({"methods": summary}))
    else:
        print(format_table(summary))
        if args.out:
            print(f"report: {args.out / 'report.html'}")


def classifier_fingerprint(args: argparse.Namespace, specs: list[MethodSpec]) -> str | None:
    """What the PAD runs were scored with, so resuming a run after the classifier was retrained is refused
    instead of mixing rows from two classifiers."""
    import hashlib

    from pivotspec.acceptance import PAD

    clf = getattr(args, "classifier", None)
    if not clf or not any(isinstance(s.policy, PAD) for s in specs):
        return None
    if clf.startswith("const:"):
        return clf
    from pivotspec.classifier import CONFIG, WEIGHTS

    digest = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):  # only the classifier's own files: plots or subdirectories may sit beside them
        digest.update(name.encode() + (Path(clf) / name).read_bytes())
    return f"{clf}#{digest.hexdigest()[:12]}"


def evaluate(args: argparse.Namespace, task: Task, problems: list[Problem], specs: list[MethodSpec],
             target: LM | None, draft: LM | None,
             between: Callable[[int, int], None] | None = None) -> dict[str, dict[str, Any]]:
    """Run (or resume) the evaluation; with --out also write results, summaries, plot and report.
    ``between(done, total)`` runs after each problem, outside any timed decode."""
    from pivotspec.sampling import SamplingConfig
    from pivotspec.store import append_record, open_for_append

    config = {"task": args.task, "data": str(args.data) if args.data else None, "split": args.split, "n": args.n,
              "seed": args.seed, "methods": [s.label for s in specs], "gamma": args.gamma,
              "method_gammas": [s.gamma for s in specs], "classifier": classifier_fingerprint(args, specs),
              "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
              "max_new_tokens": args.max_new_tokens, "target": target.name if target else None,
              "draft": draft.name if draft else None, "chat": not args.no_chat}
    start = time.perf_counter()

    def progress(i: int, total: int) -> None:
        rate = (time.perf_counter() - start) / i
        print(f"\rproblems {i}/{total} | {rate:.1f} s/problem | ETA {rate * (total - i) / 60:.1f} min   ",
              end="" if i < total else "\n", file=sys.stderr, flush=True)
        if between:
            between(i, total)

    with ExitStack() as stack:  # results.jsonl stays locked until every row is written
        fh = stack.enter_context(open_for_append(args.out / "results.jsonl", args.overwrite)) if args.out else None
        earlier = open_run(args.out, config) if args.out else []
        rows = run_eval(task, problems, specs, target, draft, chat=not args.no_chat, progress=progress,
                        done={(r["problem_id"], r["method"]) for r in earlier},
                        emit=(lambda r: append_record(fh, r)) if fh else None,
                        cfg=SamplingConfig(args.temperature, args.top_k, args.top_p), gamma=args.gamma,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
    wanted = {p.id for p in problems}
    rows = [r for r in earlier if r["problem_id"] in wanted] + rows
    summary = summarize(rows)
    if args.out:
        from pivotspec.reports import write_reports

        write_reports(args.out, rows, summary, problems, config)
    return summary


def add_eval_parser(sub: Any) -> None:
    from pivotspec.cli import add_decoding_args, add_model_args

    ev = sub.add_parser("eval", help="run methods side by side on a task")
    add_model_args(ev)
    add_decoding_args(ev)
    ev.add_argument("--task", default="arith", help="arith, humaneval, gsm8k, mbpp or jsonl")
    ev.add_argument("--data", help="local data file for gsm8k, mbpp and jsonl (JSONL or parquet)")
    ev.add_argument("--split", default="test")
    ev.add_argument("--n", type=int, default=20, help="number of problems")
    ev.add_argument("--methods", default="ar,sd", help="comma list of ar, draft, sd, pad")
    ev.add_argument("--sigmas", help="PAD: one run per sigma, e.g. 0.3,0.5,0.7 (default: the calibrated sigma)")
    ev.add_argument("--baselines",
                    help="relaxed rules at default knobs: typical,topk,threshold,ensemble,divergence")
    ev.add_argument("--baseline", action="append", help="one relaxed rule with knobs, e.g. topk:k=3,ratio=0.2 "
                    "(repeatable)")
    ev.add_argument("--no-chat", action="store_true", help="plain prompts instead of the chat template")
    ev.add_argument("--out", type=Path, help="write results.jsonl, summary.json/md, pareto.png, report.html here")
    ev.add_argument("--overwrite", action="store_true", help="start --out over instead of resuming")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval, max_new_tokens=200)
