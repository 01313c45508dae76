"""The compiled per-query attention: PyTorch's attention to rounding, and each query the bits of its lone call
(the property that keeps greedy SD equal to the target alone and batched rows equal to rows alone)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from pivotspec.decoding import query_attention

built = pytest.mark.skipif(query_attention.kernel() is None, reason="no C compiler to build the kernel")
# key counts around the kernel's 16-key blocks: 1 key, a block less one, a block, a block and one, several, and
# around 256 keys, where the keys' transposed rows are 1 KiB apart (the blocked conversion, ``to_float``)
COUNTS = [[1, 2, 3], [15, 16, 17], [31, 32, 33], [64, 65, 66], [120, 121, 122], [255, 256, 257]]


def inputs(dtype: torch.dtype, dim: int = 64, heads: int = 9, kv_heads: int = 3, width: int = 3,
           counts: list[list[int]] = COUNTS, seed: int = 0):
    """Queries as the forward hands them (a transposed view), keys and values as prefix views of a cache with
    spare capacity, and per-query key counts."""
    gen = torch.Generator().manual_seed(seed)
    rows, total = len(counts), max(max(c) for c in counts) + 5
    q = torch.randn(rows, width, heads, dim, generator=gen).transpose(1, 2)
    k = (torch.randn(rows, kv_heads, 2 * total, dim, generator=gen) * 2).to(dtype)[:, :, :total]
    v = torch.randn(rows, kv_heads, 2 * total, dim, generator=gen).to(dtype)[:, :, :total]
    return q, k, v, counts


def test_the_kernel_builds_where_there_is_a_compiler():
    if shutil.which("cc") or shutil.which("gcc"):
        assert query_attention.kernel() is not None


@built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 8, 24])  # 16-wide chunks only, none, and a chunk with a tail
def test_it_computes_pytorchs_attention(dtype, dim):
    q, k, v, counts = inputs(dtype, dim)
    out = query_attention.attend(q, k, v, counts, 0.3)
    for b, row in enumerate(counts):
        for i, n in enumerate(row):
            ref = F.scaled_dot_product_attention(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, :n].float(),
                                                 v[b:b + 1, :, :n].float(), scale=0.3, enable_gqa=True)
            torch.testing.assert_close(out[b, i], ref[0, :, 0], atol=1e-5, rtol=1e-5)


@built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_query_gets_the_bits_of_its_lone_call_whatever_shares_the_call(dtype):
    q, k, v, counts = inputs(dtype)
    together = query_attention.attend(q, k, v, counts, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # how the work is split over threads must not matter either
        one_thread = query_attention.attend(q, k, v, counts, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for b, row in enumerate(counts):
        for i, n in enumerate(row):
            lone = query_attention.attend(q[b:b + 1, :, i:i + 1].contiguous(), k[b:b + 1, :, :n].contiguous(),
                                          v[b:b + 1, :, :n].contiguous(), [[n]], 0.125)
            assert torch.equal(lone[0, 0], together[b, i]), (b, i, n)


@built
def test_keys_past_a_querys_count_are_never_read():
    q, k, v, counts = inputs(torch.bfloat16)
    out = query_attention.attend(q, k, v, counts, 0.125)
    for b, row in enumerate(counts):  # spoil every key and value a row's queries do not see
        k[b, :, max(row):] = float("nan")
        v[b, :, max(row):] = float("inf")
    assert torch.equal(query_attention.attend(q, k, v, counts, 0.125), out)
    first = [[row[0]] * 3 for row in counts]  # all see as few keys as the first: those past them spoiled
    base = query_attention.attend(q, k, v, first, 0.125)
    for b, row in enumerate(counts):
        k[b, :, row[0]:] = float("nan")
    assert torch.equal(query_attention.attend(q, k, v, first, 0.125), base)


@built
def test_bad_key_counts_are_refused():
    q, k, v, counts = inputs(torch.float32)
    with pytest.raises(ValueError, match="key counts"):
        query_attention.attend(q, k, v, [row[:2] for row in counts], 0.125)
    with pytest.raises(ValueError, match="key counts"):
        query_attention.attend(q, k, v, [[-1, 1, 2]] * len(counts), 0.125)
    with pytest.raises(ValueError, match="key counts"):
        query_attention.attend(q, k, v, [[1, 2, k.shape[2] + 1]] * len(counts), 0.125)


def test_a_query_that_sees_no_key_gets_zeros_and_leaves_the_others_alone():
    """A batch row's padding queries see nothing (``slots.attention_masks`` with ``fed``): they cost nothing
    and give zeros, and every other query keeps its numbers."""
    q, k, v, counts = inputs(torch.bfloat16)
    out = query_attention.attend(q, k, v, counts, 0.125)
    hidden = [[0 if i == 1 else n for i, n in enumerate(row)] for row in counts]
    padded = query_attention.attend(q, k, v, hidden, 0.125)
    assert torch.equal(padded[:, 1], torch.zeros_like(padded[:, 1]))
    assert torch.equal(padded[:, 0], out[:, 0]) and torch.equal(padded[:, 2:], out[:, 2:])
