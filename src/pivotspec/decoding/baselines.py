"""Training-free relaxed acceptance rules (as in vLLM, SGLang, TensorRT-LLM and transformers), as policies for
the same loop as PAD.

Each keeps some draft tokens that lossless SD rejects; each has a neutral knob value at which it keeps none
of them and so is exactly SD. Spec strings name a rule and its knobs: ``typical``, ``topk:k=5,ratio=0.3``.
The correction token after a rejection is still drawn from the SD residual norm(max(0, p - q)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from pivotspec.decoding.acceptance import Verification
from pivotspec.decoding.sampling import entropy
from pivotspec.errors import UsageError


@dataclass
class Typical:
    """Medusa's typical acceptance: keep d when p(d) > min(epsilon, delta * exp(-H(p))).
    Neutral: epsilon = 1 (nothing has p > 1)."""

    epsilon: float = 0.09
    delta: float = 0.3
    name: str = "typical"
    hidden_layer: int | None = None

    def override(self, v: Verification) -> torch.Tensor:
        g = v.draft_tokens.shape[0]
        p = v.p_raw[:g]
        floor = torch.minimum(torch.full((g,), self.epsilon, device=p.device), self.delta * torch.exp(-entropy(p)))
        return v.draft_prob(p) > floor


@dataclass
class TopK:
    """Relaxed top-k: keep d when it is among the target's top k and p(d) >= ratio * p(top-1).
    Neutral: k = 0."""

    k: int = 5
    ratio: float = 0.3
    name: str = "topk"
    hidden_layer: int | None = None

    def override(self, v: Verification) -> torch.Tensor:
        g = v.draft_tokens.shape[0]
        if self.k <= 0:
            return torch.zeros(g, dtype=torch.bool, device=v.draft_tokens.device)
        p = v.p_raw[:g]
        top = torch.topk(p, min(self.k, p.shape[-1]), dim=-1)
        in_top = (top.indices == v.draft_tokens[:, None]).any(-1)
        return in_top & (v.draft_prob(p) >= self.ratio * top.values[:, 0])


@dataclass
class Threshold:
    """Keep d when the target gives it probability >= threshold. Neutral: threshold = 1 (a token with
    p(d) = 1 is accepted by SD anyway)."""

    threshold: float = 0.1
    name: str = "threshold"
    hidden_layer: int | None = None

    def override(self, v: Verification) -> torch.Tensor:
        return v.draft_prob(v.p_raw) >= self.threshold


@dataclass
class Ensemble:
    """Static ensemble (DIVERSED): verify against m = w p + (1 - w) q instead of p: greedy keeps d when it
    is m's argmax; sampling keeps d when u <= m(d) / q(d), with the same uniform u as SD. Neutral: w = 1."""

    w: float = 0.7
    name: str = "ensemble"
    hidden_layer: int | None = None

    def override(self, v: Verification) -> torch.Tensor:
        g = v.draft_tokens.shape[0]
        if v.cfg.greedy:
            mix = self.w * v.p_raw[:g] + (1 - self.w) * v.q_raw
            return mix.argmax(-1) == v.draft_tokens
        mix = self.w * v.p[:g] + (1 - self.w) * v.q
        return v.u * v.draft_prob(v.q) <= v.draft_prob(mix)


@dataclass
class Divergence:
    """Fuzzy SD: keep d when the divergence between p_i and q_i (kl = KL(p || q), js or tv) is at most
    threshold. Neutral: threshold = 0 (only p = q, where SD accepts anyway)."""

    threshold: float = 0.5
    divergence: str = "js"
    name: str = "divergence"
    hidden_layer: int | None = None

    def override(self, v: Verification) -> torch.Tensor:
        g = v.draft_tokens.shape[0]
        p, q = v.p_raw[:g], v.q_raw
        return divergence(p, q, self.divergence) <= self.threshold


def divergence(p: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """Row-wise KL(p || q), Jensen-Shannon (nats) or total variation."""

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * (torch.log(a.clamp_min(1e-30)) - torch.log(b.clamp_min(1e-30)))).sum(-1)

    if kind == "kl":
        return kl(p, q)
    if kind == "js":
        m = 0.5 * (p + q)
        return 0.5 * kl(p, m) + 0.5 * kl(q, m)
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    raise UsageError(f"unknown divergence {kind!r}: choose kl, js or tv")


BASELINES = {"typical": Typical, "topk": TopK, "threshold": Threshold, "ensemble": Ensemble,
             "divergence": Divergence}


def make_baseline(spec: str) -> Typical | TopK | Threshold | Ensemble | Divergence:
    """``name`` or ``name:knob=value,knob=value`` -> policy; bad specs are one-line UsageErrors."""
    name, _, knobs = spec.partition(":")
    if name not in BASELINES:
        raise UsageError(f"unknown baseline {name!r}: choose from {', '.join(BASELINES)}")
    cls = BASELINES[name]
    types = {f.name: f.type for f in fields(cls) if f.name not in ("name", "hidden_layer")}
    kwargs = {}
    for item in filter(None, knobs.split(",")):
        key, _, value = item.partition("=")
        if key not in types:
            raise UsageError(f"baseline {name} has no knob {key!r}: knobs are {', '.join(types)}")
        try:
            kwargs[key] = value if types[key] == "str" else (int(value) if types[key] == "int" else float(value))
        except ValueError:
            raise UsageError(f"bad value {value!r} for {name} knob {key}") from None
    policy = cls(**kwargs)
    if name == "divergence":
        divergence(torch.ones(1, 1), torch.ones(1, 1), policy.divergence)  # validates the kind early
    if any(isinstance(x, float) and math.isnan(x) for x in kwargs.values()):
        raise UsageError(f"bad knob value in {spec!r}")
    return policy


def label(policy: Typical | TopK | Threshold | Ensemble | Divergence) -> str:
    """A short label with the knobs, for tables and plots: topk(k=5,ratio=0.3)."""
    knobs = ",".join(f"{f.name}={getattr(policy, f.name):g}" if isinstance(getattr(policy, f.name), float)
                     else f"{f.name}={getattr(policy, f.name)}"
                     for f in fields(policy) if f.name not in ("name", "hidden_layer"))
    return f"{policy.name}({knobs})"
