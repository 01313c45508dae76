"""``pivotspec train-classifier`` and ``pivotspec eval-classifier``: labels file -> classifier directory."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pivotspec import classifier as clf
from pivotspec import features, metrics
from pivotspec.errors import UsageError
from pivotspec.models import LM


def _xs(kind: str, feats: dict[str, torch.Tensor], mask: torch.Tensor) -> tuple:
    k = clf.n_scalars(kind)
    s = feats["scalars"][mask][:, :k] if k else None
    return feats["hidden"][mask], s


def train_from_labels(labels: Path, target: LM, out: Path, kind: str = "extended_v2", layer: int | None = None,
                      target_recall: float = 0.95, draft: LM | None = None, epochs: int = 2000, lr: float = 1e-3,
                      seed: int = 0, progress: Callable | None = None) -> dict[str, Any]:
    """Extract features, train with a by-problem 80/20 split, calibrate sigma, save; returns the config."""
    from pivotspec.labeling import model_identity
    from pivotspec.store import read_records

    if not labels.is_file():
        raise UsageError(f"labels file {str(labels)!r} does not exist: run `pivotspec label` first")
    if not 0 < target_recall <= 1:
        raise UsageError(f"--target-recall must be in (0, 1], got {target_recall}")
    if kind == "extended" and draft is None:
        raise UsageError("classifier type 'extended' needs the draft's scalars: pass --draft or --pair")
    layer = layer if layer is not None else max(1, target.num_layers - 8)
    if not 1 <= layer <= target.num_layers:
        raise UsageError(f"--layer must be in 1..{target.num_layers} for this target, got {layer}")
    feats = features.extract(target, read_records(labels, repair=False), layer,
                             draft if kind == "extended" else None, cache_key=features.file_hash(labels))
    val = features.split_by_problem(feats["group"], 0.2, seed)
    y = feats["labels"]
    if len(torch.unique(y[~val])) < 2:
        raise UsageError("the training split needs both pivots and non-pivots: label more problems")
    net = clf.PivotNet(kind, target.d_model)
    training = clf.train(net, _xs(kind, feats, ~val), y[~val], _xs(kind, feats, val), y[val], lr=lr, epochs=epochs,
                         seed=seed, progress=progress)
    val_scores = clf.pivot_scores(net, *_xs(kind, feats, val))
    train_scores = clf.pivot_scores(net, *_xs(kind, feats, ~val))
    sigma = clf.calibrate_sigma(val_scores, y[val], target_recall)
    config = {
        "type": kind, "layer": layer, "d_model": target.d_model,
        "features": ["hidden"] + (["target_entropy", "target_prob_d"] if clf.n_scalars(kind) else [])
        + (["draft_entropy", "draft_prob_d"] if kind == "extended" else []),
        "target": model_identity(target), "sigma": sigma, "target_recall": target_recall,
        "val_recall_at_sigma": metrics.at_threshold(val_scores, y[val], sigma)["recall"],
        "labels": {"file": labels.name, "sha256_16": features.file_hash(labels), "rows": len(y),
                   "val_rows": int(val.sum()), "val_problems": int(len(torch.unique(feats["group"][val])))},
        "training": {**training, "lr": lr, "seed": seed},
        "metrics": {"val": metrics.report(val_scores, y[val]), "train": metrics.report(train_scores, y[~val])},
    }
    clf.save(out, net, config)
    metrics.plot_curves(val_scores, y[val], out, title="validation")
    return config


def load_for_target(path: Path, target: LM) -> tuple[Callable[..., torch.Tensor], dict[str, Any]]:
    """A trained classifier as the decoding loop's callable, checked against ``target``."""
    net, config = clf.load(path)
    clf.check_compatible(config, target)
    return clf.as_policy_classifier(net), config


def summary_lines(rep: dict[str, Any]) -> list[str]:
    lines = [f"n {rep['n']}, pivots {rep['pivots']}, AUROC {rep['auroc']:.3f}, PR-AUC {rep['pr_auc']:.3f}",
             "| threshold | precision | recall | F1 | tp | fp | fn | tn |", "|---|---|---|---|---|---|---|---|"]
    for t in rep["thresholds"]:
        lines.append(f"| {t['threshold']:.1f} | {t['precision']:.3f} | {t['recall']:.3f} | {t['f1']:.3f} | "
                     f"{t['tp']} | {t['fp']} | {t['fn']} | {t['tn']} |")
    return lines


def cmd_train_classifier(args: argparse.Namespace) -> None:
    from pivotspec.cli import load_models

    target, draft = load_models(args, needs_draft=args.type == "extended")

    def progress(epoch: int, total: int, loss: float, val_loss: float) -> None:
        print(f"\repoch {epoch}/{total} | train loss {loss:.4f} | val loss {val_loss:.4f}   ", end="",
              file=sys.stderr, flush=True)

    config = train_from_labels(args.labels, target, args.out, args.type, args.layer, args.target_recall, draft,
                               args.epochs, args.lr, args.seed, progress)
    print(file=sys.stderr)
    print("\n".join(summary_lines(config["metrics"]["val"])))
    print(f"sigma {config['sigma']:.4f} (validation pivot recall {config['val_recall_at_sigma']:.3f} >= "
          f"{config['target_recall']}); saved to {args.out}")


def cmd_eval_classifier(args: argparse.Namespace) -> None:
    from pivotspec.models import load_lm
    from pivotspec.store import read_records

    net, config = clf.load(args.classifier)
    target = load_lm(args.target or config["target"]["name"], args.dtype)
    clf.check_compatible(config, target)
    if not args.labels.is_file():
        raise UsageError(f"labels file {str(args.labels)!r} does not exist: check the path")
    draft = load_lm(args.draft, args.dtype) if config["type"] == "extended" and args.draft else None
    if config["type"] == "extended" and draft is None:
        raise UsageError("this classifier reads draft scalars: pass --draft")
    feats = features.extract(target, read_records(args.labels, repair=False), config["layer"], draft,
                             cache_key=features.file_hash(args.labels))
    mask = torch.ones(len(feats["labels"]), dtype=torch.bool)
    scores = clf.pivot_scores(net, *_xs(config["type"], feats, mask))
    rep = metrics.report(scores, feats["labels"])
    plots = args.plots or (Path(args.classifier) / f"eval-{args.labels.stem}")
    metrics.plot_curves(scores, feats["labels"], plots, title=args.labels.stem)
    if args.json:
        print(json.dumps({**rep, "plots": str(plots)}))
    else:
        print("\n".join(summary_lines(rep)))
        print(f"ROC and PR curves in {plots}")


def add_parsers(sub: Any, add_model_args: Callable[[argparse.ArgumentParser], None]) -> None:
    tr = sub.add_parser("train-classifier", help="train a pivot classifier on a labels file")
    add_model_args(tr)
    tr.add_argument("--labels", type=Path, required=True)
    tr.add_argument("--out", type=Path, required=True)
    tr.add_argument("--type", choices=clf.TYPES, default="extended_v2")
    tr.add_argument("--layer", type=int, default=None, help="target layer to read (default L - 8)")
    tr.add_argument("--target-recall", type=float, default=0.95, help="sigma = largest with val recall >= this")
    tr.add_argument("--epochs", type=int, default=2000)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.set_defaults(func=cmd_train_classifier)

    ev = sub.add_parser("eval-classifier", help="AUROC, PR-AUC, P/R/F1 per threshold, ROC/PR plots")
    ev.add_argument("--classifier", type=Path, required=True)
    ev.add_argument("--labels", type=Path, required=True)
    ev.add_argument("--target", help="default: the target the classifier was trained for")
    ev.add_argument("--draft", help="needed for 'extended' classifiers")
    ev.add_argument("--dtype", default="float32")
    ev.add_argument("--plots", type=Path, help="where to write roc.png and pr.png")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval_classifier)
