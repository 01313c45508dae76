"""Labeling spread over a Ray cluster: one Ray task per shard, each resuming from its own file.

The problems are dealt round robin into N shards (``label_files.in_shard``); shard i is labeled by a
Ray task into ``<out stem>.shard<i>of<N>.jsonl`` beside ``out``, with the very code a single process runs
(the caller's ``label_shard``: ``api.label`` on a pair loaded in the worker), so a shard file is an ordinary
resumable labels file. A task whose worker dies is retried
by Ray and resumes from its file; when all shards are done they are merged into ``out``. Ray is the cluster
layer (scheduling, retries, GPUs): an existing cluster (``address``) or a local one started for the run.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pivotspec.errors import UsageError
from pivotspec.labels.files import merge_labels
from pivotspec.store import restore

# One shard in a Ray worker: (pair arguments, shard file, (i, n), label arguments) -> candidates labeled.
ShardJob = Callable[[dict[str, Any], str, tuple[int, int], dict[str, Any]], int]


def shard_path(out: Path, index: int, n: int) -> Path:
    return out.with_name(f"{out.stem}.shard{index}of{n}{out.suffix or '.jsonl'}")


def count_done(path: Path) -> tuple[int, int]:
    """(problems finished, candidates) in a labels file being written; a torn last line is skipped."""
    problems = candidates = 0
    if not path.is_file():
        return 0, 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            kind = json.loads(line).get("type")
        except json.JSONDecodeError:
            continue
        problems += kind == "problem"
        candidates += kind == "candidate"
    return problems, candidates


def connect(address: str | None, workers: int) -> None:
    """Join the cluster at ``address`` or start a local one with a CPU per worker."""
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'pivotspec[cluster]' (or ./install.sh)") from None
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    except ConnectionError as exc:
        raise UsageError(f"cannot reach the Ray cluster at {address!r} ({exc}): check --ray-address") from None


def label_on_ray(label_shard: ShardJob, pair_args: dict[str, Any], out: Path, workers: int,
                 label_args: dict[str, Any], address: str | None = None, max_retries: int = 3,
                 progress: bool = True) -> dict[str, int]:
    """Label ``label_args["n_problems"]`` problems as ``workers`` shards on Ray and merge them into ``out``.

    Each task takes one CPU, and one GPU when the cluster has GPUs; torch in a CPU task uses one thread
    unless ``pair_args["threads"]`` says otherwise. Shard files stay beside ``out`` (a rerun resumes them);
    ``out`` itself, if it already holds labels of the same run, is merged in rather than replaced."""
    import ray

    out = Path(out)  # workers >= 1 was checked by api.label_on_ray
    restore(out)  # labels kept compressed under this name are merged in below like a plain file's
    shards = [shard_path(out, i, workers) for i in range(workers)]
    connect(address, workers)
    try:
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        pair_args = {**pair_args, "threads": pair_args.get("threads") or (None if gpus else 1)}
        task = ray.remote(num_cpus=1, num_gpus=1 if gpus else 0, max_retries=max_retries,
                          retry_exceptions=False)(label_shard)
        refs = [task.remote(pair_args, str(path), (i, workers), label_args) for i, path in enumerate(shards)]
        total, pending, started = label_args.get("n_problems", 50), refs, time.perf_counter()
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=2.0)
            if progress:
                done = [count_done(p) for p in shards]
                print(f"\rray: {workers} workers | problems {sum(d[0] for d in done)}/{total} | candidates "
                      f"{sum(d[1] for d in done)} | {time.perf_counter() - started:.0f} s   ", end="",
                      file=sys.stderr, flush=True)
        try:
            ray.get(refs)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, UsageError):  # a shard's bad input: its own one-line message
                raise UsageError(str(cause)) from None
            raise
    finally:
        if progress:
            print(file=sys.stderr)
        ray.shutdown()
    inputs = ([out] if out.is_file() else []) + [p for p in shards if p.is_file()]
    return merge_labels(out, inputs, overwrite=True)
