"""Which target layer and classifier type tell pivots apart on a labels file: cross-validated AUROC.

    python benchmarks/classifier_cv.py --pair testbed-hard --labels labels/testbed_hard_validation.jsonl \
        --layers=-1,-4,-8,-12,-16 --types extended_v2,mlp --folds 5

`train-classifier` reports AUROC on one held-out split of whole problems; with a few hundred candidates that
split holds a dozen or two pivots and its AUROC moves by several points with the split seed. This script
scores every candidate once, out of fold: problems go to K folds; for each fold a classifier is trained on
the other folds exactly as `train-classifier` trains one (the same lr x weight-decay sweep, the same
training filters, a selection split of the training problems for early stopping and the sweep) and scores
the held-out fold. It prints pooled out-of-fold AUROC and the mean and spread over folds for every (layer,
type) and for the p(d)-only and [entropy, p(d)] logistic references, and writes JSON. With the training
filters (`--nonpivot-min-u-acc`, `--pivot-max-u-acc`) only the rows they keep train, and every candidate
with U_rej > 0 is still scored. Features come from
`pivotspec.features.extract` (the function the decoder's inputs are checked against) and are cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pivotspec import api
from pivotspec.classifier import features, metrics
from pivotspec.classifier import model as clf
from pivotspec.classifier.training import Filters, fit_with_sweep, inputs, read_label_files
from pivotspec.cli.classifier import add_filter_args
from pivotspec.decoding.models import PAIRS
from pivotspec.evaluation.reports import fmt


def fold_of(groups: torch.Tensor, folds: int, seed: int) -> torch.Tensor:
    """Per row its fold; whole problems go to one fold."""
    ids = torch.unique(groups)
    perm = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))]
    fold = torch.empty_like(groups)
    for k in range(folds):
        fold[torch.isin(groups, perm[k::folds])] = k
    return fold


def out_of_fold(feats: dict[str, torch.Tensor], fold: torch.Tensor, folds: int, kinds: list[str], epochs: int,
                seed: int, trainable: torch.Tensor) -> dict[str, torch.Tensor]:
    """Out-of-fold pivot scores of every kind and of the logistic references. Only ``trainable`` rows (the
    training filters) train and select; every held-out row is scored, so filters are judged on all
    candidates, not on the easier ones they keep."""
    y = feats["labels"]
    scores = {k: torch.full((len(y),), float("nan")) for k in [*kinds, *clf.REFERENCES]}
    for k in range(folds):
        held, rest = fold == k, (fold != k) & trainable
        # Train/selection inside the training folds, split by problem like train-classifier's 60/20.
        inner = features.split_by_problem(feats["group"][rest], fractions=(0.25, 0.0), seed=seed + k)
        inner[inner == 2] = 0  # split_by_problem keeps one problem for its report split: train on it
        split = torch.full_like(y, 2)  # 2 = held out: neither trains nor selects
        split[rest] = inner
        for kind in kinds:
            net, _ = fit_with_sweep(kind, feats, split, epochs=epochs, seed=seed)
            scores[kind][held] = clf.pivot_scores(net, *inputs(kind, feats, held))
        for name, cols in clf.REFERENCES.items():
            ref = {"columns": cols, **clf.fit_logistic(feats["scalars"][rest][:, cols], y[rest])}
            scores[name][held] = clf.logistic_scores(ref, feats["scalars"][held][:, cols])
    return scores


def summarise(scores: dict[str, torch.Tensor], y: torch.Tensor, fold: torch.Tensor, folds: int,
              number: torch.Tensor) -> dict[str, dict]:
    """Pooled and per-fold AUROC, and pooled AUROC within number tokens and within word tokens (d with and
    without a digit): on arithmetic tasks the two kinds of pivots (a wrong result, a wrong word) differ."""
    out = {}
    for name, s in scores.items():
        per_fold = [metrics.auroc(s[fold == k], y[fold == k]) for k in range(folds)
                    if 0 < int(y[fold == k].sum()) < int((fold == k).sum())]
        out[name] = {"pooled_auroc": metrics.auroc(s, y), "fold_mean": statistics.mean(per_fold),
                     "fold_sd": statistics.stdev(per_fold) if len(per_fold) > 1 else 0.0, "folds": per_fold,
                     **{f"{kind}_auroc": metrics.auroc(s[m], y[m]) if 0 < int(y[m].sum()) < int(m.sum()) else None
                        for kind, m in (("number", number), ("word", ~number))}}
    return out


def paired_difference(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, groups: torch.Tensor, seed: int,
                      resamples: int = 1000) -> dict:
    """Pooled out-of-fold AUROC of ``a`` minus ``b`` on the same rows, with a 95% percentile interval from
    resampling whole problems (rows of one problem are not independent)."""
    ids = torch.unique(groups)
    rows = [torch.nonzero(groups == i).flatten() for i in ids]
    gen = torch.Generator().manual_seed(seed)
    diffs = []
    for _ in range(resamples):
        pick = torch.cat([rows[i] for i in torch.randint(0, len(ids), (len(ids),), generator=gen).tolist()])
        if 0 < int(y[pick].sum()) < len(pick):
            diffs.append(metrics.auroc(a[pick], y[pick]) - metrics.auroc(b[pick], y[pick]))
    diffs.sort()
    return {"diff": metrics.auroc(a, y) - metrics.auroc(b, y), "resamples": len(diffs),
            "ci95": [diffs[int(0.025 * len(diffs))], diffs[min(len(diffs) - 1, int(0.975 * len(diffs)))]]}


def is_number(tokenizer, records: list[dict]) -> torch.Tensor:
    """Per candidate (in ``features.candidates`` order): does the draft token d hold a digit?"""
    return torch.tensor([any(ch.isdigit() for ch in tokenizer.decode([r["d"]])) for r in features.candidates(records)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="testbed", choices=sorted(PAIRS))
    ap.add_argument("--labels", type=Path, nargs="+", required=True,
                    help="labels file(s); several (rounds) are one set, a problem in one fold across them")
    ap.add_argument("--layers", default="-8", help="comma-separated hidden_states indices (default -8)")
    ap.add_argument("--types", default="extended_v2,mlp", help=f"classifier types, from {', '.join(clf.TYPES)}")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="float32 (default, as the stored runs), bfloat16 or auto")
    ap.add_argument("--out", type=Path, help="JSON (default benchmarks/results/classifier_cv-<labels stems>.json)")
    add_filter_args(ap)
    args = ap.parse_args()
    # Scored: every candidate (with U_rej > 0 unless --keep-unsolvable); trained on: those the filters keep.
    train_filters = Filters(pivot_max_u_acc=args.pivot_max_u_acc, nonpivot_min_u_acc=args.nonpivot_min_u_acc)
    kinds = args.types.split(",")
    if "extended" in kinds:
        raise SystemExit("classifier_cv: 'extended' needs draft scalars; compare extended_v2, mlp and linear")
    target = api.load_pair(pair=args.pair, threads=args.threads, dtype=args.dtype).target
    records, key = read_label_files(args.labels if len(args.labels) > 1 else args.labels[0], target)
    stems = "+".join(f.stem for f in args.labels)
    out = args.out or Path("benchmarks/results") / f"classifier_cv-{stems}.json"
    result = {"labels": [str(f) for f in args.labels], "folds": args.folds, "seed": args.seed,
              "train_filters": {"pivot_max_u_acc": args.pivot_max_u_acc, "nonpivot_min_u_acc": args.nonpivot_min_u_acc},
              "layers": {}}
    for layer in [int(x) for x in args.layers.split(",")]:
        t0 = time.perf_counter()
        feats = features.extract(target, records, target.resolve_layer(layer), cache_key=key)
        keep = Filters(drop_unsolvable=not args.keep_unsolvable).mask(feats)
        feats = {k: v[keep] for k, v in feats.items()}
        number = is_number(target.tokenizer, records)[keep]
        y = feats["labels"]
        fold = fold_of(feats["group"], args.folds, args.seed)
        scores = out_of_fold(feats, fold, args.folds, kinds, args.epochs, args.seed, train_filters.mask(feats))
        summary = summarise(scores, y, fold, args.folds, number)
        if not result["layers"]:
            result.update(candidates=len(y), pivots=int(y.sum()), problems=len(torch.unique(feats["group"])),
                          number_candidates=int(number.sum()), number_pivots=int(y[number].sum()))
            print(f"{result['candidates']} candidates ({result['pivots']} pivots) from {result['problems']} problems "
                  f"scored; {args.folds}-fold cross-validation by problem; trained with "
                  f"{result['train_filters']}; d is a number token for {result['number_candidates']} of them "
                  f"({result['number_pivots']} pivots)")
            print("| layer | classifier | out-of-fold AUROC (pooled) | per fold: mean +- sd | within number tokens | "
                  "within word tokens |\n|---|---|---|---|---|---|")
        paired = {k: paired_difference(scores[k], scores[kinds[0]], y, feats["group"], args.seed) for k in kinds[1:]}
        result["layers"][layer] = {**summary, "paired_vs_" + kinds[0]: paired, "seconds": time.perf_counter() - t0}
        for name, s in summary.items():
            within = " | ".join(fmt(s[f"{k}_auroc"], ".3f") for k in ("number", "word"))
            print(f"| {layer} | {name} | {s['pooled_auroc']:.3f} | {s['fold_mean']:.3f} +- {s['fold_sd']:.3f} | "
                  f"{within} |", flush=True)
        for name, d in paired.items():
            print(f"layer {layer}: {name} - {kinds[0]} pooled AUROC {d['diff']:+.4f}, 95% interval over problems "
                  f"[{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}] ({d['resamples']} resamples)", flush=True)
        out.write_text(json.dumps(result, indent=1))  # after every layer, so a stopped run keeps what it did


if __name__ == "__main__":
    main()
