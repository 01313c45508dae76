"""Labels files after labeling: shards of one run (``--shard I/N``), merging them, and their statistics
(``pivotspec labels stats``)."""

from __future__ import annotations

from pathlib import Path

from pivotspec.errors import UsageError
from pivotspec.labels.identity import identity_diff
from pivotspec.labels.walk import is_pivot
from pivotspec.store import exists, read_records


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UsageError(f"--shard must look like I/N (e.g. 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise UsageError(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return i, n


def in_shard(position: int, shard: tuple[int, int] | None) -> bool:
    """Whether the problem at ``position`` of a run's problem list belongs to shard (I, N): round robin,
    so N workers get equal shares and together cover every problem exactly once. A task's problem list is
    deterministic for a seed and only grows with ``n_problems``, so a problem keeps its shard when a
    later run asks for more problems. (A hash of the problem id, tried first, left all 4 problems of a
    small run in one of 2 shards.)"""
    return shard is None or position % shard[1] == shard[0]


def merge_labels(out: Path, inputs: list[Path], overwrite: bool = False) -> dict[str, int]:
    """Join labels files (e.g. one per shard) into ``out``: records de-duplicated by (problem, step) for
    candidates and by problem for summaries; files made with another task, label config or models are
    refused. ``out`` is written whole to a temporary file and renamed, so a failed merge leaves nothing."""
    import json
    import os

    if out.exists() and not overwrite:
        raise UsageError(f"{out} exists: pass --overwrite to replace it, or choose another output")
    identity, source, seen, merged = None, None, set(), []
    for path in inputs:
        if not exists(Path(path)):
            raise UsageError(f"labels file {str(path)!r} does not exist: check the path")
        records = read_records(Path(path), repair=False)
        for rec in records:
            if identity is None:
                identity, source = rec, path
            elif diff := identity_diff(rec, identity):
                raise UsageError(f"{path} was made with a different {', '.join(diff)} than {source}: merge only "
                                 "shards of one labeling run")
            key = (rec.get("type"), rec["problem_id"], rec.get("step"))
            if key not in seen:
                seen.add(key)
                merged.append(rec)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in merged)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(out)
    return {"records": len(merged), "candidates": sum(r.get("type") == "candidate" for r in merged),
            "problems": sum(r.get("type") == "problem" for r in merged)}


def label_stats(records: list[dict]) -> dict:
    """Counts, pivot share, U_acc/U_rej distributions and candidates per problem."""
    cands = [r for r in records if r.get("type") == "candidate"]
    probs = [r for r in records if r.get("type") == "problem"]
    per_problem: dict[str, int] = {}
    for r in cands:
        per_problem[r["problem_id"]] = per_problem.get(r["problem_id"], 0) + 1
    bins = [i / 10 for i in range(11)]

    def histogram(values: list[float]) -> list[int]:
        counts = [0] * 10
        for v in values:
            counts[min(int(v * 10), 9)] += 1
        return counts

    pivots = sum(r["label"] for r in cands)
    counts = list(per_problem.values())
    timed = [r for r in cands if "rollout_s" in r]  # records written before this field existed lack it
    rollout_s = sum(r["rollout_s"] for r in timed)
    return {
        "candidates": len(cands),
        "pivots": pivots,
        "pivot_share": pivots / len(cands) if cands else None,
        "problems_done": sum(p.get("status") == "done" for p in probs),
        "problems_skipped": sum(p.get("status") == "skipped" for p in probs),
        "candidates_per_problem": {"mean": sum(counts) / len(counts) if counts else 0,
                                   "min": min(counts, default=0), "max": max(counts, default=0)},
        "u_acc_hist": histogram([r["u_acc"] for r in cands]),
        "u_rej_hist": histogram([r["u_rej"] for r in cands]),
        "hist_bins": bins,
        "rollouts": sum(r["n_rollouts"] for r in cands),
        "judge_flipped": sum(bool(r.get("judge_flipped")) for r in cands),
        "rollout_s": rollout_s,
        "rollouts_per_s": sum(r["n_rollouts"] for r in timed) / rollout_s if rollout_s > 0 else None,
        "rule_sweep": rule_sweep(cands),
    }


RULES = [("mul", a) for a in (0.3, 0.5, 0.7)] + [("add", a) for a in (0.1, 0.3, 0.5)] + \
    [("abs", a) for a in (0.3, 0.5, 0.7)]


def rule_sweep(cands: list[dict]) -> list[dict]:
    """The pivot share each labeling rule would give on these candidates' stored U_acc / U_rej: choosing
    a rule needs no new rollouts. (With ``follow=label`` the walk itself followed the run's rule, so the
    candidates are those that rule's walk met.)"""
    return [{"mode": mode, "alpha": alpha,
             "pivot_share": sum(is_pivot(r["u_acc"], r["u_rej"], mode, alpha) for r in cands) / len(cands)
             if cands else None} for mode, alpha in RULES]
