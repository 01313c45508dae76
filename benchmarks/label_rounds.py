"""Rounds of on-policy labels (issue 30): round 0 is a labels file and the classifier trained on it; round k+1
labels under PAD with round k's classifier (at --policy-sigma, or that classifier's calibrated sigma) and trains
two classifiers of round 0's type, layer and target recall: on the union of every round so far (the one the
next round labels with) and on the latest round alone (measured beside it).

    python benchmarks/label_rounds.py --pair testbed-hard --rounds 1 --dir runs/rounds \
        --labels0 labels/testbed_hard_validation.jsonl --classifier0 src/pivotspec/testbed/data/hard/classifier \
        --policy-sigma 0.2 --split validation --n-problems 400 --rollouts 10 --max-rollout-tokens 120 --concurrency 4

Everything is resumable: a rerun continues the last round's labels where they stopped and keeps classifiers
already trained. Writes DIR/round{k}/labels.jsonl, DIR/round{k}/classifier-union/, DIR/round{k}/classifier-latest/
and DIR/rounds.json (per round: candidates, pivot share, share of candidates the policy kept, and each
classifier's report AUROC).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def train(pair, labels: list[Path], out: Path, epochs: int, like: dict) -> float | str:
    """A classifier of round 0's type, layer and target recall on ``labels`` (kept if already trained): its
    report AUROC, or why it could not be trained (a round stopped early may hold too few labels)."""
    from pivotspec import api
    from pivotspec.errors import UsageError

    if (out / "classifier.json").is_file():
        return json.loads((out / "classifier.json").read_text())["metrics"]["report"]["auroc"]
    try:
        config = api.train_classifier(pair, labels, out, epochs=epochs, kind=like["type"], layer=like["layer_arg"],
                                      target_recall=like["target_recall"])
    except UsageError as exc:
        return f"not trained: {exc}"
    return config["metrics"]["report"]["auroc"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="testbed-hard")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--labels0", type=Path, required=True, help="round 0's labels file")
    ap.add_argument("--classifier0", required=True, help="round 0's classifier directory")
    ap.add_argument("--policy-sigma", type=float, default=None, help="every round's sigma (default: calibrated)")
    ap.add_argument("--task", default=None)
    ap.add_argument("--split", default="validation")
    ap.add_argument("--n-problems", type=int, default=400)
    ap.add_argument("--rollouts", type=int, default=10)
    ap.add_argument("--max-rollout-tokens", type=int, default=120)
    ap.add_argument("--max-walk-tokens", type=int, default=200)
    ap.add_argument("--min-target-rate", type=float, default=0.3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2000)
    ap.add_argument("--dtype", default="float32", help="float32 (default, as the stored runs), bfloat16 or auto")
    args = ap.parse_args()
    from pivotspec import api

    pair = api.load_pair(args.target, args.draft, pair=None if args.target else args.pair, needs_draft=True,
                          dtype=args.dtype)
    task = api.task_for(args.task, args.pair)
    labels, classifier, rounds = [args.labels0], args.classifier0, []
    like = json.loads((Path(args.classifier0) / "classifier.json").read_text())
    for k in range(1, args.rounds + 1):
        here = args.dir / f"round{k}"
        here.mkdir(parents=True, exist_ok=True)
        records = api.label(pair, here / "labels.jsonl", task=task, split=args.split, n_problems=args.n_problems,
                            rollouts=args.rollouts, max_rollout_tokens=args.max_rollout_tokens,
                            max_walk_tokens=args.max_walk_tokens, min_target_rate=args.min_target_rate,
                            concurrency=args.concurrency, rollout_policy="pad", policy_classifier=str(classifier),
                            policy_sigma=args.policy_sigma)
        labels.append(here / "labels.jsonl")
        union = train(pair, labels, here / "classifier-union", args.epochs, like)
        latest = train(pair, [labels[-1]], here / "classifier-latest", args.epochs, like)
        cands = [r for r in records if r.get("type") == "candidate"]
        rounds.append({"round": k, "policy_classifier": str(classifier), "candidates": len(cands),
                       "pivot_share": sum(r["label"] for r in cands) / max(1, len(cands)),
                       "policy_kept_share": sum(r.get("policy_kept", 0) for r in cands) / max(1, len(cands)),
                       "report_auroc_union": union, "report_auroc_latest": latest})
        if not isinstance(union, float):
            raise SystemExit(f"round {k}: the union classifier was {union}")
        classifier = here / "classifier-union"
        (args.dir / "rounds.json").write_text(json.dumps(rounds, indent=1))
        print(json.dumps(rounds[-1]))


if __name__ == "__main__":
    main()
