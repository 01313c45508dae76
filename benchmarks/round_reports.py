"""Classifiers of several labeling rounds scored on one yardstick: round 0's held-out problems.

    python benchmarks/round_reports.py --pair testbed-hard \
        --classifier r0=benchmarks/results/rounds/r0 --classifier r1-union-400=benchmarks/results/rounds/r1-union-400

Each classifier's own report AUROC is measured on its own report split, which differs between rounds (other
files, other problems, harder rows), so those numbers do not compare across rounds. This script scores every
classifier on round 0's candidates (``--base``, the shipped labels file) of the problems that are held out for
all of them: in round 0's report split and in each classifier's own report split (the splits group by problem;
a union classifier trained before the ``by_round`` split drew its split as another permutation, so some of
round 0's report problems trained it, and those are left out; one trained since holds them all out). It prints
AUROC and PR-AUC per classifier beside the p(d)-only logistic reference, and how many of round 0's report
problems each classifier trained on, and writes JSON. Features come from ``features.extract`` (cached by the
training runs; float32 unless ``--dtype``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from pivotspec import api
from pivotspec.classifier import features, metrics
from pivotspec.classifier import model as clf
from pivotspec.classifier.training import BY_PROBLEM, Filters, inputs, read_label_files, reference_reports, split_rows

LABELS_DIR = Path("labels")


def problem_ids(records: list[dict]) -> list[str]:
    """Problem id of each ``group`` index that ``features.extract`` gives these records' candidates."""
    return list(dict.fromkeys(r["problem_id"] for r in features.candidates(records)))


def held_out(label_files: list[Path], config: dict, target: Any) -> tuple[set[str], dict, list[dict]]:
    """Problem ids in the report split that training with ``config`` made from ``label_files``; and the
    features (filtered) and records, as training saw them."""
    records, key = read_label_files(label_files if len(label_files) > 1 else label_files[0], target)
    feats = features.extract(target, records, config["layer"], cache_key=key)
    keep = Filters(**config["filters"]).mask(feats)
    feats = {k: v[keep] for k, v in feats.items()}
    split = split_rows(records, feats, keep, config.get("split_seed", 0), config.get("split", BY_PROBLEM))
    ids = problem_ids(records)
    return {ids[g] for g in torch.unique(feats["group"][split == 2]).tolist()}, feats, records


def files_of(config: dict, name: str) -> list[Path]:
    """The labels files a classifier was trained on, refused if any has changed since (a round's file that
    grew: its split and features would not be the ones training saw)."""
    labels = config["labels"]
    files = [LABELS_DIR / f for f in labels.get("files", [labels.get("file")])]
    trained = labels["sha256_16"] if isinstance(labels["sha256_16"], list) else labels["sha256_16"].split("+")
    changed = [f.name for f, h in zip(files, trained, strict=True) if features.file_hash(f) != h]
    if changed:
        raise SystemExit(f"{name}: {', '.join(changed)} changed since it was trained (it grew or was relabeled): "
                         "leave that classifier out or retrain it")
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="testbed-hard")
    ap.add_argument("--classifier", action="append", required=True, help="NAME=DIR, repeatable")
    ap.add_argument("--base", type=Path, default=Path("labels/testbed_hard_validation.jsonl"),
                    help="round 0's labels file, whose held-out problems every classifier is scored on")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/round_reports.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = api.load_pair(pair=args.pair, dtype=args.dtype).target
    named = dict(item.split("=", 1) for item in args.classifier)
    loaded = {name: clf.load(Path(d)) for name, d in named.items()}
    base_config = next(iter(loaded.values()))[1]
    # Round 0's candidates are featurized once, at the first classifier's layer and filtered by its filters:
    # a classifier reading another layer would be scored on hidden states it was not trained on.
    other = [name for name, (_, cfg) in loaded.items()
             if (cfg["layer"], cfg["filters"]) != (base_config["layer"], base_config["filters"])]
    if other:
        raise SystemExit(f"{', '.join(other)}: another layer or other training filters than "
                         f"{next(iter(loaded))}'s; compare classifiers of one layer and one set of filters")
    base_held, base_feats, base_records = held_out([args.base], base_config, target)
    own = {name: held_out(files_of(cfg, name), cfg, target)[0] for name, (_, cfg) in loaded.items()}
    common = base_held.intersection(*own.values())
    ids = problem_ids(base_records)
    rows = torch.tensor([ids[g] in common for g in base_feats["group"].tolist()])
    y = base_feats["labels"][rows]
    result = {"base": str(args.base), "base_report_problems": len(base_held), "common_problems": len(common),
              "rows": int(rows.sum()), "pivots": int(y.sum()), "classifiers": {}}
    print(f"round 0's report split: {len(base_held)} problems; held out for every classifier: {len(common)} "
          f"problems, {int(rows.sum())} candidates, {int(y.sum())} pivots")
    w = max(len("classifier"), *map(len, loaded))
    print(f"{'classifier':{w}} {'AUROC':>6} {'PR-AUC':>7} {'p(d) AUROC':>11} {'trained on of them':>19}")
    for name, (net, cfg) in loaded.items():
        rep = metrics.report(clf.pivot_scores(net, *inputs(cfg["type"], base_feats, rows)), y)
        refs = {k: {"columns": r["columns"], **r["model"]} for k, r in cfg.get("references", {}).items()}
        p_d = reference_reports({"logreg_p": refs["logreg_p"]}, base_feats, rows)["logreg_p"]["auroc"]
        trained = len(base_held - own[name])
        result["classifiers"][name] = {"dir": named[name], "auroc": rep["auroc"], "pr_auc": rep["pr_auc"],
                                       "p_d_auroc": p_d, "base_report_problems_trained_on": trained,
                                       "own_report_auroc": cfg["metrics"]["report"]["auroc"]}
        print(f"{name:{w}} {rep['auroc']:6.3f} {rep['pr_auc']:7.3f} {p_d:11.3f} {trained:19}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
