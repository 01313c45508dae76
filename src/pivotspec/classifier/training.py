"""Training and evaluating the pivot classifier on a labels file (a workflow over ``classifier`` and
``features``).

Protocol: whole problems go to three splits, train / selection / report (60/20/20 by default). A small sweep
(learning rate x weight decay) trains on train; each run keeps the epoch with the lowest selection loss;
the run with the best selection AUROC wins; sigma is calibrated on selection; every number reported as
held-out comes from the report split, which chose nothing. Reference classifiers (logistic regressions on
p(d) alone and on [entropy, p(d)]) are fitted on the same train split and reported beside the model, so a
classifier that has only learned a probability threshold shows as one. The expected-drop head
(``classifier.drop``) is trained on the same rows and splits at the sweep's chosen settings.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pivotspec.classifier import drop, features, metrics
from pivotspec.classifier import model as clf
from pivotspec.decoding.models import LM
from pivotspec.errors import UsageError

SWEEP_LRS = (1e-3, 3e-4, 1e-4)
SWEEP_WEIGHT_DECAYS = (0.0, 1e-2)
MIN_PER_CLASS = 5  # fewer pivots or non-pivots than this in a split cannot train or calibrate anything


def parse_pivot_rule(rule: str) -> tuple[str, float]:
    """``"MODE:ALPHA"`` (``labels.walk.is_pivot``'s rules, e.g. ``mul:0.8``) as (mode, alpha), checked."""
    from pivotspec.labels.walk import MODES

    mode, _, alpha = rule.partition(":")
    try:
        value = float(alpha)
    except ValueError:
        value = -1.0
    if mode not in MODES or not 0 < value <= 1:
        raise UsageError(f"--pivot-rule {rule!r}: give MODE:ALPHA with MODE one of {', '.join(MODES)} and ALPHA in "
                         "(0, 1], e.g. mul:0.8")
    return mode, value


@dataclass(frozen=True)
class Filters:
    """Which stored candidates become training rows, and as what: the authors' training filters (from their
    labeling scripts; the first is on by default), and optionally another pivot rule than the files' own."""

    drop_unsolvable: bool = True  # U_rej == 0: the target fails either way, so d changes nothing
    pivot_max_u_acc: float | None = None  # keep pivots only if U_acc <= this
    nonpivot_min_u_acc: float | None = None  # keep non-pivots only if U_acc >= this (authors: 0.8)
    # "MODE:ALPHA": every candidate relabeled from its stored U_acc and U_rej (None: as its file labeled it).
    # A stricter rule (mul:0.8: a pivot takes a fifth of the success rate) also flags the moderate drops
    # that add up over an answer's overrides.
    pivot_rule: str | None = None

    def __post_init__(self) -> None:
        if self.pivot_rule is not None:
            parse_pivot_rule(self.pivot_rule)

    def relabel(self, feats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``feats`` with its labels by ``pivot_rule`` (unchanged without one)."""
        if self.pivot_rule is None:
            return feats
        from pivotspec.labels.walk import is_pivot

        mode, alpha = parse_pivot_rule(self.pivot_rule)
        y = [is_pivot(a, r, mode, alpha) for a, r in zip(feats["u_acc"].tolist(), feats["u_rej"].tolist(), strict=True)]
        return {**feats, "labels": torch.tensor(y, dtype=feats["labels"].dtype)}

    def mask(self, feats: dict[str, torch.Tensor]) -> torch.Tensor:
        y, u_acc = feats["labels"].bool(), feats["u_acc"]
        keep = torch.ones_like(y)
        if self.drop_unsolvable:
            keep &= feats["u_rej"] > 0
        if self.pivot_max_u_acc is not None:
            keep &= ~y | (u_acc <= self.pivot_max_u_acc)
        if self.nonpivot_min_u_acc is not None:
            keep &= y | (u_acc >= self.nonpivot_min_u_acc)
        return keep


def inputs(kind: str, feats: dict[str, torch.Tensor], mask: torch.Tensor) -> tuple:
    """(hidden, scalars) rows of ``mask`` for a ``kind`` classifier."""
    if kind == "context":
        return feats["hidden"][mask], torch.cat([feats["scalars"][mask][:, :2], feats["context"][mask]], dim=-1)
    k = clf.n_scalars(kind)
    return feats["hidden"][mask], (feats["scalars"][mask][:, :k] if k else None)


def _check_classes(y: torch.Tensor, split: torch.Tensor) -> None:
    for i, name in enumerate(features.SPLITS):
        counts = torch.bincount(y[split == i], minlength=2).tolist()
        if min(counts) < MIN_PER_CLASS:
            raise UsageError(f"the {name} split has {counts[1]} pivots and {counts[0]} non-pivots (need >= "
                             f"{MIN_PER_CLASS} of each): label more problems")


def fit_with_sweep(kind: str, feats: dict[str, torch.Tensor], split: torch.Tensor, *, epochs: int, seed: int,
                   lrs: tuple[float, ...] = SWEEP_LRS, weight_decays: tuple[float, ...] = SWEEP_WEIGHT_DECAYS,
                   progress: Callable[[str], None] | None = None) -> tuple[clf.PivotNet, dict[str, Any]]:
    """Train one ``kind`` classifier per (lr, weight decay); return the best on the selection split."""
    y = feats["labels"]
    tr, sel = split == 0, split == 1
    runs, best = [], None
    for lr, wd in itertools.product(lrs, weight_decays):
        net, info = clf.train(kind, feats["hidden"].shape[1], inputs(kind, feats, tr), y[tr], inputs(kind, feats, sel),
                              y[sel], lr=lr, weight_decay=wd, epochs=epochs, seed=seed)
        sel_auroc = metrics.auroc(clf.pivot_scores(net, *inputs(kind, feats, sel)), y[sel])
        run = {"lr": lr, "weight_decay": wd, **info, "selection_auroc": sel_auroc}
        runs.append(run)
        if progress:
            progress(f"{kind} lr {lr:g} wd {wd:g}: best epoch {info['best_epoch']}, selection AUROC {sel_auroc:.3f}")
        score = (sel_auroc, -info["best_val_loss"])
        if best is None or score > (best[1]["selection_auroc"], -best[1]["best_val_loss"]):
            best = (net, run)
    return best[0], {"chosen": best[1], "runs": runs}


def fit_drop(kind: str, feats: dict[str, torch.Tensor], split: torch.Tensor, chosen: dict[str, Any], *,
             epochs: int, seed: int) -> tuple[clf.PivotNet, dict[str, Any]]:
    """The expected-drop head (``classifier.drop``) on the classifier's rows and splits, at the learning rate
    and weight decay the pivot sweep chose; its report-split metrics."""
    target = drop.drop_targets(feats)
    tr, sel, rep = split == 0, split == 1, split == 2
    net, info = drop.train_drop(kind, inputs(kind, feats, tr), target[tr], inputs(kind, feats, sel), target[sel],
                                lr=chosen["lr"], weight_decay=chosen["weight_decay"], epochs=epochs, seed=seed)
    pred = drop.predicted_drops(net, *inputs(kind, feats, rep))
    return net, {"target": "max(0, u_rej - u_acc)", "lr": chosen["lr"], "weight_decay": chosen["weight_decay"],
                 **info, "report": drop.report(pred, target[rep], feats["labels"][rep], float(target[tr].mean()))}


def reference_models(feats: dict[str, torch.Tensor], split: torch.Tensor) -> dict[str, dict[str, Any]]:
    """The logistic-regression references, fitted on the train split."""
    tr = split == 0
    return {name: {"columns": cols, **clf.fit_logistic(feats["scalars"][tr][:, cols], feats["labels"][tr])}
            for name, cols in clf.REFERENCES.items()}


def reference_reports(refs: dict[str, dict[str, Any]], feats: dict[str, torch.Tensor],
                      mask: torch.Tensor) -> dict[str, dict[str, Any]]:
    return {name: metrics.report(clf.logistic_scores(ref, feats["scalars"][mask][:, ref["columns"]]),
                                 feats["labels"][mask]) for name, ref in refs.items()}


BY_PROBLEM, BY_ROUND = "by_problem", "by_round"  # how rows are split (a classifier's config says which)


def split_rows(records: list[dict], feats: dict[str, torch.Tensor], keep: torch.Tensor, seed: int,
               scheme: str) -> torch.Tensor:
    """The (filtered) rows' splits as training makes them: over a union of rounds ``by_round``
    (``features.split_by_round``: round 0's problems split as round 0 alone would be), else ``by_problem``
    (a permutation of all the problems; also what union classifiers trained before ``by_round`` used)."""
    if scheme == BY_ROUND:
        rounds = torch.tensor([r.get("source", 0) for r in features.candidates(records)])[keep]
        return features.split_by_round(feats["group"], rounds, seed)
    return features.split_by_problem(feats["group"], seed=seed)


def read_label_files(labels: Path | list[Path], target: LM) -> tuple[list[dict], str]:
    """The records of one labels file, or of several (rounds of on-policy labels: their union), each checked
    against ``target``; and a cache key for their features. Candidates of the k-th file carry ``source`` k, so
    one problem's candidates from two rounds (same step, other trajectories) are all kept, while a problem's
    rows stay in one split whatever round they come from (the split groups by problem id)."""
    from pivotspec.store import read_records

    files = labels if isinstance(labels, list) else [labels]
    records = []
    for k, path in enumerate(files):
        mine = read_records(path, repair=False)
        check_labels_target(mine, target, path)
        records += [{**r, "source": k} if len(files) > 1 and r.get("type") == "candidate" else r for r in mine]
    return records, "+".join(features.file_hash(f) for f in files)


def train_from_labels(labels: Path | list[Path], target: LM, out: Path, kind: str = "extended_v2", layer: int = -8,
                      target_recall: float = 0.95, draft: LM | None = None, epochs: int = 2000, seed: int = 0,
                      split_seed: int = 0, filters: Filters = Filters(), compare_types: bool = False,
                      progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Extract features, split by problem, sweep, calibrate sigma on selection, report on the report split,
    save to ``out``; returns the stored config. The caller (``api.train_classifier``) has checked the labels
    file, ``out`` and the settings."""
    from pivotspec.labels.identity import model_identity

    if (kind == "extended" or compare_types) and draft is None:
        raise UsageError("classifier type 'extended' (and --compare-types) needs the draft: pass --draft or --pair")
    resolved = target.resolve_layer(layer)
    records, cache_key = read_label_files(labels, target)
    feats = filters.relabel(features.extract(target, records, resolved,
                                             draft if (kind == "extended" or compare_types) else None,
                                             cache_key=cache_key))
    keep = filters.mask(feats)
    feats = {k: v[keep] for k, v in feats.items()}
    scheme = BY_ROUND if isinstance(labels, list) and len(labels) > 1 else BY_PROBLEM
    split = split_rows(records, feats, keep, split_seed, scheme)
    y = feats["labels"]
    _check_classes(y, split)
    sel, rep = split == 1, split == 2
    refs = reference_models(feats, split)
    kinds = [kind] + ([k for k in clf.TYPES if k != kind] if compare_types else [])
    comparison, chosen = {}, None
    for k in kinds:
        net, sweep = fit_with_sweep(k, feats, split, epochs=epochs, seed=seed, progress=progress)
        comparison[k] = {"report_auroc": metrics.auroc(clf.pivot_scores(net, *inputs(k, feats, rep)), y[rep]),
                         "selection_auroc": sweep["chosen"]["selection_auroc"]}
        if k == kind:
            chosen = (net, sweep)
    net, sweep = chosen
    sel_scores = clf.pivot_scores(net, *inputs(kind, feats, sel))
    rep_scores = clf.pivot_scores(net, *inputs(kind, feats, rep))
    sigma = clf.calibrate_sigma(sel_scores, y[sel], target_recall)
    drop_net, drop_config = fit_drop(kind, feats, split, sweep["chosen"], epochs=epochs, seed=seed)
    config = {
        "type": kind, "layer": resolved, "layer_arg": layer, "feature_row": clf.FEATURE_ROW, "d_model": target.d_model,
        "features": ["hidden@draft_token"] + (["target_entropy", "target_prob_d"] if clf.n_scalars(kind) else [])
        + (["draft_entropy", "draft_prob_d"] if kind == "extended" else [])
        + (["log1p_overrides", "override_share", "log1p_since_override"] if kind == "context" else []),
        "target": model_identity(target), "sigma": sigma, "target_recall": target_recall,
        "labels": {**({"file": labels.name, "sha256_16": cache_key} if isinstance(labels, Path) else
                      {"files": [f.name for f in labels], "sha256_16": cache_key.split("+")}),
                   "candidates": int(len(keep)),
                   "rows_after_filters": len(y),
                   "rows": {name: int((split == i).sum()) for i, name in enumerate(features.SPLITS)},
                   "problems": {name: int(len(torch.unique(feats["group"][split == i])))
                                for i, name in enumerate(features.SPLITS)}},
        "filters": asdict(filters), "split": scheme, "split_seed": split_seed, "seed": seed,
        "training": {"epochs_max": epochs, "sweep": sweep},
        "metrics": {"report": metrics.report(rep_scores, y[rep]),
                    "report_at_sigma": metrics.at_threshold(rep_scores, y[rep], sigma),
                    "selection": metrics.report(sel_scores, y[sel]),
                    "selection_at_sigma": metrics.at_threshold(sel_scores, y[sel], sigma)},
        "references": {name: {"columns": ref["columns"], "model": {k: ref[k] for k in ("mean", "std", "w", "b")},
                              "report": r} for (name, ref), r in zip(refs.items(),
                                                                     reference_reports(refs, feats, rep).values(),
                                                                     strict=True)},
        "type_comparison": comparison,
        "drop": drop_config,
    }
    clf.save(out, net, config)
    drop.save(out, drop_net)
    metrics.plot_curves(rep_scores, y[rep], out, title="report split")
    return config


def check_labels_target(records: list[dict], target: LM, path: Path) -> None:
    """Labels made with another target describe that model's rollouts, not this one's."""
    from pivotspec.labels.identity import model_identity, same_model

    made_with = next((r.get("target") for r in records if r.get("type") == "candidate"), None)
    mine = model_identity(target)
    if made_with is None or same_model(made_with, mine):
        return
    if all(made_with.get(k) == mine[k] for k in ("name", "num_layers", "d_model")):
        raise UsageError(f"{path} was labeled with other weights of target {target.name!r} (fingerprint "
                         f"{made_with.get('weights')}, this one {mine['weights']}): relabel with this target")
    raise UsageError(f"{path} was labeled with target {made_with.get('name')!r} "
                     f"({made_with.get('num_layers')} layers, width {made_with.get('d_model')}), not "
                     f"{target.name!r}: label with this target or pass the target the labels were made with")


def evaluate_on_labels(classifier_dir: Path, labels: Path, target: LM, draft: LM | None, plots: Path,
                       filters: Filters = Filters()) -> dict[str, Any]:
    """The classifier and its stored references on every (filtered) candidate of another labels file (which
    ``api.evaluate_classifier`` has checked, with the draft an ``extended`` classifier needs)."""
    from pivotspec.store import read_records

    net, config = clf.load(classifier_dir)
    clf.check_compatible(config, target)
    records = read_records(labels, repair=False)
    check_labels_target(records, target, labels)
    feats = filters.relabel(features.extract(target, records, config["layer"],
                                             draft if config["type"] == "extended" else None,
                                             cache_key=features.file_hash(labels)))
    mask = filters.mask(feats)
    if int(mask.sum()) == 0:
        raise UsageError(f"{labels} has no candidates left after the filters: check the file or the filters")
    scores = clf.pivot_scores(net, *inputs(config["type"], feats, mask))
    refs = {name: {"columns": r["columns"], **r["model"]} for name, r in config.get("references", {}).items()}
    result = {**metrics.report(scores, feats["labels"][mask]),
              "at_sigma": metrics.at_threshold(scores, feats["labels"][mask], config["sigma"]),
              "references": {k: v["auroc"] for k, v in reference_reports(refs, feats, mask).items()}}
    metrics.plot_curves(scores, feats["labels"][mask], plots, title=labels.stem)
    return {**result, "plots": str(plots)}


def probability_properties(labels: Path, target: LM, classifier_dir: Path | None = None, layer: int = -1,
                           split_seed: int = 0, threshold: float = 0.1) -> dict[str, Any]:
    """How far the target's probability of the draft token, p(d), alone tells pivots from harmless
    candidates (issue 16's regime test): the share of non-pivots with p(d) < ``threshold``, the share of
    pivots with p(d) > ``threshold``, and on the report split (the training protocol's split by problem)
    the AUROC of the p(d)-only logistic reference, fitted on the train split, and of ``classifier_dir``'s
    classifier when given (its layer, filters and split seed are used then)."""
    from pivotspec.store import exists, read_records

    if not exists(labels):
        raise UsageError(f"labels file {str(labels)!r} does not exist: check the path")
    records = read_records(labels, repair=False)
    check_labels_target(records, target, labels)
    net, config, filters = None, None, Filters()
    if classifier_dir is not None:
        net, config = clf.load(classifier_dir)
        clf.check_compatible(config, target)
        if config["type"] == "extended":
            raise UsageError("this classifier reads draft scalars; labels stats scores extended_v2, mlp and linear")
        layer, split_seed, filters = config["layer"], config.get("split_seed", 0), Filters(**config["filters"])
    feats = features.extract(target, records, target.resolve_layer(layer), cache_key=features.file_hash(labels))
    keep = filters.mask(feats)
    feats = {k: v[keep] for k, v in feats.items()}
    y, p_d = feats["labels"], feats["scalars"][:, 1]
    split = features.split_by_problem(feats["group"], seed=split_seed)
    _check_classes(y, split)
    rep = split == 2
    ref = {"columns": [1], **clf.fit_logistic(feats["scalars"][split == 0][:, [1]], y[split == 0])}
    out = {"candidates": len(y), "threshold": threshold,
           "harmless_low_p": float((p_d[y == 0] < threshold).float().mean()) if (y == 0).any() else None,
           "pivots_high_p": float((p_d[y == 1] > threshold).float().mean()) if (y == 1).any() else None,
           "report_candidates": int(rep.sum()),
           "report_auroc_p_d": metrics.auroc(clf.logistic_scores(ref, feats["scalars"][rep][:, [1]]), y[rep])}
    if net is not None:
        out["report_auroc_classifier"] = metrics.auroc(clf.pivot_scores(net, *inputs(config["type"], feats, rep)),
                                                       y[rep])
        out["classifier_trained_on_this_file"] = config["labels"]["sha256_16"] == features.file_hash(labels)
    return out
