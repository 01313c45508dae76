"""The API's evaluation: methods side by side on a task, and their summaries."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from pivotspec.api import engines
from pivotspec.api.decoding import check_decoding
from pivotspec.api.pairs import Pair, default_classifier, get_task
from pivotspec.decoding.acceptance import DEFAULT_P_FLOOR
from pivotspec.errors import UsageError
from pivotspec.evaluation import reports, runs, summary
from pivotspec.evaluation.runs import EvalSettings, MethodSpec
from pivotspec.store import ensure_writable_dir, read_records
from pivotspec.tasks import Task


def method_specs(pair: Pair | None, methods: str = "ar,sd", *, sigmas: list[float] | None = None,
                 baselines: list[str] = (), classifier: str | None = None, sigma: float | None = None,
                 p_floor: float = DEFAULT_P_FLOOR, pair_name: str | None = None, budget: float | None = None,
                 budgets: list[float] | None = None) -> list[MethodSpec]:
    """The labelled methods an evaluation runs (one pad per sigma, one pad-budget per budget, one per baseline
    spec); with ``pair=None`` only their arguments are checked (pad policies are None)."""
    return runs.method_specs(methods, pair.target if pair else None, sigmas=sigmas, baselines=list(baselines),
                             classifier=classifier, sigma=sigma, p_floor=p_floor, pair=pair.name if pair else pair_name,
                             budgets=budgets if budgets is not None else ([budget] if budget is not None else None))


def check_evaluate(settings: EvalSettings) -> Task:
    """An evaluation's settings, task, data file and output directory, before any model loads; returns the
    task (a file-backed one has read its file)."""
    check_decoding(settings.gamma, settings.max_new_tokens, settings.temperature, settings.top_k, settings.top_p,
                   settings.stop)
    if settings.n < 1:
        raise UsageError(f"--n must be >= 1, got {settings.n}")
    if settings.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {settings.batch_size}")
    task = get_task(settings.task, settings.data)
    if settings.out is not None:
        ensure_writable_dir(Path(settings.out))
    return task


def evaluate(pair: Pair, settings: EvalSettings | None = None, *, methods: str = "ar,sd",
             sigmas: list[float] | None = None, baselines: list[str] = (), classifier: str | None = None,
             sigma: float | None = None, p_floor: float = DEFAULT_P_FLOOR, specs: list[MethodSpec] | None = None,
             between: Any = None, **setting_overrides: Any) -> dict[str, dict[str, Any]]:
    """Methods side by side on a task (``settings``, or its fields as keywords: task, n, split, out, ...).
    ``specs`` (from ``method_specs``, or ``MethodSpec``s of your own, e.g. one gamma each) replaces the
    method arguments; ``between(done, total)`` runs after each problem, outside any timed decode. Returns the
    summary per method; with ``out`` also writes results.jsonl, summaries and the report."""
    st = replace(settings or EvalSettings(), **setting_overrides)
    classifier = classifier or st.classifier
    if specs is None:
        specs = method_specs(pair, methods, sigmas=sigmas, baselines=baselines, classifier=classifier,
                             sigma=sigma, p_floor=p_floor)
    task = check_evaluate(st)
    if any(s.method != "ar" for s in specs) and pair.draft is None:
        raise UsageError("these methods need a draft model: load the pair with a draft")
    if classifier is None and any(s.method == "pad" for s in specs):
        classifier = default_classifier(pair.name)
    st = replace(st, classifier=classifier)
    target = None if all(s.method == "draft" for s in specs) else pair.target
    problems = task.problems(st.split, st.n, st.seed)
    if st.engine == "torch":
        return runs.evaluate(st, task, problems, specs, target, pair.draft, between)
    decoders = engines.vllm_decoders(pair, specs, st)
    try:
        return runs.evaluate(st, task, problems, specs, target, pair.draft, between, decoders=decoders)
    finally:
        for d in set(decoders.values()):
            d.close()


def summarize(rows: list[dict[str, Any]], references: tuple[str, ...] = ("ar", "sd")) -> dict[str, dict[str, Any]]:
    """An evaluation's summary from its rows (e.g. those of results.jsonl), each method compared, paired by
    problem, with each of ``references``."""
    return summary.summarize(rows, references=references)


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file that may still be being written (a torn last line is left out, not cut)."""
    return read_records(Path(path), repair=False)


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """An evaluation's summary as the Markdown table the CLI prints."""
    return reports.format_table(summary)


def format_cell(x: Any, spec: str, suffix: str = "") -> str:
    """One number of a summary as that table writes it (``-`` for None)."""
    return reports.fmt(x, spec, suffix)


def format_paired(comparison: dict[str, Any] | None) -> str:
    """A paired comparison (``summary[method]["paired"][reference]``) as that table writes it."""
    return reports.paired_cell(comparison)
