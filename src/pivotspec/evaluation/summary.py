"""Summaries of an evaluation's rows: accuracy with a Wilson interval, paired McNemar tests against the
references, tau, eta and speed (ratios of sums, so long completions weigh by their length)."""

from __future__ import annotations

import math
import statistics
from typing import Any


def wilson_ci(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (sane at 0% and 100%, unlike the normal approximation)."""
    if n == 0:
        return (0.0, 1.0)
    phat = successes / n
    denom = 1 + z * z / n
    centre = (phat + z * z / (2 * n)) / denom
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]] if values else [float("nan")] * 2
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: of the b + c problems where exactly one of two methods is right,
    is the split b : c more uneven than a fair coin's?"""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_comparison(rows: list[dict[str, Any]], method: str, reference: str) -> dict[str, Any] | None:
    """Accuracy of ``method`` against ``reference`` on the problems both ran: the difference, the
    discordant counts (b: only method right, c: only reference right) and the exact McNemar p-value."""
    ref = {r["problem_id"]: r["score"] for r in rows if r["method"] == reference}
    mine = {r["problem_id"]: r["score"] for r in rows if r["method"] == method and r["problem_id"] in ref}
    if not mine:
        return None
    b = sum(1 for p, s in mine.items() if s > 0.5 >= ref[p])
    c = sum(1 for p, s in mine.items() if ref[p] > 0.5 >= s)
    diff = (sum(mine.values()) - sum(ref[p] for p in mine)) / len(mine)
    return {"reference": reference, "n": len(mine), "diff": diff, "only_method": b, "only_reference": c,
            "p_mcnemar": mcnemar_exact(b, c)}


def summarize(rows: list[dict[str, Any]], baseline: str = "ar",
              references: tuple[str, ...] = ("ar", "sd")) -> dict[str, dict[str, Any]]:
    """Aggregate rows per method; ratios of sums, so long completions weigh by their length. Each method's
    accuracy is also compared, paired by problem, with each of ``references`` that ran. Rows decoded in
    batches (``batch_size`` > 1 in their stats) get throughput (tokens/s, and ms/token as its inverse) and no
    speedups: their wall times overlap."""
    out: dict[str, dict[str, Any]] = {}
    base_wall = {r["problem_id"]: r["stats"]["wall_s"] for r in rows if r["method"] == baseline}
    for label in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == label]
        n = len(mine)
        tokens = sum(r["stats"]["new_tokens"] for r in mine)
        wall = sum(r["stats"]["wall_s"] for r in mine)
        fwd = sum(r["stats"]["target_forwards"] for r in mine)
        drafted = sum(r["stats"]["drafted"] for r in mine)
        kept = sum(r["stats"]["accepted"] + r["stats"]["override"] for r in mine)
        correct = sum(r["score"] for r in mine)
        # Rows decoded in a batch overlap in time: per-problem speedups mean nothing there, throughput does.
        batched = any(r["stats"].get("batch_size", 1) > 1 for r in rows)
        ratios = [base_wall[r["problem_id"]] / r["stats"]["wall_s"] for r in mine
                  if r["problem_id"] in base_wall and r["stats"]["wall_s"] > 0]
        paired = [r for r in mine if r["problem_id"] in base_wall]
        out[label] = {
            "n": n,
            "accuracy": correct / n,
            "ci95": list(wilson_ci(correct, n)),
            "tau": tokens / fwd if fwd else None,
            "eta": kept / drafted if drafted else None,
            "target_forwards_per_token": fwd / tokens if tokens else None,
            "ms_per_token": 1000 * wall / tokens if tokens else None,
            "wall_s": wall,
            "new_tokens": tokens,
            "speedup": (sum(base_wall[r["problem_id"]] for r in paired) / sum(r["stats"]["wall_s"] for r in paired)
                        if paired and base_wall and not batched else None),
            "speedup_median": statistics.median(ratios) if ratios and not batched else None,
            "speedup_iqr": _quartiles(ratios) if ratios and not batched else None,
            "paired": {ref: paired_comparison(rows, label, ref) for ref in references if ref != label
                       and any(r["method"] == ref for r in rows)},
        }
        if batched:
            pass_s = sum(r["stats"].get("batch_share_s", r["stats"]["wall_s"]) for r in mine)
            out[label].update(batch_size=max(r["stats"].get("batch_size", 1) for r in mine),
                              tokens_per_s=tokens / pass_s if pass_s else None,
                              ms_per_token=1000 * pass_s / tokens if tokens else None)
    return out
