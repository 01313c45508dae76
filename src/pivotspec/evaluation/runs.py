"""Methods side by side on a task: utility with a confidence interval, tau, eta and speed.

Methods run interleaved per problem (problem 1: ar, sd, ...; problem 2: ar, sd, ...) so that timing
drift on a shared machine hits every method alike. Speedup is total ``ar`` wall time over the method's
total wall time on the same problems; its spread is the interquartile range of per-problem ratios.
With ``--out DIR`` every (problem, method) row is appended to ``results.jsonl`` as soon as it exists, and a
rerun of the same command resumes after the rows already there.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pivotspec.classifier import drop
from pivotspec.classifier.model import CONFIG, WEIGHTS
from pivotspec.decoding.acceptance import DEFAULT_P_FLOOR, PAD, Budget
from pivotspec.decoding.baselines import label as baseline_label
from pivotspec.decoding.batch import Request, decode_many
from pivotspec.decoding.loop import decode
from pivotspec.decoding.models import LM, eos_ids
from pivotspec.decoding.sampling import SamplingConfig, derive_seed
from pivotspec.errors import UsageError
from pivotspec.evaluation.reports import write_reports
from pivotspec.evaluation.summary import summarize
from pivotspec.policies import make_policy
from pivotspec.store import append_record, open_for_append, read_records
from pivotspec.tasks import Problem, Task, encode_problem


@dataclass
class MethodSpec:
    label: str  # how the method is reported, e.g. "pad@0.5"
    method: str  # ar | draft | sd | pad (baselines run as "pad" with their own policy)
    policy: Any = None
    gamma: int | None = None  # draft tokens per step for this method only (None: the run's --gamma)


def run_eval(task: Task, problems: list[Problem], specs: list[MethodSpec], target: LM | None, draft: LM | None, *,
             chat: bool = True, progress: Callable[[int, int], None] | None = None,
             done: set[tuple[str, str]] | None = None, emit: Callable[[dict], None] | None = None,
             warmup: bool = True, chat_template_kwargs: dict[str, Any] | None = None, batch_size: int = 1,
             decoders: dict[str, Any] | None = None, **decode_kwargs: Any) -> list[dict[str, Any]]:
    """One row per (problem, method): the completion, its score, its stats and its per-token trace.
    Pairs in ``done`` are skipped; ``emit`` receives each new row as soon as it exists. With ``warmup``,
    every method first decodes the first problem still to do once, untimed and unrecorded; the method
    order then rotates by one per problem (per chunk of problems when ``batch_size`` > 1: each method then
    decodes a chunk of 4 x ``batch_size`` problems with at most ``batch_size`` rows at a time). ``decoders``
    (spec label -> another engine's decoder, e.g. ``integrations.vllm.launch.VllmDecoder``) decode those specs
    instead of the pivotspec loop. Each problem decodes with its own seed, ``derive_seed(seed, problem id)``
    (the same for every method: paired draws), so sampled rows are independent of each other."""

    lm = target or draft
    seed = decode_kwargs.pop("seed", 0)
    stop_ids = eos_ids(lm)
    stops = list(getattr(task, "stop_strings", [])) + list(decode_kwargs.pop("stop_strings", None) or [])

    def kwargs_for(spec: MethodSpec) -> dict[str, Any]:
        return decode_kwargs if spec.gamma is None else {**decode_kwargs, "gamma": spec.gamma}

    def run(spec: MethodSpec, ids: list[int], problem: Problem) -> Any:
        if decoders and spec.label in decoders:
            return decoders[spec.label].decode(ids, decode_kwargs.get("cfg") or SamplingConfig(),
                                               decode_kwargs.get("max_new_tokens", 128), stop_ids,
                                               **pad_knobs(spec))
        return decode(spec.method, target, draft, ids, spec.policy, eos_ids=stop_ids, stop_strings=stops,
                      seed=derive_seed(seed, problem.id), **kwargs_for(spec))

    def row(problem: Problem, spec: MethodSpec, gen: Any) -> dict[str, Any]:
        return {"problem_id": problem.id, "method": spec.label, "completion": gen.text,
                "score": task.score(problem, gen.text), "stats": gen.stats,
                "trace": [[lm.tokenizer.decode([t]), s] for t, s in gen.trace]}

    todo = [p for p in problems if not done or any((p.id, s.label) not in done for s in specs)]
    if todo and warmup:  # untimed: the first decode of a process pays for lazy initialisation
        for spec in specs:
            run(spec, encode_problem(lm.tokenizer, todo[0], chat, chat_template_kwargs), todo[0])
    rows = []
    chunk = 1 if batch_size == 1 else 4 * batch_size
    for c, first in enumerate(range(0, len(problems), chunk)):
        part = problems[first: first + chunk]
        ids = [encode_problem(lm.tokenizer, p, chat, chat_template_kwargs) for p in part]
        shift = c % len(specs)  # rotate the order, so no method always runs first (or right after another)
        for spec in specs[shift:] + specs[:shift]:
            mine = [i for i, p in enumerate(part) if not done or (p.id, spec.label) not in done]
            if batch_size == 1:
                gens = [run(spec, ids[i], part[i]) for i in mine]
            elif decoders and spec.label in decoders:
                gens = decoders[spec.label].decode_many([ids[i] for i in mine], decode_kwargs.get("cfg") or
                                                        SamplingConfig(), decode_kwargs.get("max_new_tokens", 128),
                                                        stop_ids, **pad_knobs(spec))
            else:
                gens = decode_batched(spec, [ids[i] for i in mine], target, draft, batch_size, eos_ids=stop_ids,
                                      stop_strings=stops, seeds=[derive_seed(seed, part[i].id) for i in mine],
                                      **kwargs_for(spec))
            for i, gen in zip(mine, gens, strict=True):
                rows.append(row(part[i], spec, gen))
                if emit:
                    emit(rows[-1])
        if progress:
            progress(first + len(part), len(problems))
    return rows


def pad_knobs(spec: MethodSpec) -> dict[str, float | None]:
    """The sigma and floor another engine's PAD decodes ``spec`` with (None for the other methods)."""
    return {"sigma": getattr(spec.policy, "sigma", None), "p_floor": getattr(spec.policy, "p_floor", None)}


def decode_batched(spec: MethodSpec, prompts: list[list[int]], target: LM | None, draft: LM | None,
                   batch_size: int, *, cfg: SamplingConfig | None = None, gamma: int = 5, max_new_tokens: int = 128,
                   eos_ids: set[int] | None = None, stop_strings: list[str] | None = None,
                   seeds: list[int] | None = None) -> list[Any]:
    """One method over many prompts, ``batch_size`` rows at a time. Each row's stats also get the batch
    size and its share of the pass's wall time (``batch_share_s``: pass wall / rows), whose sum over the
    rows is what the pass took: throughput comes from it, since a row's own wall time overlaps the others'.
    ``seeds``: one per prompt (default 0)."""
    speculate = spec.method in ("sd", "pad")
    requests = [Request(ids, policy=spec.policy if spec.method == "pad" else None, cfg=cfg or SamplingConfig(),
                        gamma=gamma, max_new_tokens=max_new_tokens, eos_ids=eos_ids or set(),
                        stop_strings=list(stop_strings or []), seed=s, speculate=speculate, method=spec.method)
                for ids, s in zip(prompts, seeds or [0] * len(prompts), strict=True)]
    start = time.perf_counter()
    lm = draft if spec.method == "draft" else target
    gens = decode_many(lm, requests, draft=draft if speculate else None, max_batch=batch_size)
    share = (time.perf_counter() - start) / max(1, len(gens))
    for gen in gens:
        gen.stats.update(batch_size=batch_size, batch_share_s=share)
    return gens


def method_specs(methods: str, target: LM | None = None, *, sigmas: list[float] | None = None,
                 baselines: list[str] = (), classifier: str | None = None, sigma: float | None = None,
                 p_floor: float = DEFAULT_P_FLOOR, pair: str | None = None,
                 budgets: list[float] | None = None) -> list[MethodSpec]:
    """ar/draft/sd as named; one pad per sigma (default: the classifier's calibrated one); with ``budgets`` one
    pad-budget per budget (PAD per answer), or with sigmas too one per (sigma, budget), the per-token rule inside
    the budget; one policy per baseline spec. With ``target=None`` only the
    arguments are checked (pad policies are None)."""
    # A non-default floor is part of the label, and so of the run's identity: resuming a run at another floor
    # must not reuse its rows, and two floors must not share a row of the summary. The label keeps the
    # paper's name for it, "tau=", so that runs recorded before the floor got its own name still resume.
    floor_tag = f" tau={p_floor:g}" if p_floor != DEFAULT_P_FLOOR else ""
    specs = []
    for m in [m.strip() for m in methods.split(",") if m.strip()]:
        if m == "pad" and budgets:
            for sig in sigmas or [sigma]:
                for b in budgets:
                    policy = make_policy(m, target, classifier=classifier, sigma=sig, p_floor=p_floor, pair=pair,
                                         budget=b)
                    label = f"pad-budget@{b:g}" if sig is None else f"pad@{sig:g} budget={b:g}"
                    specs.append(MethodSpec(label + floor_tag, m, policy))
            continue
        for sig in (sigmas or [sigma]) if m == "pad" else [None]:
            policy = make_policy(m, target, classifier=classifier, sigma=sig, p_floor=p_floor, pair=pair)
            label = f"pad@{policy.sigma:g}{floor_tag}" if m == "pad" and policy is not None else m
            specs.append(MethodSpec(label, m, policy))
    for spec in baselines:
        policy = make_policy(spec)
        specs.append(MethodSpec(baseline_label(policy), "pad", policy))
    if not specs:
        raise UsageError("--methods is empty: give e.g. ar,sd")
    return specs


def run_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def open_run(out: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Check ``out`` (whose results.jsonl the caller holds open and locked) against ``config`` and record
    it; returns the rows of an earlier run of the same configuration. Each row carries the hash of its run's
    configuration, so rows of another run are refused even when run.json is gone."""
    run_file, results = out / "run.json", out / "results.jsonl"
    if run_file.is_file() and results.stat().st_size > 0:  # --overwrite has already emptied results.jsonl
        earlier = json.loads(run_file.read_text())
        if earlier != config:
            diff = sorted(k for k in set(earlier) | set(config) if earlier.get(k) != config.get(k))
            raise UsageError(
                f"{out} holds a run with a different {', '.join(diff)}: pass --overwrite or another --out")
    rows = read_records(results)
    mine = run_hash(config)
    legacy_ok = run_file.is_file()  # rows written before rows carried a hash: run.json vouches for them
    if any(r.get("run", None if legacy_ok else "?") not in (None, mine) for r in rows):
        raise UsageError(f"{results} holds rows of another run (another model, task or setting): pass "
                         "--overwrite or use another --out")
    run_file.write_text(json.dumps(config, indent=1))
    return rows


def classifier_fingerprint(clf: str | None, specs: list[MethodSpec]) -> str | None:
    """What the PAD runs were scored with, so resuming a run after the classifier was retrained is refused
    instead of mixing rows from two classifiers."""
    if not clf or not any(isinstance(s.policy, (PAD, Budget)) for s in specs):
        return None
    return classifier_files_fingerprint(clf, with_drop=any(isinstance(s.policy, Budget) for s in specs))


def classifier_files_fingerprint(clf: str, with_drop: bool = False) -> str:
    """``DIR#hash`` of a classifier's own files (plots or subdirectories may sit beside them); ``const:S`` as is.
    ``with_drop``: the drop head too, which only a budget reads (so runs without one keep their identity)."""
    if clf.startswith("const:"):
        return clf
    digest = hashlib.sha256()
    for name in (CONFIG, WEIGHTS) + ((drop.WEIGHTS,) if with_drop else ()):
        digest.update(name.encode() + (Path(clf) / name).read_bytes())
    return f"{clf}#{digest.hexdigest()[:12]}"


def placement(*lms: LM | None) -> list[str] | None:
    """Device and dtype of each model ("cuda bfloat16"), or None when all are float32 on the CPU (what every
    earlier run used): rows decoded elsewhere have other timings and may differ in the last bits, so a run
    moved to another device or dtype (or int8 kernel, ``LM.placement``) must not resume from them."""
    where = [lm.placement for lm in lms if lm is not None]
    return where if any(w != "cpu float32" for w in where) else None


@dataclass
class EvalSettings:
    """What an evaluation run decodes with and where it writes (the run's identity, with the methods)."""

    task: str = "arith"
    data: str | None = None
    split: str = "test"
    n: int = 20
    seed: int = 0
    gamma: int = 5
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 200
    chat: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    stop: list[str] = field(default_factory=list)
    classifier: str | None = None  # for the run's fingerprint (PAD rows are tied to the classifier's files)
    out: Path | None = None
    overwrite: bool = False
    batch_size: int = 1  # > 1: rows decode together (throughput; a row's wall time then overlaps the others')
    engine: str = "torch"  # or vllm: ar, sd and pad inside vLLM (integrations.vllm), other methods refused


def evaluate(settings: EvalSettings, task: Task, problems: list[Problem], specs: list[MethodSpec],
             target: LM | None, draft: LM | None, between: Callable[[int, int], None] | None = None,
             decoders: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Run (or resume) the evaluation; with ``settings.out`` also write results, summaries, plot and report.
    ``between(done, total)`` runs after each problem, outside any timed decode."""
    st = settings
    config = {"task": st.task, "data": str(st.data) if st.data else None, "split": st.split, "n": st.n,
              "seed": st.seed, "methods": [s.label for s in specs], "gamma": st.gamma,
              "method_gammas": [s.gamma for s in specs], "classifier": classifier_fingerprint(st.classifier, specs),
              "temperature": st.temperature, "top_k": st.top_k, "top_p": st.top_p,
              "max_new_tokens": st.max_new_tokens, "target": target.name if target else None,
              "draft": draft.name if draft else None, "chat": st.chat}
    # Settings added later enter the identity only when used, so earlier runs still resume.
    config.update({k: v for k, v in (("chat_template_kwargs", st.chat_template_kwargs), ("stop", st.stop),
                                     ("placement", placement(target, draft)),
                                     ("batch_size", st.batch_size if st.batch_size > 1 else None),
                                     ("engine", st.engine if st.engine != "torch" else None),
                                     # sampled runs before per-problem seeds shared one stream: never merged
                                     ("seeding", "per-problem" if st.temperature > 0 else None)) if v})
    start = time.perf_counter()

    def progress(i: int, total: int) -> None:
        rate = (time.perf_counter() - start) / i
        print(f"\rproblems {i}/{total} | {rate:.1f} s/problem | ETA {rate * (total - i) / 60:.1f} min   ",
              end="" if i < total else "\n", file=sys.stderr, flush=True)
        if between:
            between(i, total)

    tag = run_hash(config)
    with ExitStack() as stack:  # results.jsonl stays locked until every row is written
        fh = stack.enter_context(open_for_append(st.out / "results.jsonl", st.overwrite)) if st.out else None
        earlier = open_run(st.out, config) if st.out else []
        rows = run_eval(task, problems, specs, target, draft, chat=st.chat, progress=progress,
                        done={(r["problem_id"], r["method"]) for r in earlier},
                        emit=(lambda r: append_record(fh, {**r, "run": tag})) if fh else None,
                        cfg=SamplingConfig(st.temperature, st.top_k, st.top_p), gamma=st.gamma,
                        max_new_tokens=st.max_new_tokens, seed=st.seed, stop_strings=st.stop,
                        chat_template_kwargs=st.chat_template_kwargs, batch_size=st.batch_size, decoders=decoders)
    wanted = {p.id for p in problems}
    rows = [r for r in earlier if r["problem_id"] in wanted] + rows
    summary = summarize(rows)
    if st.out:
        write_reports(st.out, rows, summary, problems, config)
    return summary
