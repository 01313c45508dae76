"""The expected utility drop of keeping a draft token: a second head on the pivot classifier's inputs (issue 30).

A pivot label says only whether keeping d costs more than a threshold. A harm that is small per token can stay
under any per-token threshold and still add up over the 3-12 overrides of one answer; pricing it needs how much
utility a kept d costs. Each labeled candidate stores U_acc (rollouts after d) and U_rej (rollouts after the
target's token t); the head regresses max(0, U_rej - U_acc), in [0, 1], from the same inputs as the pivot
classifier (``model.model_inputs``), trained on the same rows and splits with the same architecture.
Gains (U_acc > U_rej) count as no drop: a budget is a bound on harm, and crediting a noisy gain back would let
it spend more than it should.

The head is stored beside the classifier (``drop.safetensors``, and a ``drop`` block in classifier.json) and
read by PAD's per-answer budget (``acceptance.Budget``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pivotspec.classifier import metrics
from pivotspec.classifier import model as clf
from pivotspec.errors import UsageError

WEIGHTS = "drop.safetensors"


def drop_targets(feats: dict[str, torch.Tensor]) -> torch.Tensor:
    """[n] max(0, U_rej - U_acc) per candidate: the utility lost by keeping d instead of t."""
    return (feats["u_rej"] - feats["u_acc"]).clamp(0.0, 1.0)


def _soft_bce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Cross-entropy against a target in [0, 1]: minimised by sigmoid(out) = E[y | inputs], a calibrated mean.
    return nn.functional.binary_cross_entropy_with_logits(out[:, 0], y)


def predicted_drops(net: clf.PivotNet, h: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """[n] the head's expected drop for each row of inputs."""
    with torch.no_grad():
        return torch.sigmoid(net(h, s)[:, 0])


def train_drop(kind: str, train_x: tuple, train_y: torch.Tensor, val_x: tuple, val_y: torch.Tensor, *, lr: float,
               weight_decay: float, epochs: int, seed: int) -> tuple[clf.PivotNet, dict[str, Any]]:
    """A drop head of ``kind`` trained on (inputs, drop) rows, early-stopped on the selection rows."""
    return clf.train(kind, train_x[0].shape[1], train_x, train_y, val_x, val_y, lr=lr, epochs=epochs,
                     weight_decay=weight_decay, seed=seed, loss=_soft_bce, outputs=1)


def report(pred: torch.Tensor, drop: torch.Tensor, labels: torch.Tensor, train_mean: float) -> dict[str, Any]:
    """How well ``pred`` prices held-out drops: mean squared error against predicting the training mean, the
    correlation, and the AUROC of the predicted drop for the pivot labels (a drop that ranks pivots too)."""
    mse = float(((pred - drop) ** 2).mean())
    baseline = float(((train_mean - drop) ** 2).mean())
    corr = float(torch.corrcoef(torch.stack([pred, drop]))[0, 1]) if len(drop) > 1 and drop.std() > 0 else None
    return {"rows": len(drop), "mse": mse, "mse_train_mean": baseline, "pearson": corr,
            "mean_drop": float(drop.mean()), "mean_predicted": float(pred.mean()),
            "pivot_auroc": metrics.auroc(pred, labels) if 0 < int(labels.sum()) < len(labels) else None}


def save(path: Path, net: clf.PivotNet) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path / WEIGHTS))


def load(path: Path, config: dict[str, Any]) -> clf.PivotNet:
    """The drop head stored with the classifier at ``path`` (whose config has been read and checked)."""
    from safetensors.torch import load_file

    if "drop" not in config or not (Path(path) / WEIGHTS).is_file():
        raise UsageError(f"classifier {path} has no drop head (needed by a PAD budget): train it again with this "
                         "version of `pivotspec train-classifier`")
    net = clf.PivotNet(config["type"], config["d_model"], outputs=1)
    try:
        net.load_state_dict(load_file(str(Path(path) / WEIGHTS)))
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise UsageError(f"{path}/{WEIGHTS} is damaged ({type(exc).__name__}): train the classifier again") from None
    return net.eval()


def as_policy_drop(net: clf.PivotNet) -> Callable[[Any], torch.Tensor]:
    """The budget's price per draft token: reads a verification step like the pivot classifier does."""

    def price(v: Any) -> torch.Tensor:
        h, s = clf.model_inputs(net.kind, v.hidden, v.p_raw, v.draft_tokens, lambda: v.q_raw)
        return predicted_drops(net, h, s)

    return price

