"""``pivotspec train-classifier`` and ``pivotspec eval-classifier``: labels file -> classifier directory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pivotspec import api
from pivotspec.cli.common import add_model_args


def summary_lines(rep: dict[str, Any]) -> list[str]:
    lines = [f"n {rep['n']}, pivots {rep['pivots']}, AUROC {rep['auroc']:.3f}, PR-AUC {rep['pr_auc']:.3f}",
             "| threshold | precision | recall | F1 | tp | fp | fn | tn |", "|---|---|---|---|---|---|---|---|"]
    for t in rep["thresholds"]:
        lines.append(f"| {t['threshold']:.1f} | {t['precision']:.3f} | {t['recall']:.3f} | {t['f1']:.3f} | "
                     f"{t['tp']} | {t['fp']} | {t['fn']} | {t['tn']} |")
    return lines


def reference_lines(config: dict[str, Any]) -> list[str]:
    """AUROC on the report split: the model, every type compared, and the references."""
    lines = ["| classifier (report split) | AUROC | PR-AUC |", "|---|---|---|"]
    rep = config["metrics"]["report"]
    lines.append(f"| {config['type']} (shipped) | {rep['auroc']:.3f} | {rep['pr_auc']:.3f} |")
    for kind, c in config.get("type_comparison", {}).items():
        if kind != config["type"]:
            lines.append(f"| {kind} | {c['report_auroc']:.3f} | - |")
    for name, r in config.get("references", {}).items():
        lines.append(f"| {name} (reference) | {r['report']['auroc']:.3f} | {r['report']['pr_auc']:.3f} |")
    return lines


def _filters(args: argparse.Namespace) -> dict[str, Any]:
    return {"drop_unsolvable": not args.keep_unsolvable, "pivot_max_u_acc": args.pivot_max_u_acc,
            "nonpivot_min_u_acc": args.nonpivot_min_u_acc, "pivot_rule": args.pivot_rule}


def cmd_train_classifier(args: argparse.Namespace) -> None:
    api.check_train_classifier(args.labels, args.out, args.overwrite, args.type, args.target_recall, _filters(args))
    pair = api.load_pair(args.target, args.draft, pair=args.pair, dtype=args.dtype, threads=args.threads,
                         device=args.device, needs_draft=args.type == "extended" or args.compare_types)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    config = api.train_classifier(pair, args.labels, args.out, overwrite=args.overwrite, filters=_filters(args),
                                  kind=args.type, layer=args.layer, target_recall=args.target_recall,
                                  epochs=args.epochs, seed=args.seed, split_seed=args.split_seed,
                                  compare_types=args.compare_types, progress=progress)
    chosen = config["training"]["sweep"]["chosen"]
    at = config["metrics"]["report_at_sigma"]
    print("\n".join(summary_lines(config["metrics"]["report"])))
    print()
    print("\n".join(reference_lines(config)))
    print(f"layer {config['layer']}, lr {chosen['lr']:g}, weight decay {chosen['weight_decay']:g}, "
          f"best epoch {chosen['best_epoch']}")
    sel_recall = config["metrics"]["selection_at_sigma"]["recall"]
    print(f"sigma {config['sigma']:.4f} (selection pivot recall {sel_recall:.3f}"
          f" >= {config['target_recall']}); report split at sigma: recall {at['recall']:.3f}, accepted "
          f"{at['override_rate']:.3f} of candidates; saved to {args.out}")


def cmd_eval_classifier(args: argparse.Namespace) -> None:
    rep = api.evaluate_classifier(args.classifier, args.labels, target=args.target, draft=args.draft,
                                  dtype=args.dtype, device=args.device, out=args.out, filters=_filters(args))
    config = rep.pop("config")
    if args.json:
        print(json.dumps(rep))
        return
    print("\n".join(summary_lines(rep)))
    at = rep["at_sigma"]
    print(f"at the calibrated sigma {config['sigma']:.4f}: recall {at['recall']:.3f}, "
          f"accepted {at['override_rate']:.3f}")
    for name, auroc in rep["references"].items():
        print(f"reference {name}: AUROC {auroc:.3f}")
    print(f"ROC and PR curves in {rep['plots']}")


def add_filter_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training rows (the authors' filters, the first on unless --keep-unsolvable; the pivot "
                             "rule)")
    g.add_argument("--keep-unsolvable", action="store_true", help="keep candidates with U_rej = 0 (default: drop)")
    g.add_argument("--pivot-max-u-acc", type=float, default=None,
                   help="keep pivots only if U_acc <= this (default off)")
    g.add_argument("--nonpivot-min-u-acc", type=float, default=None,
                   help="keep non-pivots only if U_acc >= this (default off; the authors use 0.8)")
    g.add_argument("--pivot-rule", metavar="MODE:ALPHA", default=None,
                   help="relabel every candidate from its stored U_acc and U_rej by this rule (label's --mode and "
                   "--alpha, e.g. mul:0.8: a pivot takes a fifth of the success rate; default: the files' labels)")


def add_parsers(sub: Any) -> None:
    tr = sub.add_parser("train-classifier", help="train a pivot classifier on a labels file",
                        description="Train a pivot classifier: train/selection/report splits by problem, a small "
                        "lr x weight-decay sweep chosen on selection, sigma calibrated on selection, held-out "
                        "metrics and logistic-regression references on report; beside it, on the same rows, the "
                        "expected-drop head that prices overrides for PAD's --budget.")
    add_model_args(tr)
    tr.add_argument("--labels", type=Path, nargs="+", required=True, help="labels file(s); several are trained on "
                    "as one set (rounds of on-policy labels, in order: a problem stays in one split across them, and "
                    "the first file's problems keep the split they get when it is trained on alone)")
    tr.add_argument("--out", type=Path, required=True, help="classifier directory (refused if it holds one, "
                    "unless --overwrite)")
    tr.add_argument("--overwrite", action="store_true", help="replace the classifier in --out")
    tr.add_argument("--type", choices=api.CLASSIFIER_TYPES, default="extended_v2", help="(default extended_v2)")
    tr.add_argument("--layer", type=int, default=-8,
                    help="target layer in HF hidden_states indexing: -8 = 7 blocks below the top (default -8)")
    tr.add_argument("--target-recall", type=float, default=0.95,
                    help="sigma = largest with selection pivot recall >= this (default 0.95)")
    tr.add_argument("--epochs", type=int, default=2000, help="most epochs per sweep run (default 2000)")
    tr.add_argument("--seed", type=int, default=0, help="weights and training seed (default 0)")
    tr.add_argument("--split-seed", type=int, default=0, help="seed of the by-problem splits (default 0)")
    tr.add_argument("--compare-types", action="store_true",
                    help="also train every other classifier type on the same splits and report them")
    add_filter_args(tr)
    tr.set_defaults(func=cmd_train_classifier)

    ev = sub.add_parser("eval-classifier", help="AUROC, PR-AUC, P/R/F1 per threshold, references, ROC/PR plots")
    ev.add_argument("--classifier", type=Path, required=True)
    ev.add_argument("--labels", type=Path, required=True)
    ev.add_argument("--target", help="default: the target the classifier was trained for")
    ev.add_argument("--draft", help="needed for 'extended' classifiers")
    ev.add_argument("--dtype", default=None, help="auto, float32, bfloat16, float16 or int8 (default: as for decoding: "
                    "bfloat16 on CUDA, auto on a CPU)")
    ev.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    ev.add_argument("--out", type=Path, help="where to write roc.png and pr.png (default: LABELS.eval-CLASSIFIER "
                    "next to the labels file)")
    ev.add_argument("--json", action="store_true")
    add_filter_args(ev)
    ev.set_defaults(func=cmd_eval_classifier)
