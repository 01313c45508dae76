"""Methods side by side on a task: utility with a confidence interval, tau, eta and speed.

Methods run interleaved per problem (problem 1: ar, sd, ...; problem 2: ar, sd, ...) so that timing
drift on a shared machine hits every method alike. Speedup is total ``ar`` wall time over the method's
total wall time on the same problems.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from pivotspec.errors import UsageError


@dataclass
class MethodSpec:
    label: str  # how the method is reported, e.g. "pad@0.5"
    method: str  # ar | draft | sd | pad
    policy: Any = None


def wilson_ci(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (sane at 0% and 100%, unlike the normal approximation)."""
    if n == 0:
        return (0.0, 1.0)
    phat = successes / n
    denom = 1 + z * z / n
    centre = (phat + z * z / (2 * n)) / denom
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def run_eval(task, problems, specs: list[MethodSpec], target, draft, *, chat: bool = True, progress=None,
             **decode_kwargs: Any) -> list[dict[str, Any]]:
    """One row per (problem, method): the completion, its score and its decoding stats."""
    from pivotspec.decoding import decode
    from pivotspec.models import eos_ids
    from pivotspec.tasks import encode_problem

    tokenizer = (target or draft).tokenizer
    stop_ids = eos_ids(target or draft)
    rows = []
    for i, problem in enumerate(problems):
        ids = encode_problem(tokenizer, problem, chat=chat)
        for spec in specs:
            gen = decode(spec.method, target, draft, ids, spec.policy, eos_ids=stop_ids, **decode_kwargs)
            rows.append({"problem_id": problem.id, "method": spec.label, "completion": gen.text,
                         "score": task.score(problem, gen.text), "stats": gen.stats,
                         "trace": [s for _, s in gen.trace]})
        if progress:
            progress(i + 1, len(problems))
    return rows


def summarize(rows: list[dict[str, Any]], baseline: str = "ar") -> dict[str, dict[str, Any]]:
    """Aggregate rows per method; ratios of sums, so long completions weigh by their length."""
    out: dict[str, dict[str, Any]] = {}
    for label in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == label]
        n = len(mine)
        tokens = sum(r["stats"]["new_tokens"] for r in mine)
        wall = sum(r["stats"]["wall_s"] for r in mine)
        fwd = sum(r["stats"]["target_forwards"] for r in mine)
        drafted = sum(r["stats"]["drafted"] for r in mine)
        kept = sum(r["stats"]["accepted"] + r["stats"]["overridden"] for r in mine)
        correct = sum(r["score"] for r in mine)
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
        }
    base = out.get(baseline)
    for s in out.values():
        s["speedup"] = base["wall_s"] / s["wall_s"] if base and s["wall_s"] else None
    return out


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    def fmt(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = ["| method | accuracy | 95% CI | tau | eta | ms/token | speedup |", "|---|---|---|---|---|---|---|"]
    for label, s in summary.items():
        lo, hi = s["ci95"]
        lines.append(f"| {label} | {s['accuracy']:.3f} | [{lo:.3f}, {hi:.3f}] | {fmt(s['tau'], '.2f')} | "
                     f"{fmt(s['eta'], '.3f')} | {fmt(s['ms_per_token'], '.1f')} | {fmt(s['speedup'], '.2f')}x |")
    return "\n".join(lines)


def parse_specs(args: argparse.Namespace, target=None) -> list[MethodSpec]:
    from pivotspec.cli import make_policy
    from pivotspec.decoding import METHODS

    specs = []
    for m in [m.strip() for m in args.methods.split(",") if m.strip()]:
        if m not in METHODS:
            raise UsageError(f"unknown method {m!r} in --methods: choose from {', '.join(METHODS)}")
        policy = make_policy(args, m, target)
        label = f"pad@{policy.sigma:g}" if m == "pad" and policy is not None else m
        specs.append(MethodSpec(label, m, policy))
    if not specs:
        raise UsageError("--methods is empty: give e.g. ar,sd")
    return specs


def cmd_eval(args: argparse.Namespace) -> None:
    from pivotspec.cli import load_models, validate_decoding
    from pivotspec.sampling import SamplingConfig
    from pivotspec.tasks import get_task

    validate_decoding(args)
    if args.n < 1:
        raise UsageError(f"--n must be >= 1, got {args.n}")
    task = get_task(args.task)
    specs = parse_specs(args)  # argument errors before the (slow) model loading
    needs_draft = any(s.method != "ar" for s in specs)
    target, draft = load_models(args, needs_draft)
    specs = parse_specs(args, target)
    if all(s.method == "draft" for s in specs):
        target = None
    problems = task.problems(args.split, args.n, args.seed)

    def progress(done: int, total: int) -> None:
        print(f"\r{done}/{total} problems", end="" if done < total else "\n", file=sys.stderr, flush=True)

    rows = run_eval(task, problems, specs, target, draft, chat=not args.no_chat, progress=progress,
                    cfg=SamplingConfig(args.temperature, args.top_k, args.top_p), gamma=args.gamma,
                    max_new_tokens=args.max_new_tokens, seed=args.seed)
    summary = summarize(rows)
    if args.json:
        print(json.dumps({"methods": summary}))
    else:
        print(format_table(summary))


def add_eval_parser(sub) -> None:
    from pivotspec.cli import add_decoding_args, add_model_args

    ev = sub.add_parser("eval", help="run methods side by side on a task")
    add_model_args(ev)
    add_decoding_args(ev)
    ev.add_argument("--task", default="arith")
    ev.add_argument("--split", default="test")
    ev.add_argument("--n", type=int, default=20, help="number of problems")
    ev.add_argument("--methods", default="ar,sd", help="comma list of ar, draft, sd, pad")
    ev.add_argument("--no-chat", action="store_true", help="plain prompts instead of the chat template")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval, max_new_tokens=200)
