"""The KV cache of a batch of sequences that advance by different amounts, and its attention masks.

Row b's token at position p lives in column p of row b (right padding): a row's valid length is all it
needs, so rolling back rejected drafts is lowering a number, and each forward writes every row's new tokens
at that row's own columns (``SlotCache.plan``). Columns past a row's length hold stale or padding keys;
the mask is causal over positions (column c is visible from position p when c <= p, and c > p - window in
a sliding-window layer), so a query never sees them: the columns below its own position are either the
row's valid prefix or this forward's new tokens, which are written before attention reads them.

Rows join by copying a batch-1 prefill into the next free row (so the prompt is computed exactly as batch 1
computes it), or, when their prompt is computed inside a step, with nothing cached or with the keys of a start
they share with another row (``batch.Batch.add``); a leaving row's place goes
to the last row (``compacted``). Both happen at step boundaries only. The buffers hold spare rows and columns
(each doubled when full), so a join or a leave reallocates nothing: on a batch of 8 arith rows, reallocating
every layer's keys and values at each join was 4% of the time (``cProfile``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's keys and values, buffers of [spare rows, heads, capacity, head dim] whose first
    ``len(cache.lengths)`` rows are the batch's; writes go where the cache's plan says."""

    def __init__(self, cache: SlotCache, empty: torch.Tensor):
        super().__init__()
        # A weak reference: a strong one makes a cycle (cache -> layer -> cache) that only a full garbage
        # collection frees, so a finished batch's buffers stayed allocated; the labeler's batches of 80 rollouts
        # grew by 1-2 GB every 15 s until the kernel killed it.
        self.owner = weakref.proxy(cache)
        self.keys, self.values = empty, empty.clone()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols, width = self.owner.plan(key_states.shape[-2])
        keys, values = key_states.transpose(1, 2), value_states.transpose(1, 2)  # [B, T, heads, dim]
        tokens = self.owner.tokens
        if tokens is not None:  # the tokens only: padding is never read, so it is not written
            rows, cols = rows.expand_as(cols).reshape(-1)[tokens], cols.reshape(-1)[tokens]
            keys, values = keys.flatten(0, 1)[tokens], values.flatten(0, 1)[tokens]
        # Advanced indices on dims 0 and 2 put their shape first: the target is [B, T, heads, dim] ([N, ...]).
        self.keys[rows, :, cols] = keys
        self.values[rows, :, cols] = values
        live = len(self.owner.lengths)
        return self.keys[:live, :, :width], self.values[:live, :, :width]


class SlotCache(DynamicCache):
    """The KV cache of one model for a batch: ``lengths[b]`` valid positions in row b."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(config=config)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        empty = torch.zeros((0, heads, 0, head_dim), dtype=dtype, device=device)
        self.layers = [SlotLayer(self, empty) for _ in range(config.num_hidden_layers)]
        self.lengths: list[int] = []
        self.fed: list[int] | None = None  # this forward's tokens per row, when the rest of its width is padding
        self.tokens: torch.Tensor | None = None  # where they are in the flattened [rows * width] input
        self._starts = torch.zeros(0, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[2]

    def plan(self, new: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Where a forward of ``new`` tokens per row writes: row indices [B, 1], columns [B, new], and how
        many columns attention reads (:meth:`span`)."""
        cols = self._starts[:, None] + torch.arange(new, device=self._starts.device)
        rows = torch.arange(len(self.lengths), device=self._starts.device)[:, None]
        return rows, cols, self.span(new)

    def span(self, new: int) -> int:
        """The columns a forward of ``new`` positions per row reaches: up to each row's last token (with
        ``fed``, its last real one; the padding is not written, so a long joining prompt does not stretch
        the rows beside it)."""
        fed = self.fed or [new] * len(self.lengths)
        return max(n + f for n, f in zip(self.lengths, fed, strict=True))

    def prepare(self, new: int, fed: list[int] | None = None, tokens: torch.Tensor | None = None) -> None:
        """Make room for ``new`` more positions in every row and fix this forward's write positions; ``fed``
        and ``tokens`` (``forward.Ragged``): the real tokens per row and where they are, when the rest is
        padding that is neither computed nor written."""
        self.fed, self.tokens = fed, tokens
        need = self.span(new)
        if need > self.capacity:
            self._resize(len(self.lengths), max(need, 2 * self.capacity, 64))
        self._starts = torch.tensor(self.lengths, device=self._starts.device)

    @torch.inference_mode()  # the buffers may be inference tensors (made inside a forward)
    def _resize(self, rows: int, capacity: int) -> None:
        """Make the buffers hold at least ``rows`` rows of ``capacity`` columns (zeros where new, so that no
        column ever holds a non-finite number a masked attention could turn into NaN)."""
        old_rows = self.layers[0].keys.shape[0]
        if rows <= old_rows and capacity <= self.capacity:
            return
        rows, capacity = max(rows, old_rows), max(capacity, self.capacity)
        live = len(self.lengths)
        for layer in self.layers:
            for part in ("keys", "values"):
                old = getattr(layer, part)
                new = old.new_zeros((rows, old.shape[1], capacity, old.shape[3]))
                new[:live, :, : old.shape[2]] = old[:live]
                setattr(layer, part, new)

    @torch.inference_mode()
    def add_row(self, source: Any, length: int) -> None:
        """Append a row holding the first ``length`` positions of ``source``: a batch-1 HF cache (a prefill),
        the index of a row of this cache, or a row's keys and values as :meth:`row_keys` kept them (None, with
        length 0, when nothing is cached yet). Its buffer row may hold a departed row's keys: they lie past
        ``length``, where no query looks."""
        live, rows = len(self.lengths), self.layers[0].keys.shape[0]
        self._resize(rows if live < rows else max(2 * live, 1), max(length + 1, self.capacity, 64))
        if length:
            for i, layer in enumerate(self.layers):
                if isinstance(source, int):
                    keys, values = layer.keys[source], layer.values[source]
                elif isinstance(source, list):
                    keys, values = source[i]
                else:
                    keys, values = source.layers[i].keys[0], source.layers[i].values[0]
                layer.keys[live, :, :length] = keys[:, :length]
                layer.values[live, :, :length] = values[:, :length]
        self.lengths.append(length)

    @torch.inference_mode()
    def row_keys(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of row ``row``'s keys and values at its first ``length`` positions, per layer."""
        return [(layer.keys[row, :, :length].clone(), layer.values[row, :, :length].clone()) for layer in self.layers]

    @torch.inference_mode()
    def keep_rows(self, keep: list[int]) -> None:
        """Drop every row not in ``keep`` (row indices, in their new order; :func:`compacted` gives the order
        that moves fewest rows). A moved row copies only the columns it uses."""
        moved = [(new, old) for new, old in enumerate(keep) if new != old]
        if moved:
            to = torch.tensor([n for n, _ in moved], dtype=torch.long, device=self._starts.device)
            source = torch.tensor([o for _, o in moved], dtype=torch.long, device=self._starts.device)
            used = max(self.lengths[o] for _, o in moved)
            for layer in self.layers:  # gathered first: a source may be another move's target
                layer.keys[to, :, :used] = layer.keys[source, :, :used]
                layer.values[to, :, :used] = layer.values[source, :, :used]
        self.lengths = [self.lengths[i] for i in keep]


def compacted(rows: int, leaving: set[int]) -> list[int]:
    """The rows that stay, as ``SlotCache.keep_rows`` takes them: each stays where it is, except that the
    last ones fill the places of leaving rows before them, so a leave copies at most one row per row that
    left (vLLM's input batch condenses the same way) rather than shifting every row behind it."""
    count = rows - len(leaving)
    tail = [b for b in range(count, rows) if b not in leaving]
    return [b if b not in leaving else tail.pop(0) for b in range(count)]

def layer_kinds(config: Any) -> list[str]:
    """The attention kinds a model's layers use: HF's ``layer_types``, else one kind for every layer."""
    types = getattr(config, "layer_types", None)
    if types:
        return sorted(set(types))
    return ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"]


def attention_masks(config: Any, starts: list[int], new: int, width: int, device: torch.device,
                    dtype: torch.dtype, fed: list[int] | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """[rows, 1, new, width] masks for a forward of ``new`` tokens per row written at ``starts``: a tensor
    when every layer has one kind of attention, else one per kind keyed as HF's mask mappings are. With
    ``fed`` (the real tokens of each row, the rest padding), a padding query sees no key, so that attention
    that computes each query over exactly its keys (``attention.sdpa_in_float32``) skips it."""
    steps = torch.arange(new, device=device)
    pos = torch.tensor(starts, device=device)[:, None] + steps  # [B, T]
    cols = torch.arange(width, device=device)
    visible = cols[None, None, :] <= pos[:, :, None]
    if fed is not None:
        visible = visible & (steps[None, :] < torch.tensor(fed, device=device)[:, None])[:, :, None]
    kinds = layer_kinds(config)
    masks = {}
    for kind in kinds:
        mask = visible
        if kind == "sliding_attention":
            mask = visible & (cols[None, None, :] > pos[:, :, None] - int(config.sliding_window))
        mask = mask[:, None]
        if getattr(config, "_attn_implementation", "sdpa") == "eager":  # eager attention adds the mask
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
        masks[kind] = mask
    return masks[kinds[0]] if len(kinds) == 1 else masks
