"""Attention in float32, each query over exactly its keys, for models whose weights run in bfloat16 on a CPU:
what keeps greedy SD equal to the target alone and batched rows equal to rows decoded alone within that dtype
(see :func:`sdpa_in_float32`). The queries of a layer go to the compiled kernel of ``query_attention`` in one
call where it is built, else to PyTorch's SDPA one call per query. Part of the CPU fast path (``fastpath``),
apart because it owns one idea."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pivotspec.decoding import query_attention

FLOAT32_ATTENTION = "pivotspec_sdpa_float32"
VERIFY_ROWS = 16  # blocks up to this wide (gamma + 1) attend one query at a time, where the kernel is not built
KERNEL_ROWS = 256  # blocks up to this wide go to the kernel where it is (wider prefills: PyTorch's attention whole)


_last: tuple = (None, None)  # the mask whose counts were read last, and its counts: every layer passes the same


def key_counts(mask: torch.Tensor | None, rows: int, width: int, total: int) -> list[list[int]] | None:
    """How many leading keys each query of a block sees, when every query sees a prefix of the keys (full
    attention over a single sequence's cache or over the batch's slot cache); None otherwise (a sliding
    window, a float mask), where attention goes through SDPA whole. Read once per mask (it took 0.1 ms a
    layer for a batch with a joining prompt)."""
    global _last
    last = _last  # one read: a pair another thread replaces whole
    if mask is not None and mask is last[0]:
        return last[1]
    counts = _key_counts(mask, rows, width, total)
    if mask is not None:
        _last = (mask, counts)
    return counts


def _key_counts(mask: torch.Tensor | None, rows: int, width: int, total: int) -> list[list[int]] | None:
    if mask is None:
        return [[total - width + i + 1 for i in range(width)]] * rows
    if mask.dtype != torch.bool or mask.shape[1] != 1:
        return None
    visible = mask[:, 0]
    counts = visible.sum(-1)
    if not torch.equal(visible.int().cummin(-1).values.sum(-1), counts):  # something after a hidden key
        return None
    return counts.tolist()


def sdpa_in_float32(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention computed in float32 and returned in the model's dtype, each query over
    exactly the keys it sees.

    Why: PyTorch's CPU attention sums a row over all the keys of the call, masked ones included, so a query
    computed beside later ones (SD's verification) or beside longer rows (a batch) was summed in another
    order than the same query alone (the target's decode step). In float32 that is about 1e-7; in bfloat16
    it moved a row by a whole bfloat16 step, and greedy SD, and batched rows, parted from the target alone
    at near-ties (measured on the tiny test models and the testbed). Float32 makes the step rare, and
    computing each query over exactly its keys makes every row the lone decode step's own computation, bit
    for bit. Where the kernel of ``query_attention`` runs, it takes every block up to ``KERNEL_ROWS`` wide in
    one call per layer: the lone decode step's single query, a verification, a batch's step, and a prompt's
    prefill, so that a prompt computed inside a batch's step (``batch.Batch``) gets the numbers of the same
    prompt prefilled alone. A query that sees no key (a batch row's padding) gets zeros. Else each query of a
    short block (up to ``VERIFY_ROWS``, over a cache) is one call of PyTorch's SDPA (a lone step's single
    query with no mask goes whole, which is the same call). Wider blocks and sliding windows go whole."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    rows, width, total = query.shape[0], query.shape[-2], key.shape[-2]
    window = kwargs.get("sliding_window") is not None
    by_kernel = width <= KERNEL_ROWS and not window and query_attention.enabled()
    per_query = width <= VERIFY_ROWS and total > width and not window
    counts = key_counts(attention_mask, rows, width, total) if by_kernel or per_query else None
    if (counts is not None and by_kernel and plain_call(module, key, value, args, kwargs)
            and query_attention.supports(query, key)):
        out = query_attention.attend(query.float(), key, value, counts, scale_of(module, query, kwargs))
        return out.to(dtype), None
    q, k, v = query.float(), key.float(), value.float()
    # Without a mask: one sequence verifying a block. (Rollouts of one prefix also come without a mask, one
    # token wide: they go whole, as nothing compares them with batch 1.) With one: the batch's rows.
    if attention_mask is None and width == 1:
        counts = None
    if counts is not None and per_query:  # one call per query over exactly its keys
        one = one_query(module, k, v, args, kwargs)
        out = torch.cat([torch.cat([one(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n]) if n
                                    else q.new_zeros((1, q.shape[1], 1, q.shape[-1]))
                                    for i, n in enumerate(counts[b])], dim=2) for b in range(rows)])
        return out.transpose(1, 2).contiguous().to(dtype), None
    mask = attention_mask
    if mask is not None and mask.is_floating_point():
        mask = mask.float()
    out, weights = sdpa_attention_forward(module, q, k, v, mask, *args, **kwargs)
    return out.to(dtype), weights


def plain_call(module: nn.Module, key: torch.Tensor, value: torch.Tensor, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether transformers' SDPA attention would end in a plain call of PyTorch's SDPA: no extra arguments, no
    dropout, and grouped-query heads that SDPA takes as they are (heads up to 256 wide)."""
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    groups = getattr(module, "num_key_value_groups", 1)
    return (not args and set(kwargs) <= {"scaling", "dropout", "sliding_window"} and not kwargs.get("dropout")
            and (groups == 1 or use_gqa_in_sdpa(None, key, value)))


def scale_of(module: nn.Module, query: torch.Tensor, kwargs: dict[str, Any]) -> float:
    """The factor scores are scaled by: the layer's, else SDPA's default 1 / sqrt(head width)."""
    scale = kwargs.get("scaling", getattr(module, "scaling", None))
    return float(scale) if scale is not None else query.shape[-1] ** -0.5


def one_query(module: nn.Module, key: torch.Tensor, value: torch.Tensor, args: tuple,
              kwargs: dict[str, Any]) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The attention of one query over keys it all sees ([1, heads, 1, head_dim] out), as transformers' SDPA
    attention computes it with no mask and ``is_causal`` off. Where that ends in a plain call of PyTorch's
    SDPA (:func:`plain_call`), it is called directly: the same op on the same inputs, so the same numbers,
    without the wrapper's checks and reshapes, which took 0.38 of 4.6 s of a batch of 8 PAD rows on the
    testbed (cProfile; 38,720 such calls)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if plain_call(module, key, value, args, kwargs):
        options = {"dropout_p": kwargs.get("dropout", 0.0), "scale": kwargs.get("scaling"),
                   "enable_gqa": getattr(module, "num_key_value_groups", 1) > 1}
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **options)
    call = {**kwargs, "is_causal": False}
    return lambda q, k, v: sdpa_attention_forward(module, q, k, v, None, *args, **call)[0].transpose(1, 2)


def attention_in_float32(model: nn.Module) -> None:
    """Make a model's attention go through :func:`sdpa_in_float32` (its masks stay SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FLOAT32_ATTENTION, sdpa_in_float32)
    AttentionMaskInterface.register(FLOAT32_ATTENTION, sdpa_mask)
    for config in {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c}.values():
        config._attn_implementation = FLOAT32_ATTENTION
