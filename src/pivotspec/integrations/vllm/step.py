"""One rejection step of vLLM's batch, judged by a pivotspec policy. Pure torch: no vLLM import here, so the
tests check it against pivotspec's own loop without vLLM installed.

vLLM lays a step out flat: ``num_draft[r]`` draft tokens per request, one after another, and for each request
``g + 1`` rows of target logits (the rows that predict d_1 .. d_g, then the bonus row). ``overrides`` rebuilds
one ``acceptance.Verification`` per request from those rows, so the policy object (``PAD``, with its
classifier and ``model_inputs``) is the very one the pivotspec loop runs; ``force`` then makes vLLM's own
rejection kernels keep the overridden tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pivotspec.decoding.acceptance import Verification
from pivotspec.decoding.sampling import SamplingConfig


@dataclass
class Rows:
    """One request's share of a step: its draft tokens [g], raw target logits [g + 1, V] (before temperature),
    target hidden states at the classifier's layer for the input rows [last, d_1 .. d_g] ([g + 1, d]), the draft's
    distributions if vLLM sampled from them ([g, V], else None) and the request's sampling settings."""

    draft_tokens: torch.Tensor
    target_logits: torch.Tensor
    hidden: torch.Tensor | None
    draft_probs: torch.Tensor | None
    cfg: SamplingConfig


def verification(rows: Rows) -> Verification:
    """The pivotspec view of one request's step. The draft's logits are never needed by PAD's default classifier
    types; a type that reads the draft's scalars gets vLLM's draft distributions, or an error when vLLM kept
    none (its greedy draft)."""

    def no_draft_logits() -> torch.Tensor:
        raise ValueError("this classifier type reads the draft's distribution, which vLLM keeps only with "
                         "draft_sample_method='probabilistic' under sampling: use an extended_v2 classifier")

    return Verification(rows.draft_tokens.long(), rows.target_logits.float(), no_draft_logits, rows.cfg,
                        hidden=None if rows.hidden is None else rows.hidden.float(), q=rows.draft_probs)


def overrides(requests: Sequence[tuple[object, Rows]]) -> torch.Tensor:
    """[sum g] each request's policy's override per draft token, requests in order (a request whose policy is
    None, or that holds padding drafts, id < 0, gets none)."""
    out = []
    for policy, rows in requests:
        if rows.draft_tokens.numel() == 0:
            continue
        mask = torch.zeros(rows.draft_tokens.shape, dtype=torch.bool)
        if policy is not None and bool((rows.draft_tokens >= 0).all()):
            mask = policy.override(verification(rows)).reshape(-1).bool().cpu()
        out.append(mask)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)


def force(target_logits: torch.Tensor, draft_tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A copy of vLLM's processed target logits [n, V] in which each masked row's draft token wins: its logit
    sits 1e4 above the row's maximum, so it is the argmax (greedy) and its probability is 1 in float32
    (sampling: vLLM accepts when p(d) / q(d) >= u, which p(d) = 1 always passes). Unmasked rows are untouched,
    and no random number is drawn, so a step without overrides is vLLM's lossless step bit for bit."""
    forced = target_logits.clone()
    rows = mask.nonzero().flatten().to(target_logits.device)
    if rows.numel():
        ids = draft_tokens[rows].long()
        forced[rows, ids] = forced[rows].max(dim=-1).values + 1e4
    return forced


def sd_accepts(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
               uniforms: torch.Tensor | None, greedy: torch.Tensor) -> torch.Tensor:
    """[n] vLLM's lossless decision per draft token, from the processed logits and the step's uniforms (used only
    to count overrides: a kept token the lossless rule would have rejected)."""
    d = draft_tokens.long().clamp_min(0)
    argmax_ok = target_logits.argmax(dim=-1) == d
    if uniforms is None:
        return argmax_ok
    p = torch.softmax(target_logits.float(), dim=-1).gather(-1, d[:, None]).squeeze(-1)
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(-1, d[:, None]).squeeze(-1).float()
    random_ok = (q > 0) & (p.double() / q.double().clamp_min(1e-30) >= uniforms.to(p.device))
    return torch.where(greedy, argmax_ok, random_ok)
