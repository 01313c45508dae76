"""Decoding many sequences at once: the speculative loop of ``loop.py`` over a batch of rows, each with its
own prompt, acceptance policy, sampling settings, generator, gamma, stop strings and max_new_tokens.

One step for all rows: the draft proposes for every row that drafts (one batched draft forward per draft
position; rows that drafted fewer tokens or none ride along as padding), one batched target forward
verifies every row's [last token, drafts], and then each row is verified, corrected and emitted exactly as
batch 1 does it (``loop.verify``, ``loop.next_token``, ``loop.step_tokens``): acceptance is per row, like
vLLM's rejection sampler, and a row's random numbers come from its own generator in batch 1's order.

Rows of any acceptance policy (lossless SD, PAD at any sigma, a baseline) and target-only rows (``speculate``
False) share a batch: the policy is per row. Rows join between steps (``Batch.add``: the prompt is
computed inside the next step's forward where that gives batch 1's numbers bit for bit, else prefilled alone,
exactly as batch 1 does it, and copied into the batch's cache, ``slots.SlotCache``; a prompt computed inside a
step starts from the keys of any start it shares with a row in the batch or the last row that left: prefix
caching) and leave as soon as they finish (continuous batching). Timings in a row's stats are the batch's: each step's
wall time counts for every row in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pivotspec.decoding import query_attention
from pivotspec.decoding.acceptance import Context, Lossless, for_answer
from pivotspec.decoding.attention import FLOAT32_ATTENTION, KERNEL_ROWS
from pivotspec.decoding.drafting import Proposal, fit_vocab
from pivotspec.decoding.forward import Ragged, model_forward, runs_lean
from pivotspec.decoding.loop import (
    Generation,
    Stopper,
    as_draft_only,
    check_fits,
    finish_stats,
    new_stats,
    next_token,
    record_policy_state,
    step_tokens,
    verify,
)
from pivotspec.decoding.models import LM, synchronize
from pivotspec.decoding.sampling import SamplingConfig, logits_to_probs, residual, sample
from pivotspec.decoding.slots import SlotCache, attention_masks, compacted

# The lean forward skips a step's padding when it is at least this share of the positions (below it, computing
# the padding cost less than gathering the tokens: a step whose rows all verify gamma drafts has none).
RAGGED_SHARE = 0.75


@dataclass
class Request:
    """One row's decode: what ``loop.generate`` takes for one prompt. ``speculate`` False decodes with the
    target alone (method ``ar``) in a batch whose other rows draft."""

    prompt_ids: list[int]
    policy: Any = None  # None: lossless SD
    cfg: SamplingConfig = field(default_factory=SamplingConfig)
    gamma: int = 5
    max_new_tokens: int = 128
    eos_ids: set[int] = field(default_factory=set)
    stop_strings: list[str] = field(default_factory=list)
    seed: int = 0
    speculate: bool = True
    method: str = "sd"  # the name it was asked for (ar, draft, sd, pad or a baseline spec); "draft": see ``Row``
    on_step: Callable[[list[tuple[int, str]]], bool] | None = None
    # where the prompt ends inside an answer (a rollout continuing a labeling walk): the sources of that answer's
    # tokens so far, so that a context classifier sees the whole answer
    sources: list[str] = field(default_factory=list)


class Row:
    """A request's state while it is in the batch."""

    def __init__(self, request: Request, target: LM):
        self.request = request
        self.policy = for_answer(request.policy or Lossless())  # per-answer state is the row's own
        self.generator = torch.Generator(device=target.device).manual_seed(request.seed)
        self.stopper = Stopper(target.tokenizer, request.eos_ids, list(request.stop_strings),
                                request.max_new_tokens)
        self.stats = new_stats()
        self.seq, self.new = list(request.prompt_ids), []
        self.trace: list[tuple[int, str]] = []
        self.stop: str | None = None
        self.cached: dict[int, list[int]] = {}  # id(model) -> the ids its cache row holds
        self.started = time.perf_counter()

    def gamma(self, has_draft: bool) -> int:
        """Draft tokens to propose this step: none past max_new_tokens (as batch 1)."""
        if not (has_draft and self.request.speculate):
            return 0
        return max(0, min(self.request.gamma, self.request.max_new_tokens - len(self.new) - 1))

    def generation(self, tokenizer: Any) -> Generation:
        self.stats["stop_reason"] = self.stop or "max_tokens"
        self.stats["prompt_tokens"] = len(self.request.prompt_ids)
        record_policy_state(self.stats, self.policy)
        stats = finish_stats(self.stats, len(self.new), time.perf_counter() - self.started)
        if self.request.method == "draft":  # the batch's "target" was the draft model
            as_draft_only(stats)
        return Generation(self.new, tokenizer.decode(self.new, skip_special_tokens=True), stats, self.trace)


def _common_prefix(cached: list[int], seq: list[int], keep: int) -> int:
    """How much of ``cached`` a forward that must return outputs for the last ``keep`` ids of ``seq`` reuses."""
    limit = min(len(cached), len(seq) - keep)
    if seq[:limit] == cached[:limit]:
        return limit
    return next(i for i in range(limit) if cached[i] != seq[i])


class Batch:
    """Rows decoding together over one target (and optionally one draft); see the module doc."""

    def __init__(self, target: LM, draft: LM | None = None, in_step: bool = True, prefix_caching: bool = True):
        self.target, self.draft, self.in_step, self.prefix_caching = target, draft, in_step, prefix_caching
        self.models = [m for m in (target, draft) if m is not None]
        self.caches = {id(m): SlotCache(m.model.config, next(m.model.parameters()).dtype, m.device)
                       for m in self.models}
        self.rows: list[Row] = []
        self.joined_in_step = 0  # rows whose target prompt was computed inside a step (``joins_in_step``)
        self.reused_prompt_tokens = 0  # target prompt tokens a joining row took from another row's keys
        self._prefilled: tuple[list[int], dict[int, Any]] | None = None  # the last prompt prefilled, per model
        self._left: dict[int, tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]] = {}  # see ``_keep_left``

    def cache_bytes(self) -> int:
        """Bytes the batch's KV caches hold now (every model, allocated capacity included)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for c in self.caches.values() for layer in c.layers)

    def check(self, request: Request) -> None:
        """Raise a UsageError if the request cannot run here (empty prompt, too long for a model)."""
        check_fits(request.prompt_ids, request.max_new_tokens, *self.models)

    def joins_in_step(self, m: LM, request: Request) -> bool:
        """Whether a row's prompt is computed inside the next step's forward of ``m`` (with the other rows'
        tokens, its padding skipped: ``forward.Ragged``) rather than prefilled alone: where that gives the
        numbers of the prompt prefilled alone, bit for bit. That needs ``m``'s lean forward (whose linears
        give a row the same numbers in any block, ``packing.exact_row_limit``) and every query attended by the
        compiled kernel, over exactly its keys (bfloat16's float32 attention, blocks up to ``KERNEL_ROWS``).
        Not for a batch made with ``in_step`` False: rollouts, whose rows share one prefix's prefill."""
        return self.token_exact(m) and len(request.prompt_ids) + request.gamma <= KERNEL_ROWS

    def token_exact(self, m: LM) -> bool:
        """Whether ``m`` computes each token's keys with the same numbers whatever else a forward computes (see
        :meth:`joins_in_step`), so that a row may also take the keys of a prefix it shares with another row
        instead of computing them (:meth:`_shared_prefix`)."""
        return (self.in_step and runs_lean(m.model) and query_attention.enabled()
                and getattr(m.model.config, "_attn_implementation", None) == FLOAT32_ATTENTION)

    def add(self, request: Request) -> Row:
        """Admit a row. Its prompt (all but the last token) is computed inside the next step where that is
        exact (:meth:`joins_in_step`: the prompt then shares that forward's reading of the weights with the
        other rows, as vLLM's chunked prefill does), else prefilled alone and copied into the batch. Rows whose
        prompts share everything but the last token (N rollouts from one prefix) share one prefill. A prompt
        computed inside a step first takes the keys of the longest start it shares with a row in the batch or
        the last row that left (a system prompt, an earlier turn: vLLM's automatic prefix caching), where
        the model computes every token alike (:meth:`token_exact`); its stats count them as
        ``cached_prompt_tokens``."""
        self.check(request)
        row = Row(request, self.target)
        prompt = request.prompt_ids
        start = time.perf_counter()
        forward_before = sum(m.forward_s for m in self.models)
        alone = [m for m in self.models if len(prompt) > 1 and not self.joins_in_step(m, request)]
        if self._prefilled is None or self._prefilled[0] != prompt[:-1] or any(
                id(m) not in self._prefilled[1] for m in alone):
            prefills = {}
            for m in alone:
                m.reset()
                m.forward(prompt[:-1], keep_logits=0)
                prefills[id(m)] = m.cache
                m.cache, m.cached_ids = None, []  # the batch holds the keys now
            self._prefilled = (list(prompt[:-1]), prefills)
        self.joined_in_step += len(prompt) > 1 and not any(self.target is a for a in alone)
        row.stats["cached_prompt_tokens"] = 0
        for m in self.models:
            if any(m is a for a in alone):
                source, length = self._prefilled[1][id(m)], len(prompt) - 1
            else:
                source, length = self._shared_prefix(m, prompt[:-1])
                if m is self.target:
                    self.reused_prompt_tokens += length
                    row.stats["cached_prompt_tokens"] = length
            self.caches[id(m)].add_row(source, length)
            row.cached[id(m)] = list(prompt[:length])
        row.stats["prefill_s"] = time.perf_counter() - start
        row.stats["prefill_forward_s"] = sum(m.forward_s for m in self.models) - forward_before
        self.rows.append(row)
        return row

    def decode(self, requests: list[Request], max_batch: int = 8) -> list[Generation]:
        """Decode ``requests`` here, at most ``max_batch`` rows at a time (see :func:`decode_many`)."""
        for r in requests:
            self.check(r)
        results: dict[int, Generation] = {}
        order = {id(r): i for i, r in enumerate(requests)}
        waiting = list(requests)
        while waiting or self.rows:
            while waiting and len(self.rows) < max_batch:
                self.add(waiting.pop(0))
            for row, gen in self.step():
                results[order[id(row.request)]] = gen
        return [results[i] for i in range(len(requests))]

    def step(self) -> list[tuple[Row, Generation]]:
        """One speculative step for every row; returns the rows that finished, with their generations."""
        rows = self.rows
        if not rows:
            return []
        t0 = time.perf_counter()
        forward_before = sum(m.forward_s for m in self.models)
        gammas = [row.gamma(self.draft is not None) for row in rows]
        proposals = self._propose(gammas)
        t1 = time.perf_counter()
        drafts = [p.tokens if p else [] for p in proposals]
        layers = {row.policy.hidden_layer for row, d in zip(rows, drafts, strict=True) if d} - {None}
        seqs = [row.seq + d for row, d in zip(rows, drafts, strict=True)]
        outputs, hidden = self._forward(self.target, seqs, [len(d) + 1 for d in drafts], layers)
        t2 = time.perf_counter()
        forward_s = sum(m.forward_s for m in self.models) - forward_before
        done = []
        for row, proposal, d, logits, h in zip(rows, proposals, drafts, outputs, hidden, strict=True):
            logits = fit_vocab(logits, self.target.vocab_size)
            self._finish_step(row, proposal, d, logits, h, t1 - t0, t2 - t1, forward_s)
            if row.stop is not None or len(row.new) >= row.request.max_new_tokens:
                done.append(row)
        self._prefilled = None  # a step boundary: the next row's prefill is its own (it holds memory otherwise)
        if done:
            self._keep_left(rows.index(done[-1]))
            keep = compacted(len(rows), {b for b, row in enumerate(rows) if row in done})
            for cache in self.caches.values():
                cache.keep_rows(keep)
            self.rows = [rows[b] for b in keep]
        return [(row, row.generation(self.target.tokenizer)) for row in done]

    def _finish_step(self, row: Row, proposal: Proposal | None, drafts: list[int], logits: torch.Tensor,
                     hidden: dict[int, torch.Tensor], draft_s: float, target_s: float,
                     forward_s: float) -> None:
        """Verify one row's drafts, pick its next token and emit, as ``loop.generate`` does for batch 1."""
        stats, cfg = row.stats, row.request.cfg
        stats["draft_s"] += draft_s if drafts else 0.0
        stats["target_s"] += target_s
        stats["forward_s"] += forward_s
        stats["target_forwards"] += 1
        stats["draft_forwards"] += len(drafts)
        stats["drafted"] += len(drafts)
        v, n_kept = None, 0
        if drafts:
            start = time.perf_counter()
            def context(row: Row = row) -> Context:
                return Context.of(row.request.sources + [source for _, source in row.trace])

            v, kept = verify(proposal, logits, hidden.get(row.policy.hidden_layer), row.policy, cfg, row.generator,
                             context)
            stats["policy_s"] += time.perf_counter() - start
            n_kept = int(kept.long().cumprod(0).sum())
        last = next_token(logits, v, n_kept, cfg, row.generator, residual)
        step_start = len(row.trace)
        for token, source in step_tokens(drafts, v, n_kept, last, self.draft is not None and row.request.speculate):
            row.seq.append(token)
            row.new.append(token)
            row.trace.append((token, source))
            stats[source] += 1
            row.stop = row.stopper.reason(row.new)
            if row.stop:
                break
        on_step = row.request.on_step
        if on_step is not None and on_step(row.trace[step_start:]) is False and row.stop is None:
            row.stop = "cancelled"

    def _shared_prefix(self, m: LM, ids: list[int]) -> tuple[Any, int]:
        """Where ``m``'s keys of the longest start of ``ids`` already are, and its length: a row of the batch
        (its index) or the last row that left (its kept keys and values); (None, 0) where nothing is shared or
        the keys would not be the ones ``ids`` computed alone (:meth:`token_exact`), or the batch was made with
        ``prefix_caching`` False."""
        if not (self.prefix_caching and self.token_exact(m)):
            return None, 0
        sources = [(b, row.cached[id(m)]) for b, row in enumerate(self.rows)]
        sources += [self._left[id(m)]] if id(m) in self._left else []
        best, length = None, 0
        for source, cached in sources:
            n = _common_prefix(cached, ids, 0)
            if n > length:
                best, length = source, n
        return best, length

    def _keep_left(self, b: int) -> None:
        """Keep a copy of the keys of row ``b``, which is leaving, for a later row that starts as it did: the
        server's requests share a system prompt, and with one row at a time none is in the batch when the next
        joins. One row's worth of keys per model (its valid positions)."""
        for m in self.models:
            if self.prefix_caching and self.token_exact(m):
                ids = list(self.rows[b].cached[id(m)])
                self._left[id(m)] = (self.caches[id(m)].row_keys(b, len(ids)), ids)

    def _propose(self, gammas: list[int]) -> list[Proposal | None]:
        """Every drafting row's proposal: draft position j of all rows in one forward."""
        draft = self.draft
        if draft is None or not any(gammas):
            return [None] * len(self.rows)
        vocab = self.target.vocab_size

        def to_full(logits: torch.Tensor) -> torch.Tensor:
            return fit_vocab(draft.full_vocab(logits), vocab)

        tokens: list[list[int]] = [[] for _ in self.rows]
        native: list[list[torch.Tensor]] = [[] for _ in self.rows]
        qs: list[list[torch.Tensor]] = [[] for _ in self.rows]
        drafting = {b for b, g in enumerate(gammas) if g > 0}
        while drafting:
            seqs = [row.seq + tokens[b] if b in drafting else None for b, row in enumerate(self.rows)]
            outputs, _ = self._forward(draft, seqs, [1] * len(seqs), set(), full_vocab=False)
            for b in sorted(drafting):
                row, logits = self.rows[b], outputs[b]
                native[b].append(logits[0])
                if row.request.cfg.greedy:
                    token = draft.greedy_token(logits[0], vocab)
                else:
                    q = logits_to_probs(to_full(logits), row.request.cfg)
                    qs[b].append(q[0])
                    token = int(sample(q, row.generator)[0])
                tokens[b].append(token)
                if token in row.stopper.eos or len(tokens[b]) >= gammas[b]:
                    drafting.discard(b)
        return [Proposal(tokens[b], torch.stack(native[b]), torch.stack(qs[b]) if qs[b] else None, to_full)
                if tokens[b] else None for b in range(len(self.rows))]

    @torch.inference_mode()
    def _forward(self, lm: LM, seqs: list[list[int] | None], keep: list[int], layers: set[int],
                 full_vocab: bool = True) -> tuple[list[torch.Tensor | None], list[dict[int, torch.Tensor]]]:
        """One forward of ``lm`` over every row: row b's cache is made to hold ``seqs[b]`` (rolled back to the
        longest prefix it shares, then fed the rest); returns the float32 logits of its last ``keep[b]``
        positions and, per row, the hidden states there after each block in ``layers``. A row whose seq is
        None is fed padding only and gets None."""
        cache = self.caches[id(lm)]
        feeds: list[list[int]] = []
        for b, (row, seq) in enumerate(zip(self.rows, seqs, strict=True)):
            if seq is None:
                feeds.append([])
                continue
            cached = row.cached[id(lm)]
            common = _common_prefix(cached, seq, keep[b])
            del cached[common:]
            cache.lengths[b] = common
            feeds.append(seq[common:])
        width = max(len(f) for f in feeds)
        pad = [max(0, width - len(f)) for f in feeds]
        ids = torch.tensor([f + [0] * p for f, p in zip(feeds, pad, strict=True)], device=lm.device)
        dtype = next(lm.model.parameters()).dtype
        # The lean forward skips the padding (a joining row's prompt makes the others' long): it is neither
        # computed nor written to the cache, and its queries see no key, so per-query attention skips them
        # too. Other forwards compute the padding as tokens.
        fed = [len(f) for f in feeds]
        sparse = sum(fed) <= RAGGED_SHARE * len(fed) * width  # a few rows of many tokens (a joining prompt)
        ragged = Ragged(fed, [keep[b] if f else 0 for b, f in enumerate(feeds)]) if sparse and runs_lean(lm.model) \
            else None
        if ragged is not None:
            cache.prepare(width, fed, ragged.tokens(width, lm.device))
        else:
            cache.prepare(width)
        masks = attention_masks(lm.model.config, cache.lengths, width, cache.span(width), lm.device, dtype,
                                fed if ragged else None)
        positions = torch.tensor(cache.lengths, device=lm.device)[:, None] + torch.arange(width, device=lm.device)
        synchronize(lm.device)
        start = time.perf_counter()
        out, captured = model_forward(lm.model, ids if lm.input_map is None else lm.input_map[ids], cache, keep=width,
                                      attention_mask=masks, position_ids=positions,
                                      layers=tuple(lm.resolve_layer(layer) for layer in layers), ragged=ragged)
        hidden_of = {layer: captured[lm.resolve_layer(layer)] for layer in layers}
        synchronize(lm.device)
        lm.forward_s += time.perf_counter() - start
        logits: list[torch.Tensor | None] = []
        hidden: list[dict[int, torch.Tensor]] = []
        offset = 0  # ragged outputs: each row's kept tokens, one row after another
        for b, (row, f) in enumerate(zip(self.rows, feeds, strict=True)):
            if ragged is not None:
                kept = slice(offset, offset + ragged.keep[b])
                offset += ragged.keep[b]
                rows = out[kept].float() if f else None
                hidden.append({layer: h[kept].float() for layer, h in hidden_of.items()} if f else {})
            else:
                kept = slice(len(f) - keep[b], len(f))  # the fed tokens are left-aligned, padding after them
                rows = out[b, kept].float() if f else None
                hidden.append({layer: h[b, kept].float() for layer, h in hidden_of.items()} if f else {})
            logits.append(lm.full_vocab(rows) if full_vocab and f else rows)
            row.cached[id(lm)].extend(f)
            cache.lengths[b] += len(f)
        return logits, hidden


def decode_many(target: LM, requests: list[Request], *, draft: LM | None = None, max_batch: int = 8,
                in_step: bool = True, prefix_caching: bool = True) -> list[Generation]:
    """Decode ``requests`` with at most ``max_batch`` rows at a time; a finished row's place goes to the next
    request at once. Returns the generations in the requests' order. ``in_step``: see ``Batch.joins_in_step``;
    ``prefix_caching``: see ``Batch.add``."""
    return Batch(target, draft, in_step, prefix_caching).decode(requests, max_batch)
