"""Acceptance policies: which draft tokens to keep beyond what lossless SD keeps.

The decoding loop computes the lossless SD decision itself (``sd_ok``) and asks the policy for an
*override* mask: positions SD rejected that the policy accepts anyway. A draft position is kept when
``sd_ok or override``; the longest kept prefix is emitted. ``Lossless`` never overrides, so every
policy built on this interface reduces to exact SD when its override is empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from pivotspec.decoding.sampling import SamplingConfig, argmax, logits_to_probs
from pivotspec.errors import UsageError

# reads one verification step, returns each draft token's pivot probability [g]
Classifier = Callable[["Verification"], torch.Tensor]


@dataclass(frozen=True)
class Context:
    """How much of the answer so far the draft wrote against the lossless rule, before a step: tokens
    generated, overrides among them (kept drafts SD rejected), and tokens since the last override (or since
    the answer began). Context-aware classifiers (issue 30, item 5) read it; the decoding loops and the
    labeling walk build it the same way, from where each kept token came from."""

    generated: int = 0
    overrides: int = 0
    since_override: int = 0

    @staticmethod
    def of(sources: list[str]) -> Context:
        """From the sources of the answer's tokens so far ("override" marks an override)."""
        last = max((i for i, s in enumerate(sources) if s == "override"), default=-1)
        return Context(len(sources), sources.count("override"), len(sources) - 1 - last)


class Verification:
    """Everything one verification step knows about the ``g`` draft tokens it checks.

    Distributions are computed from the logits on first use: greedy lossless SD only needs argmaxes,
    so it never pays for a softmax over the vocabulary. ``context`` is the answer's state before the step.
    """

    def __init__(self, draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                 draft_logits: torch.Tensor | Callable[[], torch.Tensor], cfg: SamplingConfig,
                 hidden: torch.Tensor | None = None, q: torch.Tensor | None = None, u: torch.Tensor | None = None,
                 context: Context | Callable[[], Context] | None = None):
        self.draft_tokens = draft_tokens  # [g] token ids
        self.target_logits = target_logits  # [g + 1, V]
        self._draft_logits = draft_logits  # [g, V], or a function that builds them on first use
        self.cfg = cfg
        self.hidden = hidden  # [g + 1, d] target hidden states of the rows [last, d_1 .. d_g] (row i holds d_i)
        if q is not None:
            self.__dict__["q"] = q  # the sampler already computed the draft distributions
        self.u = u  # sampling: [g] uniforms, one per draft token, that SD compares p/q against
        self._context = context  # or a function building it on first use: only context classifiers read it

    @cached_property
    def sd_ok(self) -> torch.Tensor:
        """[g] the lossless rule's decision: greedy, the draft token is the target's argmax; sampling, u <= p/q."""
        if self.cfg.greedy:
            return argmax(self.target_logits[: self.draft_tokens.shape[0]]) == self.draft_tokens
        return self.u * self.draft_prob(self.q) <= self.draft_prob(self.p)

    @cached_property
    def context(self) -> Context | None:
        """The answer's state before this step (``Context``), built on first use."""
        return self._context() if callable(self._context) else self._context

    @cached_property
    def draft_logits(self) -> torch.Tensor:
        """[g, V] draft logits over the target's vocabulary."""
        return self._draft_logits() if callable(self._draft_logits) else self._draft_logits

    @cached_property
    def p(self) -> torch.Tensor:
        """[g + 1, V] target decoding distributions (after temperature / top-k / top-p)."""
        return logits_to_probs(self.target_logits, self.cfg)

    @cached_property
    def q(self) -> torch.Tensor:
        """[g, V] draft decoding distributions."""
        return logits_to_probs(self.draft_logits, self.cfg)

    @cached_property
    def p_raw(self) -> torch.Tensor:
        """[g + 1, V] target softmax at T = 1 (classifier features)."""
        return self.p if self.cfg.greedy else torch.softmax(self.target_logits, dim=-1)

    @cached_property
    def q_raw(self) -> torch.Tensor:
        """[g, V] draft softmax at T = 1."""
        return self.q if self.cfg.greedy else torch.softmax(self.draft_logits, dim=-1)

    def draft_prob(self, probs: torch.Tensor) -> torch.Tensor:
        """probs[i, d_i] for each draft position i."""
        g = self.draft_tokens.shape[0]
        return probs[:g].gather(-1, self.draft_tokens[:, None]).squeeze(-1)


@dataclass
class Lossless:
    """Leviathan/Chen speculative sampling (greedy: argmax match). Output distribution = target's."""

    name: str = "sd"
    hidden_layer: int | None = None

    def override(self, v: Verification) -> torch.Tensor:
        return torch.zeros_like(v.sd_ok)


# The paper's floor on an override's target probability (arXiv 2511.00351, where it is called tau; here
# tau is only ever tokens per target forward).
DEFAULT_P_FLOOR = 1e-4


@dataclass
class PAD:
    """Pivot-aware acceptance (arXiv 2511.00351): keep a token SD rejected when the classifier's pivot
    probability is <= sigma and the target gives it probability >= p_floor.

    sigma = 0 turns the override off, so PAD(sigma=0) is exactly SD even for a classifier that outputs 0.
    The floor guards overrides only: applying it to tokens SD accepts would break exactness at
    sigma = 0 under sampling, where SD may legitimately accept a token with p < p_floor.
    """

    classifier: Classifier
    sigma: float
    p_floor: float = DEFAULT_P_FLOOR
    hidden_layer: int | None = None
    name: str = "pad"

    def __post_init__(self) -> None:
        if not 0 <= self.sigma <= 1:
            raise UsageError(f"sigma must be in [0, 1], got {self.sigma}")
        if not 0 <= self.p_floor <= 1:
            raise UsageError(f"p_floor must be in [0, 1], got {self.p_floor}")

    def scores(self, v: Verification) -> torch.Tensor:
        g = v.draft_tokens.shape[0]
        return self.classifier(v).reshape(g)

    def override(self, v: Verification) -> torch.Tensor:
        if self.sigma <= 0:
            return torch.zeros_like(v.sd_ok)
        return (self.scores(v) <= self.sigma) & (v.draft_prob(v.p) >= self.p_floor)


@dataclass
class Budget:
    """PAD with a per-answer budget for harm (issue 30): keep a token SD rejected while the answer's summed
    predicted utility drop (``drop``: ``classifier.drop``'s head) stays <= ``budget``, and the target gives it
    probability >= p_floor. A per-token rule prices each override alone; a budget prices what the overrides of
    one answer cost together, so many small harms cannot add up unseen.

    Overrides are spent in draft order and the first one the budget cannot pay ends the step's overrides (a
    draft after a rejected one is never emitted, so it must not be paid for). ``spent`` is per answer: the
    decoding loops take a fresh copy per decode (``for_answer``), so rows sharing one policy never share a
    budget. budget = 0 turns the override off: exactly SD.

    With ``pivot`` and ``sigma`` an override must also pass PAD's per-token rule (pivot score <= sigma): the
    budget alone would pay for a likely pivot as readily as for a harmless wording, as long as money is left.
    """

    drop: Classifier
    budget: float
    p_floor: float = DEFAULT_P_FLOOR
    hidden_layer: int | None = None
    pivot: Classifier | None = None
    sigma: float | None = None
    name: str = "pad-budget"
    spent: float = 0.0

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise UsageError(f"the PAD budget must be >= 0, got {self.budget}")
        if not 0 <= self.p_floor <= 1:
            raise UsageError(f"p_floor must be in [0, 1], got {self.p_floor}")
        if (self.pivot is None) != (self.sigma is None):
            raise UsageError("a per-token rule inside a budget needs both the pivot classifier and sigma")
        if self.sigma is not None and not 0 <= self.sigma <= 1:
            raise UsageError(f"sigma must be in [0, 1], got {self.sigma}")

    def for_answer(self) -> Budget:
        return replace(self, spent=0.0)

    def override(self, v: Verification) -> torch.Tensor:
        keep = torch.zeros_like(v.sd_ok)
        if self.budget <= 0:
            return keep
        price = self.drop(v).reshape(-1).tolist()
        allowed = v.draft_prob(v.p) >= self.p_floor
        if self.pivot is not None:
            allowed &= self.pivot(v).reshape(-1) <= self.sigma
        allowed = allowed.tolist()
        for i, sd_ok in enumerate(v.sd_ok.tolist()):
            if sd_ok:
                continue
            if not allowed[i] or self.spent + price[i] > self.budget + 1e-6:  # float32 prices summing to it pay
                break
            self.spent += price[i]
            keep[i] = True
        return keep


def for_answer(policy: Any) -> Any:
    """The policy one decode uses: a copy with fresh per-answer state for a policy that keeps some (a budget),
    else the policy itself."""
    fresh = getattr(policy, "for_answer", None)
    return fresh() if fresh is not None else policy


def constant_classifier(score: float) -> Classifier:
    """A classifier that calls every token a pivot with probability ``score`` (for tests and ablations)."""

    def classify(v: Verification) -> torch.Tensor:
        return torch.full((v.draft_tokens.shape[0],), float(score), device=v.draft_tokens.device)

    return classify
