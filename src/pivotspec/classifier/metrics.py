"""Binary-classifier metrics and plots for the pivot classifier (no scikit-learn dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def roc_curve(scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(false positive rate, true positive rate) at every distinct threshold, from (0, 0) to (1, 1)."""
    order = torch.argsort(scores, descending=True)
    s, y = scores[order], labels[order].float()
    tps, fps = torch.cumsum(y, 0), torch.cumsum(1 - y, 0)
    last = torch.cat([s[1:] != s[:-1], torch.tensor([True])])  # one point per distinct score
    tps, fps = tps[last], fps[last]
    tpr = torch.cat([torch.zeros(1), tps / max(float(y.sum()), 1.0)])
    fpr = torch.cat([torch.zeros(1), fps / max(float((1 - y).sum()), 1.0)])
    return fpr, tpr


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    fpr, tpr = roc_curve(scores, labels)
    return float(torch.trapezoid(tpr, fpr))


def pr_curve(scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(recall, precision) at every distinct threshold, highest threshold first."""
    order = torch.argsort(scores, descending=True)
    s, y = scores[order], labels[order].float()
    tps, fps = torch.cumsum(y, 0), torch.cumsum(1 - y, 0)
    last = torch.cat([s[1:] != s[:-1], torch.tensor([True])])
    tps, fps = tps[last], fps[last]
    return tps / max(float(y.sum()), 1.0), tps / (tps + fps)


def average_precision(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """PR-AUC as average precision: sum over thresholds of (recall step) * precision."""
    recall, precision = pr_curve(scores, labels)
    steps = torch.diff(torch.cat([torch.zeros(1), recall]))
    return float((steps * precision).sum())


def at_threshold(scores: torch.Tensor, labels: torch.Tensor, threshold: float) -> dict[str, Any]:
    """Pivot = score > threshold (what PAD rejects at sigma = threshold)."""
    pred, y = scores > threshold, labels.bool()
    tp, fp = int((pred & y).sum()), int((pred & ~y).sum())
    fn, tn = int((~pred & y).sum()), int((~pred & ~y).sum())
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"threshold": threshold, "precision": precision, "recall": recall, "f1": f1,
            "tp": tp, "fp": fp, "fn": fn, "tn": tn, "override_rate": float((~pred).float().mean())}


def report(scores: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    return {
        "n": len(labels), "pivots": int(labels.sum()),
        "auroc": auroc(scores, labels), "pr_auc": average_precision(scores, labels),
        "thresholds": [at_threshold(scores, labels, t / 10) for t in range(1, 10)],
    }


def plot_curves(scores: torch.Tensor, labels: torch.Tensor, out_dir: Path, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fpr, tpr = roc_curve(scores, labels)
    recall, precision = pr_curve(scores, labels)
    for name, (x, y, xl, yl, summary) in {
        "roc.png": (fpr, tpr, "false positive rate", "true positive rate", f"AUROC {auroc(scores, labels):.3f}"),
        "pr.png": (recall, precision, "recall", "precision", f"PR-AUC {average_precision(scores, labels):.3f}"),
    }.items():
        fig, ax = plt.subplots(figsize=(4.5, 4))
        ax.plot(x.numpy(), y.numpy())
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.set_title(f"{title} {summary}".strip())
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths
