"""One decoding loop for every method: target-only, draft-only, lossless SD, PAD and relaxed baselines.

Each step: the draft proposes up to gamma tokens; one target forward over [last token, drafts] gives
p_1..p_{g+1}; the lossless rule and the acceptance policy decide which drafts to keep; the first
rejected position is replaced by a correction (argmax, or a sample from the SD residual) or, when all are
kept, a bonus token is drawn from p_{g+1}. Without a draft every step is one plain target token.

Both models' caches always hold a prefix of the sequence; ``LM.advance`` rolls back rejected tokens and
feeds only what is missing, so neither the prompt nor accepted tokens are ever recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pivotspec.decoding.acceptance import Context, Lossless, Verification, for_answer
from pivotspec.decoding.drafting import Proposal, fit_vocab, propose
from pivotspec.decoding.models import LM
from pivotspec.decoding.sampling import SamplingConfig, argmax, logits_to_probs, residual, sample
from pivotspec.errors import UsageError

SOURCES = ("accepted", "override", "corrected", "bonus", "target")
STAT_COUNTS = ("target_forwards", "draft_forwards", "drafted", *SOURCES)


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    stats: dict[str, Any]
    trace: list[tuple[int, str]] = field(default_factory=list)  # (token id, source) per emitted token


def new_stats() -> dict[str, Any]:
    stats: dict[str, Any] = {k: 0 for k in STAT_COUNTS}
    stats.update(prefill_s=0.0, draft_s=0.0, target_s=0.0, policy_s=0.0, forward_s=0.0)
    return stats


def finish_stats(stats: dict[str, Any], new_tokens: int, wall_s: float) -> dict[str, Any]:
    """Derived stats. tau = tokens per target forward (bonus included; None for draft-only);
    eta = draft tokens kept (by SD or by the override) / draft tokens proposed."""
    stats["new_tokens"] = new_tokens
    stats["wall_s"] = wall_s
    stats["tau"] = new_tokens / stats["target_forwards"] if stats["target_forwards"] else None
    kept = stats["accepted"] + stats["override"]
    stats["eta"] = kept / stats["drafted"] if stats["drafted"] else None
    # Time outside any model forward and outside the prefill: the loop's own cost.
    stats["overhead_s"] = wall_s - stats["prefill_s"] - stats["forward_s"]
    return stats


def record_policy_state(stats: dict[str, Any], policy: Any) -> None:
    """What a per-answer policy spent (a budget's summed predicted drop), in the answer's stats."""
    spent = getattr(policy, "spent", None)
    if spent is not None:
        stats["budget_spent"] = spent


class Stopper:
    """Decides whether the text so far is finished: EOS, a stop string, or max_new_tokens."""

    def __init__(self, tokenizer: Any, eos: set[int], stop_strings: list[str], max_new_tokens: int):
        self.tokenizer, self.eos, self.stop_strings, self.max_new = tokenizer, eos, stop_strings, max_new_tokens
        # Every token decodes to >= 1 character (or a partial byte), so this many tokens cover any stop string.
        self.window = max((len(s) for s in stop_strings), default=0) + 2

    def reason(self, new: list[int]) -> str | None:
        if new and new[-1] in self.eos:
            return "eos"
        if self.stop_strings:
            tail = self.tokenizer.decode(new[-self.window:])
            if any(s in tail for s in self.stop_strings):
                return "stop_string"
        if len(new) >= self.max_new:
            return "max_tokens"
        return None


def check_fits(prompt_ids: list[int], max_new_tokens: int, *models: LM | None) -> None:
    if not prompt_ids:
        raise UsageError("the prompt is empty (no tokens): give a non-empty prompt")
    for m in models:
        limit = m.max_positions if m is not None else None
        if limit and len(prompt_ids) + max_new_tokens > limit:
            raise UsageError(f"prompt ({len(prompt_ids)} tokens) + max new tokens ({max_new_tokens}) exceeds the "
                             f"{limit} positions of model {m.name!r}: shorten the prompt or lower --max-new-tokens")


def prefill(models: list[LM], prompt_ids: list[int]) -> None:
    """Fill each model's cache with everything but the last prompt token: each step then feeds
    [last token, drafts...], so the first step's target forward already yields p_1."""
    for m in models:
        m.reset()
        if len(prompt_ids) > 1:
            m.forward(prompt_ids[:-1], keep_logits=0)


def verify(proposal: Proposal, logits: torch.Tensor, hidden: torch.Tensor | None, policy: Any,
           cfg: SamplingConfig, generator: torch.Generator,
           context: Callable[[], Context]) -> tuple[Verification, torch.Tensor]:
    """The verification of one step's drafts and which of them are kept (``sd_ok | override``, as a bool
    mask over the drafts; the caller keeps its longest all-True prefix). ``context``: the answer so far, for
    context-aware classifiers (a function: built only if one reads it, so other policies pay nothing per step)."""
    d = torch.tensor(proposal.tokens, device=logits.device)
    u = None if cfg.greedy else torch.rand(len(d), generator=generator, device=logits.device)
    v = Verification(d, logits, proposal.full_logits, cfg, hidden, q=proposal.q, u=u, context=context)
    return v, v.sd_ok | (policy.override(v) & ~v.sd_ok)


def next_token(logits: torch.Tensor, v: Verification | None, n_kept: int, cfg: SamplingConfig,
               generator: torch.Generator, residual_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """The token after the kept drafts: the correction at the first rejected draft (greedy: the target's
    argmax; sampling: a draw from the SD residual), or the bonus token from p_{n+1} when all were kept."""
    if cfg.greedy:
        return int(argmax(logits[n_kept]))
    p = v.p if v is not None else logits_to_probs(logits, cfg)
    rejected = v is not None and n_kept < len(v.draft_tokens)
    probs = residual_fn(p[n_kept], v.q[n_kept]) if rejected else p[n_kept]
    return int(sample(probs[None], generator)[0])


def step_tokens(drafts: list[int], v: Verification | None, n_kept: int, token: int,
                has_draft: bool) -> list[tuple[int, str]]:
    """(token id, source) of what one step emits: the kept drafts, then the correction or bonus token."""
    emitted = [(drafts[i], "accepted" if v.sd_ok[i] else "override") for i in range(n_kept)]
    source = "corrected" if n_kept < len(drafts) else ("bonus" if has_draft else "target")
    return emitted + [(token, source)]


def generate(
    target: LM,
    prompt_ids: list[int],
    *,
    draft: LM | None = None,
    policy: Any = None,
    cfg: SamplingConfig | None = None,
    gamma: int = 5,
    max_new_tokens: int = 128,
    eos_ids: set[int] | None = None,
    stop_strings: list[str] | None = None,
    seed: int = 0,
    residual_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = residual,
    on_step: Callable[[list[tuple[int, str]]], bool] | None = None,
) -> Generation:
    """Decode from ``prompt_ids``. ``draft=None`` is plain decoding with ``target``; otherwise speculative
    decoding with ``policy`` (default: lossless). ``on_step`` receives each step's emitted (token id, source)
    pairs as soon as they exist (streaming) and stops the decode, with stop reason "cancelled", by returning
    False. ``residual_fn`` is injectable for tests only.

    Each step: propose (the draft), one target forward, verify (lossless rule + policy), the next token
    (correction or bonus), emit (stop checks per token)."""
    check_fits(prompt_ids, max_new_tokens, target, draft)
    policy = for_answer(policy or Lossless())
    cfg = cfg or SamplingConfig()
    generator = torch.Generator(device=target.device).manual_seed(seed)  # draws happen where the logits are
    stopper = Stopper(target.tokenizer, eos_ids or set(), list(stop_strings or []), max_new_tokens)
    stats = new_stats()
    models = [m for m in (target, draft) if m is not None]
    start = time.perf_counter()
    forward_before = sum(m.forward_s for m in models)
    prefill(models, prompt_ids)
    stats["prefill_s"] = time.perf_counter() - start
    forward_before_loop = sum(m.forward_s for m in models)

    seq, new, trace = list(prompt_ids), [], []
    stop = None
    while stop is None and len(new) < max_new_tokens:
        t0 = time.perf_counter()
        g = min(gamma, max_new_tokens - len(new) - 1) if draft is not None else 0  # no drafting past max_new_tokens
        proposal = propose(draft, seq, g, cfg, generator, target.vocab_size, stopper.eos) if g > 0 else None
        drafts = proposal.tokens if proposal else []
        t1 = time.perf_counter()
        logits, hidden = target.advance(
            seq + drafts, keep_logits=len(drafts) + 1, hidden_layer=policy.hidden_layer if drafts else None
        )
        logits = fit_vocab(logits, target.vocab_size)
        t2 = time.perf_counter()
        stats["draft_s"] += t1 - t0
        stats["target_s"] += t2 - t1
        stats["target_forwards"] += 1
        stats["draft_forwards"] += len(drafts)
        stats["drafted"] += len(drafts)

        v, n_kept = None, 0
        if drafts:
            v, kept = verify(proposal, logits, hidden, policy, cfg, generator,
                             lambda: Context.of([source for _, source in trace]))
            stats["policy_s"] += time.perf_counter() - t2
            n_kept = int(kept.long().cumprod(0).sum())
        last = next_token(logits, v, n_kept, cfg, generator, residual_fn)

        step_start = len(trace)
        for token, source in step_tokens(drafts, v, n_kept, last, draft is not None):
            seq.append(token)
            new.append(token)
            trace.append((token, source))
            stats[source] += 1
            stop = stopper.reason(new)
            if stop:
                break
        if on_step is not None and on_step(trace[step_start:]) is False and stop is None:
            stop = "cancelled"

    wall = time.perf_counter() - start
    stats["forward_s"] = sum(m.forward_s for m in models) - forward_before_loop
    stats["prefill_forward_s"] = forward_before_loop - forward_before
    stats["stop_reason"] = stop or "max_tokens"
    stats["prompt_tokens"] = len(prompt_ids)
    record_policy_state(stats, policy)
    text = target.tokenizer.decode(new, skip_special_tokens=True)
    return Generation(new, text, finish_stats(stats, len(new), wall), trace)


def as_draft_only(stats: dict[str, Any]) -> None:
    """Stats of a decode by the draft model alone: its forwards are draft forwards, and tau has no meaning."""
    stats["draft_forwards"], stats["target_forwards"] = stats["target_forwards"], 0
    stats["tau"] = None


METHODS = ("ar", "draft", "sd", "pad")  # what ``decode`` runs; PAD and the baselines differ only by policy


def decode(method: str, target: LM | None, draft: LM | None, prompt_ids: list[int], policy: Any = None,
           **kwargs: Any) -> Generation:
    """Run one named method. ``draft`` decodes with the draft model alone; its forwards count as draft
    forwards. ``sd`` uses the lossless policy whatever ``policy`` is; ``pad`` and baselines pass theirs."""
    if method == "ar":
        return generate(target, prompt_ids, **kwargs)
    if method == "draft":
        gen = generate(draft, prompt_ids, **kwargs)
        as_draft_only(gen.stats)
        return gen
    return generate(target, prompt_ids, draft=draft, policy=Lossless() if method == "sd" else policy, **kwargs)
