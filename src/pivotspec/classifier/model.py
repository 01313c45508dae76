"""The pivot classifier (the PAD paper, arXiv 2511.00351): model types, training, sigma calibration, save
and load.

Inputs are what the verification forward already has at each draft position: the target hidden state at
a chosen layer (default L - 8), the target entropy and p(d), and optionally the draft's entropy and q(d).
Features are standardised with statistics of the training split, stored with the weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pivotspec.decoding.sampling import entropy
from pivotspec.errors import UsageError

TYPES = ("extended_v2", "extended", "context", "mlp", "linear")
# Which hidden-state row a classifier reads; recorded in classifier.json so an old model is refused.
FEATURE_ROW = "draft_token"
WEIGHTS, CONFIG = "classifier.safetensors", "classifier.json"


def n_scalars(kind: str) -> int:
    return {"extended_v2": 2, "extended": 4, "context": 2 + N_CONTEXT}.get(kind, 0)


N_CONTEXT = 3  # columns of ``context_features``


class PivotNet(nn.Module):
    """extended_v2: Linear(d->64)(h) ++ Linear(2->16)(s) -> Linear(80->128) -> ReLU -> Linear(128->2);
    extended: the same with 4 scalars (draft entropy and q(d) too); context: with 5 (extended_v2's and the
    answer's ``context_features``); mlp: h -> 128 -> ReLU -> 2; linear: h -> 2.
    ``outputs`` replaces the 2 logits (pivot or not) for other heads on the same inputs (``classifier.drop``)."""

    def __init__(self, kind: str, d_model: int, outputs: int = 2):
        super().__init__()
        if kind not in TYPES:
            raise UsageError(f"unknown classifier type {kind!r}: choose one of {', '.join(TYPES)}")
        self.kind = kind
        k = n_scalars(kind)
        self.register_buffer("h_mean", torch.zeros(d_model))
        self.register_buffer("h_std", torch.ones(d_model))
        self.register_buffer("s_mean", torch.zeros(max(k, 1)))
        self.register_buffer("s_std", torch.ones(max(k, 1)))
        if k:
            self.h_proj, self.s_proj = nn.Linear(d_model, 64), nn.Linear(k, 16)
            self.head = nn.Sequential(nn.Linear(80, 128), nn.ReLU(), nn.Linear(128, outputs))
        elif kind == "mlp":
            self.head = nn.Sequential(nn.Linear(d_model, 128), nn.ReLU(), nn.Linear(128, outputs))
        else:
            self.head = nn.Linear(d_model, outputs)

    def forward(self, h: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
        h = (h - self.h_mean) / self.h_std
        if n_scalars(self.kind):
            s = (s - self.s_mean) / self.s_std
            return self.head(torch.cat([self.h_proj(h), self.s_proj(s)], dim=-1))
        return self.head(h)

    def fit_normalisation(self, h: torch.Tensor, s: torch.Tensor | None) -> None:
        self.h_mean.copy_(h.mean(0))
        self.h_std.copy_(h.std(0).clamp_min(1e-6))
        if n_scalars(self.kind):
            self.s_mean.copy_(s.mean(0))
            self.s_std.copy_(s.std(0).clamp_min(1e-6))


def context_features(context: Any, sd_ok: torch.Tensor) -> torch.Tensor:
    """[g, 3] what the draft wrote of the answer before each of a step's g draft tokens: log(1 + overrides),
    overrides / tokens, log(1 + tokens since the last override). ``context`` (``acceptance.Context``) is the
    answer before the step; within it, d_i follows d_1 .. d_{i-1}, and d_i is emitted only if they were all
    kept, so each of them that SD rejected (``~sd_ok``) counts as an override. One function for training
    (one candidate, ``sd_ok`` = [False]) and decoding."""
    if context is None:
        raise UsageError("a context classifier reads the answer's overrides so far, which this caller does not "
                         "give: decode it with pivotspec's own loop (generate, eval, serve --engine torch)")
    g = sd_ok.shape[0]
    rejected = (~sd_ok.bool()).long().cpu()
    before = torch.cumsum(rejected, 0) - rejected  # rejected drafts ahead of position i in this step
    pos = torch.arange(g)
    last = torch.cummax(torch.where(rejected.bool(), pos, torch.full_like(pos, -1)), 0).values
    last_before = torch.cat([torch.full((1,), -1), last[:-1]]) if g else last  # last rejected index < i
    since = torch.where(last_before >= 0, pos - 1 - last_before, context.since_override + pos)
    overrides = context.overrides + before
    generated = context.generated + pos
    cols = [torch.log1p(overrides.float()), overrides.float() / generated.clamp_min(1).float(),
            torch.log1p(since.float())]
    return torch.stack(cols, dim=-1).to(sd_ok.device)


def scalar_features(kind: str, target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                    draft_probs: torch.Tensor | None) -> torch.Tensor | None:
    """[n, k] scalars: target entropy and p(d) (+ draft entropy and q(d) for ``extended``), each from the
    distribution that predicts d. (``context`` adds ``context_features`` in ``model_inputs``.)"""
    k = n_scalars(kind)
    if not k:
        return None
    idx = draft_tokens[:, None]
    cols = [entropy(target_probs), target_probs.gather(-1, idx).squeeze(-1)]
    if kind == "extended":
        cols += [entropy(draft_probs), draft_probs.gather(-1, idx).squeeze(-1)]
    return torch.stack(cols, dim=-1)


def model_inputs(kind: str, hidden_rows: torch.Tensor | None, target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                 draft_probs: torch.Tensor | Callable[[], torch.Tensor] | None = None, context: Any = None,
                 sd_ok: torch.Tensor | Callable[[], torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The classifier's inputs for ``g`` draft tokens, from one target forward over [last, d_1 .. d_g].

    The training features and the PAD policy both come through here, so a model sees at decode time exactly
    what it was trained on. ``hidden_rows`` and ``target_probs`` are that forward's g + 1 rows (g rows of
    probabilities suffice). The hidden state is read at d_i's OWN row (i, where d_i is the input token: it
    has seen d_i, so two draft tokens at one position differ); entropy and p(d_i) come from row i - 1, the
    distribution that predicts d_i. ``draft_probs`` ([g, V], or a function building them) is read only by
    classifier types that use the draft's scalars, so other types never pay for it; ``context`` and ``sd_ok``
    (the lossless decisions, or a function giving them) only by ``context`` classifiers.
    """
    g = draft_tokens.shape[0]
    h = hidden_rows[1: g + 1] if hidden_rows is not None else None
    q = draft_probs() if callable(draft_probs) and kind == "extended" else draft_probs
    s = scalar_features(kind, target_probs[:g], draft_tokens, q[:g] if kind == "extended" else None)
    if kind == "context":
        s = torch.cat([s, context_features(context, sd_ok() if callable(sd_ok) else sd_ok).to(s.dtype)], dim=-1)
    return h, s


def pivot_scores(net: PivotNet, h: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(net(h, s), dim=-1)[:, 1]


def train(kind: str, d_model: int, train_x: tuple, train_y: torch.Tensor, val_x: tuple, val_y: torch.Tensor, *,
          lr: float = 1e-3, epochs: int = 2000, patience: int = 200, weight_decay: float = 1e-2, seed: int = 0,
          loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, outputs: int = 2,
          progress: Callable[[int, int, float, float], None] | None = None) -> tuple[PivotNet, dict[str, Any]]:
    """Build and train a ``kind`` classifier: full-batch AdamW with class-balanced cross-entropy (or ``loss`` of
    (outputs, y) for a head of ``outputs`` values), keeping the weights of the epoch with the lowest loss on
    ``val`` (the selection split). The seed is set before the model is built, so its initial weights are
    reproducible too."""
    torch.manual_seed(seed)
    net = PivotNet(kind, d_model, outputs)
    net.fit_normalisation(*train_x)
    if loss is None:
        counts = torch.bincount(train_y, minlength=2).float().clamp_min(1)
        loss = nn.CrossEntropyLoss(weight=counts.sum() / (2 * counts))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    best, best_state, best_epoch = float("inf"), None, 0
    for epoch in range(epochs):
        net.train()
        opt.zero_grad()
        train_loss = loss(net(*train_x), train_y)
        train_loss.backward()
        opt.step()
        net.eval()
        with torch.no_grad():
            val_loss = loss(net(*val_x), val_y).item() if len(val_y) else train_loss.item()
        if val_loss < best - 1e-6:
            best, best_epoch = val_loss, epoch
            best_state = {k: v.clone() for k, v in net.state_dict().items()}
        if progress and epoch % 50 == 0:
            progress(epoch, epochs, train_loss.item(), val_loss)
        if epoch - best_epoch > patience:
            break
    net.load_state_dict(best_state)
    net.eval()
    return net, {"best_val_loss": best, "best_epoch": best_epoch, "epochs_run": epoch + 1}


def calibrate_sigma(scores: torch.Tensor, labels: torch.Tensor, target_recall: float) -> float:
    """Largest sigma whose pivot recall is >= target_recall. A pivot is caught when its score > sigma
    (PAD overrides only tokens scoring <= sigma), so at most floor((1 - R) * P) pivots may score <= sigma."""
    pivots = torch.sort(scores[labels == 1]).values
    if len(pivots) == 0:
        return 0.0
    allowed = int((1 - target_recall) * len(pivots) + 1e-9)
    if allowed >= len(pivots):
        return 1.0
    bound = float(pivots[allowed])  # sigma must stay strictly below this score; round down to a 1e-4 grid
    return min(1.0, max(0.0, math.floor(bound * 10_000 - 1e-9) / 10_000))


def save(path: Path, net: PivotNet, config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path / WEIGHTS))
    (path / CONFIG).write_text(json.dumps(config, indent=1))


def load(path: Path) -> tuple[PivotNet, dict[str, Any]]:
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise UsageError(f"{path} is not a pivot classifier directory ({CONFIG} + {WEIGHTS}): check --classifier")
    try:
        config = json.loads((path / CONFIG).read_text())
        if not isinstance(config, dict):
            raise ValueError(f"{CONFIG} is not a JSON object")
        missing = [k for k in ("type", "d_model", "layer", "sigma", "target") if k not in config]
        if missing:
            raise ValueError(f"{CONFIG} lacks {', '.join(missing)}")
        net = PivotNet(config["type"], config["d_model"])
        net.load_state_dict(load_file(str(path / WEIGHTS)))
    except UsageError:
        raise
    except Exception as exc:  # safetensors raises its own error types for empty or garbage files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{path} holds a damaged classifier ({first}): train it again") from None
    net.eval()
    return net, config


def check_compatible(config: dict[str, Any], target: Any) -> None:
    """A classifier reads one layer of one target; anything else would feed it meaningless features."""
    made_for = config.get("target", {})
    if made_for.get("d_model") != target.d_model:
        raise UsageError(f"classifier expects hidden size {made_for.get('d_model')} but target {target.name!r} has "
                         f"{target.d_model}: train a classifier for this target")
    if not 1 <= config["layer"] <= target.num_layers or made_for.get("num_layers") != target.num_layers:
        raise UsageError(f"classifier reads layer {config['layer']} of a {made_for.get('num_layers')}-layer model but "
                         f"target {target.name!r} has {target.num_layers} layers: train a classifier for this target")
    if made_for.get("name") != target.name:
        raise UsageError(f"classifier was trained for target {made_for.get('name')!r}, not {target.name!r}: "
                         "train one for this target")
    if made_for.get("weights") not in (None, target.weights_fingerprint):  # None: saved before fingerprints
        raise UsageError(f"classifier was trained for other weights of target {target.name!r} (fingerprint "
                         f"{made_for['weights']}, this one {target.weights_fingerprint}): train one for this target")
    if config.get("feature_row") != FEATURE_ROW:
        raise UsageError(f"classifier reads the hidden state at the {config.get('feature_row', 'predicting')!r} row, "
                         f"this version feeds the {FEATURE_ROW!r} row: train it again with this version")


def as_policy_classifier(net: PivotNet) -> Callable[[Any], torch.Tensor]:
    """The PAD policy's classifier: reads a verification step (``acceptance.Verification``)."""

    def classify(v: Any) -> torch.Tensor:
        h, s = model_inputs(net.kind, v.hidden, v.p_raw, v.draft_tokens, lambda: v.q_raw, v.context, lambda: v.sd_ok)
        return pivot_scores(net, h, s)

    return classify


def load_for_target(path: Path, target: Any) -> tuple[Callable[[Any], torch.Tensor], dict[str, Any]]:
    """A trained classifier as the decoding loop's callable, checked against ``target``."""
    net, config = load(path)
    check_compatible(config, target)
    return as_policy_classifier(net.to(target.device)), config  # scores where the target's hidden states are


# Reference classifiers: logistic regressions on the scalars alone. If the hidden-state classifier does not
# beat these, it has learned a probability threshold and PAD is a relaxed-SD rule in disguise.
REFERENCES = {"logreg_p": [1], "logreg_entropy_p": [0, 1]}  # columns of the [entropy, p(d)] scalars


def fit_logistic(x: torch.Tensor, y: torch.Tensor, weight_decay: float = 1e-4) -> dict[str, Any]:
    """Class-balanced logistic regression on standardised columns (L-BFGS, float64); JSON-ready."""
    x = x.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-9)
    z = (x - mean) / std
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    counts = torch.bincount(y, minlength=2).double().clamp_min(1)
    weights = (counts.sum() / (2 * counts))[y]
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        logits = z @ w + b
        loss = (weights * nn.functional.binary_cross_entropy_with_logits(logits, y.double(), reduction="none")).mean()
        loss = loss + weight_decay * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return {"mean": mean.tolist(), "std": std.tolist(), "w": w.detach().tolist(), "b": float(b.detach())}


def logistic_scores(model: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    f64 = torch.float64
    z = (x.double() - torch.tensor(model["mean"], dtype=f64)) / torch.tensor(model["std"], dtype=f64)
    return torch.sigmoid(z @ torch.tensor(model["w"], dtype=f64) + model["b"]).float()
