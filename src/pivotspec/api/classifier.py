"""The API's pivot classifier: train it on labels and evaluate it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pivotspec.api.pairs import Pair
from pivotspec.classifier.model import CONFIG as CLASSIFIER_CONFIG
from pivotspec.classifier.model import TYPES as CLASSIFIER_TYPES
from pivotspec.classifier.model import load as load_classifier
from pivotspec.classifier.training import Filters, evaluate_on_labels, train_from_labels
from pivotspec.decoding.models import load_lm
from pivotspec.errors import UsageError
from pivotspec.store import check_output_dir, exists


def _check_labels_file(labels: Path) -> None:
    if not exists(labels):
        raise UsageError(f"labels file {str(labels)!r} does not exist: check the path (or run `pivotspec label`)")


def _label_paths(labels: str | Path | list[str | Path]) -> Path | list[Path]:
    """One labels file, or several (their union: rounds of on-policy labels)."""
    if isinstance(labels, list | tuple):
        paths = [Path(p) for p in labels]
        return paths[0] if len(paths) == 1 else paths
    return Path(labels)


def check_train_classifier(labels: str | Path | list[str | Path], out: str | Path, overwrite: bool = False,
                           kind: str = "extended_v2", target_recall: float = 0.95,
                           filters: dict[str, Any] | None = None) -> None:
    """Labels files, a classifier directory that may be written and the settings (``filters`` too), before any
    model loads."""
    Filters(**(filters or {}))  # a bad --pivot-rule is refused here
    paths = _label_paths(labels)
    for path in paths if isinstance(paths, list) else [paths]:
        _check_labels_file(path)
    if kind not in CLASSIFIER_TYPES:
        raise UsageError(f"unknown classifier type {kind!r}: choose one of {', '.join(CLASSIFIER_TYPES)}")
    if not 0 < target_recall <= 1:
        raise UsageError(f"--target-recall must be in (0, 1], got {target_recall}")
    check_output_dir(Path(out), overwrite, CLASSIFIER_CONFIG)


def train_classifier(pair: Pair, labels: str | Path | list[str | Path], out: str | Path, *, overwrite: bool = False,
                     filters: dict[str, Any] | None = None, kind: str = "extended_v2", target_recall: float = 0.95,
                     **options: Any) -> dict[str, Any]:
    """Train, calibrate and save a pivot classifier (``classifier.training.train_from_labels`` options: layer,
    epochs, seed, split_seed, compare_types, progress; ``filters``: the fields of
    ``classifier.training.Filters``). ``labels``: a file, or a list of files trained on as one set (the union
    of labeling rounds; a problem's candidates from every round go to one split). Returns its config."""
    check_train_classifier(labels, out, overwrite, kind, target_recall, filters)
    return train_from_labels(_label_paths(labels), pair.target, Path(out), kind=kind, target_recall=target_recall,
                             draft=pair.draft, filters=Filters(**(filters or {})), **options)


def evaluate_classifier(classifier: str | Path, labels: str | Path, *, target: str | None = None,
                        draft: str | None = None, dtype: str | None = None, device: str | None = None,
                        out: str | Path | None = None, filters: dict[str, Any] | None = None) -> dict[str, Any]:
    """A classifier on every (filtered) candidate of a labels file: AUROC, PR-AUC, P/R/F1 per threshold, the
    stored references and ROC/PR plots in ``out`` (default: LABELS.eval-CLASSIFIER beside the labels; never
    the classifier's directory, which may be inside the installed package). ``config`` in the result is the
    classifier's own."""
    classifier, labels = Path(classifier), Path(labels)
    _, config = load_classifier(classifier)
    _check_labels_file(labels)
    if config["type"] == "extended" and not draft:
        raise UsageError("this classifier reads draft scalars: pass --draft")
    t = load_lm(target or config["target"]["name"], dtype, device=device)
    d = load_lm(draft, dtype, device=device) if config["type"] == "extended" else None
    plots = Path(out) if out else labels.with_name(f"{labels.stem}.eval-{classifier.name}")
    report = evaluate_on_labels(classifier, labels, t, d, plots, Filters(**(filters or {})))
    return {**report, "config": config}
