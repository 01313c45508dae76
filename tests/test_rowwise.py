"""The row-wise float32 linear (``decoding/rowwise.c``): it computes the linear, and each row gets the same bits
whatever shares its call (rows, widths, threads), which is what keeps greedy SD equal to the target alone and
batched rows equal to rows alone on the path that uses it (decoded on it: ``test_fastpath``'s exactness tests)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pivotspec.decoding import rowwise

pytestmark = pytest.mark.skipif(not rowwise.available(), reason="no C compiler to build the row-wise kernel")


@pytest.mark.parametrize("rows,width,outputs,bias", [(7, 70, 100, True), (3, 576, 1536, False), (1, 5, 3, True),
                                                     (40, 64, 49, False)])
def test_it_computes_the_linear(rows, width, outputs, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=gen)
    w = torch.randn(outputs, width, generator=gen)
    b = torch.randn(outputs, generator=gen) if bias else None
    got, ref = rowwise.linear(x, rowwise.pack(w), b, outputs), F.linear(x, w, b)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())  # float32 rounding apart
    strided = torch.randn(rows, 2 * width, generator=gen)[:, ::2]  # not contiguous: copied first
    panels = rowwise.pack(w)
    assert torch.equal(rowwise.linear(strided, panels, b, outputs), rowwise.linear(strided.contiguous(), panels, b,
                                                                                    outputs))


def test_each_row_gets_its_bits_whatever_shares_the_call():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 200, generator=gen)  # 200: whole vectors and a tail on every lane width
    w = torch.randn(301, 200, generator=gen)  # 301: panels, groups and tiles end part-way
    b = torch.randn(301, generator=gen)
    panels = rowwise.pack(w)
    full = rowwise.linear(x, panels, b, 301)
    for start, size in [(0, 1), (5, 1), (49, 1), (0, 2), (3, 3), (7, 4), (10, 6), (11, 13), (0, 49)]:
        got = rowwise.linear(x[start:start + size], panels, b, 301)
        assert torch.equal(got, full[start:start + size]), (start, size)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(rowwise.linear(x, panels, b, 301), full)
        assert torch.equal(rowwise.linear(x[7:8], panels, b, 301), full[7:8])
    finally:
        torch.set_num_threads(threads)
    # a weight's rows in another grouping (a fused q/k/v matrix and its members) give each output its bits
    assert torch.equal(rowwise.linear(x, rowwise.pack(w[96:250]), b[96:250], 154), full[:, 96:250])


def test_bad_input_is_refused():
    panels = rowwise.pack(torch.randn(4, 8))
    with pytest.raises(ValueError, match="float32"):
        rowwise.linear(torch.randn(2, 8, dtype=torch.bfloat16), panels, None, 4)
    with pytest.raises(ValueError, match="float32"):
        rowwise.linear(torch.randn(2, 9), panels, None, 4)
    with pytest.raises(ValueError, match="rowwise.pack"):
        rowwise.linear(torch.randn(2, 8), panels, None, 17)
