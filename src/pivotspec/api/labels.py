"""The API's labeling: pivot labels by rollouts (target-only or under a PAD policy), on Ray, their files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pivotspec.api.decoding import make_policy
from pivotspec.api.pairs import Pair, default_classifier, get_task, load_pair, resolve_names
from pivotspec.classifier.training import probability_properties
from pivotspec.decoding.acceptance import DEFAULT_P_FLOOR
from pivotspec.decoding.models import load_lm
from pivotspec.errors import UsageError
from pivotspec.evaluation import runs
from pivotspec.labels import cluster, files
from pivotspec.labels.rollouts import ROLLOUT_GAMMA
from pivotspec.labels.walk import LabelConfig, run_labeling
from pivotspec.store import compressed, exists, open_bytes, read_records


def label_config(**fields: Any) -> LabelConfig:
    """The labeling settings (``labels.walk.LabelConfig``: rollouts, temperature, mode, alpha, ...), checked."""
    return LabelConfig(**fields)


def rollout_policy(pair: Pair | None, fields: dict[str, Any],
                   pair_name: str | None = None) -> tuple[dict[str, Any], Any]:
    """Split ``label``'s keywords into the config's fields and the policy that rollouts and walk follow with
    ``rollout_policy="pad"`` (``policy_classifier``, default the pair's shipped one, and ``policy_sigma``,
    default its calibrated sigma). The config names the policy by sigma, floor, gamma and the classifier
    files' fingerprint, so files labeled under two policies never resume or merge into each other.
    ``follow`` defaults to "policy" then, else "label". With ``pair=None`` only the arguments are checked."""
    fields = dict(fields)
    clf, sigma = fields.pop("policy_classifier", None), fields.pop("policy_sigma", None)
    pad = fields.get("rollout_policy", "target") == "pad"
    if fields.get("follow") is None:
        fields["follow"] = "policy" if pad else "label"
    if not pad:
        if clf is not None or sigma is not None:
            raise UsageError("--policy-classifier and --policy-sigma go with --rollout-policy pad")
        return fields, None
    name = pair.name if pair is not None else pair_name
    clf = str(clf or default_classifier(name) or "")
    if not clf:
        raise UsageError("--rollout-policy pad needs a classifier: pass --policy-classifier DIR (this pair ships none)")
    policy = make_policy(pair, "pad", classifier=clf, sigma=sigma, pair_name=name)
    shown = f"{policy.sigma:g}" if policy is not None else (f"{sigma:g}" if sigma is not None else "?")
    floor = policy.p_floor if policy is not None else DEFAULT_P_FLOOR
    # The classifier by its directory's name and its files' hash, not its path: the same shipped classifier
    # sits in a checkout on one machine and in site-packages on another, and a labels run must resume on both.
    named = runs.classifier_files_fingerprint(clf).replace(clf, Path(clf).name, 1)
    fields["policy"] = f"pad(sigma={shown},p_floor={floor:g},gamma={ROLLOUT_GAMMA}) {named}"
    return fields, policy


def check_label(*, task: str = "arith", split: str = "train", n_problems: int = 50, overwrite: bool = False,
                judge: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                shard: str | tuple[int, int] | None = None, concurrency: int = 1, pair_name: str | None = None,
                **fields: Any) -> tuple[int, int] | None:
    """``label``'s arguments, before any model loads (``pair_name``: where a pad rollout policy finds its
    shipped classifier); returns the shard as (i, n) (``"I/N"`` accepted)."""
    label_config(**rollout_policy(None, fields, pair_name)[0])
    if n_problems < 1:
        raise UsageError(f"--n-problems must be >= 1, got {n_problems}")
    if concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {concurrency}")
    get_task(task)
    return files.parse_shard(shard) if isinstance(shard, str) else shard


def label(pair: Pair, out: str | Path, *, task: str = "arith", split: str = "train", n_problems: int = 50,
          overwrite: bool = False, judge: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
          shard: str | tuple[int, int] | None = None, concurrency: int = 1,
          **fields: Any) -> list[dict[str, Any]]:
    """Pivot labels by target rollouts into the JSONL file ``out`` (resumable); ``fields``: those of
    ``label_config`` (rollouts, temperature, mode, alpha, ...); ``shard=(i, n)`` or ``"I/N"`` labels only the
    problems of shard i of n (join the files with ``merge_labels``); ``concurrency``: problems walked side by
    side, their rollouts batched together (faster; 1 reproduces bit for bit whatever the sharding). Returns
    all records."""
    shard = check_label(task=task, split=split, n_problems=n_problems, concurrency=concurrency, shard=shard,
                        pair_name=pair.name, **fields)
    if pair.draft is None:
        raise UsageError("labeling needs a draft model: load the pair with a draft")
    t = get_task(task)
    fields, policy = rollout_policy(pair, fields)
    cfg = label_config(**fields)
    problems = [p for i, p in enumerate(t.problems(split, n_problems, cfg.seed)) if files.in_shard(i, shard)]
    judge_lm = load_lm(judge) if judge else None
    return run_labeling(pair.target, pair.draft, t, problems, cfg, Path(out), overwrite=overwrite, judge=judge_lm,
                        split=split, chat_template_kwargs=chat_template_kwargs, concurrency=concurrency,
                        policy=policy)


def labels_dtype(path: str | Path) -> str | None:
    """The dtype a labels file's target computed in (None: no file yet, or not a labels file). A resumed run
    must compute in it, or its rollouts would not be the ones the file holds (``identity.identity_diff``), so
    ``pivotspec label`` takes it when ``--dtype`` is not given: auto may choose another dtype on another CPU."""
    if not exists(Path(path)):
        return None
    with open_bytes(Path(path)) as fh:
        first = fh.readline()
    try:
        target = json.loads(first).get("target")
    except (ValueError, AttributeError):
        return None
    return target.get("dtype", "float32") if isinstance(target, dict) else None


def _label_shard(pair_args: dict[str, Any], out: str, shard: tuple[int, int], label_args: dict[str, Any]) -> int:
    """One shard, in a Ray worker: load the pair there (models do not travel), label, count candidates."""
    pair = load_pair(**pair_args, needs_draft=True)
    records = label(pair, out, shard=shard, **label_args)
    return sum(r.get("type") == "candidate" for r in records)


def label_on_ray(out: str | Path, *, target: str | None = None, draft: str | None = None, pair: str | None = None,
                 dtype: str | None = None, device: str | None = None, threads: int | None = None, workers: int = 2,
                 address: str | None = None, overwrite: bool = False, **label_args: Any) -> dict[str, int]:
    """``label`` spread over a Ray cluster (``address``, or a local one): ``workers`` shards, each a Ray task
    that loads the pair itself and resumes from its shard file; merged into ``out`` at the end. Takes model
    names, not a loaded pair, because the models are loaded where the tasks run. Returns the merge counts."""
    resolve_names(target, draft, pair, needs_draft=True)  # unknown names fail here, not in every worker
    if label_args.pop("shard", None) is not None:
        raise UsageError("--ray makes its own shards: drop --shard (or run one shard per machine without --ray)")
    check_label(pair_name=pair, **label_args)
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    out = Path(out)
    if overwrite:
        for path in [out, compressed(out)] + [cluster.shard_path(out, i, workers) for i in range(workers)]:
            path.unlink(missing_ok=True)
    pair_args = dict(target=target, draft=draft, pair=pair, dtype=dtype, device=device, threads=threads)
    return cluster.label_on_ray(_label_shard, pair_args, out, workers, label_args, address=address)


def labels_stats(path: str | Path, *, pair: str | None = None, target: str | None = None,
                 classifier: str | Path | None = None, device: str | None = None) -> dict[str, Any]:
    """Counts, pivot share, U distributions and candidates per problem of a labels file; with a target
    (``pair`` or ``target``) also how well p(d) alone, and ``classifier``, separate pivots (key ``p_d``)."""
    path = Path(path)
    if not exists(path):
        raise UsageError(f"labels file {str(path)!r} does not exist: check the path")
    if classifier is not None and not (pair or target):
        raise UsageError("--classifier needs the target: pass --pair or --target")
    stats = files.label_stats(read_records(path, repair=False))
    if pair or target:
        lm = load_pair(target, pair=pair, device=device).target
        stats["p_d"] = probability_properties(path, lm, Path(classifier) if classifier else None)
    return stats


def merge_labels(out: str | Path, inputs: list[str | Path], overwrite: bool = False) -> dict[str, int]:
    """Join labels files of one run (e.g. shards) into ``out``, de-duplicated; returns the counts."""
    return files.merge_labels(Path(out), [Path(i) for i in inputs], overwrite)


def count_labels(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Candidates, pivots and problems done or skipped among a labeling run's records."""
    return files.label_stats(records)
