"""The candidate proposer: the draft model extends the current sequence by up to ``gamma`` tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pivotspec.decoding.models import LM
from pivotspec.decoding.sampling import SamplingConfig, logits_to_probs, sample


@dataclass
class Proposal:
    tokens: list[int]
    native_logits: torch.Tensor  # [g, rows of the draft's output layer] at each drafted position
    q: torch.Tensor | None  # [g, V] distributions the tokens were sampled from (None when greedy)
    to_full: Callable[[torch.Tensor], torch.Tensor]  # output-layer rows -> the target's vocabulary

    def full_logits(self) -> torch.Tensor:
        """[g, V] draft logits over the target's vocabulary. Called only when a policy reads them (the
        verification caches the result): greedy lossless SD never does, and for a reduced-vocabulary draft
        the scatter is a real per-token cost."""
        return self.to_full(self.native_logits)


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Pad (with -inf) or trim logits to the target's vocabulary size; models sharing a tokenizer may
    still differ in how many padding rows their output layer has."""
    n = logits.shape[-1]
    if n == vocab_size:
        return logits
    if n > vocab_size:
        return logits[..., :vocab_size]
    pad = torch.full((*logits.shape[:-1], vocab_size - n), float("-inf"), device=logits.device)
    return torch.cat([logits, pad], dim=-1)


def propose(
    draft: LM,
    seq: list[int],
    gamma: int,
    cfg: SamplingConfig,
    generator: torch.Generator | None,
    vocab_size: int,
    stop_ids: set[int],
) -> Proposal:
    """Draft up to ``gamma`` tokens after ``seq``; stops early after a stop id (nothing follows EOS).

    The draft's cache keeps whatever it has computed; the next call's ``advance`` rolls back the
    tokens the target rejected and feeds the ones the draft has not seen (at most the correction or
    bonus token and the last accepted draft token), so nothing is recomputed.
    """
    def to_full(logits: torch.Tensor) -> torch.Tensor:
        return fit_vocab(draft.full_vocab(logits), vocab_size)

    tokens: list[int] = []
    logit_rows, q_rows = [], []
    for _ in range(gamma):
        logits, _ = draft.advance(seq + tokens, keep_logits=1, full_vocab=False)
        logit_rows.append(logits[0])
        if cfg.greedy:
            token = draft.greedy_token(logits[0], vocab_size)
        else:
            q = logits_to_probs(to_full(logits), cfg)
            q_rows.append(q[0])
            token = int(sample(q, generator)[0])
        tokens.append(token)
        if token in stop_ids:
            break
    return Proposal(tokens, torch.stack(logit_rows), torch.stack(q_rows) if q_rows else None, to_full)
