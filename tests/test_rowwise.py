"""The row-wise linear (``decoding/rowwise.c``), over float32, int8 or bfloat16 weights: it computes the linear,
and each row gets the same bits whatever shares its call (rows, widths, threads), which is what keeps greedy SD equal to
the target alone and batched rows equal to rows alone on the path that uses it (decoded on it:
``test_exactness``)."""

from __future__ import annotations

import ctypes
import platform
import subprocess

import pytest
import torch
import torch.nn.functional as F

from pivotspec.decoding import compiled, rowwise
from pivotspec.decoding.machine import cpu_flags
from pivotspec.decoding.packing import quantize

pytestmark = pytest.mark.skipif(not rowwise.available(), reason="no C compiler to build the row-wise kernel")


KINDS = ["float32", "int8", "bfloat16"]


def held(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``w`` as the kernel takes it (panels, and scales for int8 ones) and the float32 weight that stands for:
    ``w`` itself, its int8 weights times their scales, or it rounded to bfloat16."""
    if kind == "float32":
        return rowwise.pack(w), None, w
    if kind == "bfloat16":
        return rowwise.pack(w.to(torch.bfloat16)), None, w.to(torch.bfloat16).float()
    q, scales = quantize(w)
    return rowwise.pack(q), scales.float(), q.float() * scales.float()[:, None]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,width,outputs,bias", [(7, 70, 100, True), (3, 576, 1536, False), (1, 5, 3, True),
                                                     (40, 64, 49, False)])
def test_it_computes_the_linear(rows, width, outputs, bias, kind):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=gen)
    w = torch.randn(outputs, width, generator=gen)
    b = torch.randn(outputs, generator=gen) if bias else None
    panels, scales, dense = held(w, kind)
    # bfloat16 panels round the inputs to bfloat16 (to nearest even, as PyTorch does)
    seen = x.to(torch.bfloat16).float() if kind == "bfloat16" else x
    got, ref = rowwise.linear(x, panels, b, outputs, scales), F.linear(seen, dense, b)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())  # float32 rounding apart
    strided = torch.randn(rows, 2 * width, generator=gen)[:, ::2]  # not contiguous: copied first
    assert torch.equal(rowwise.linear(strided, panels, b, outputs, scales),
                       rowwise.linear(strided.contiguous(), panels, b, outputs, scales))


@pytest.mark.parametrize("kind", KINDS)
def test_each_row_gets_its_bits_whatever_shares_the_call(kind):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 200, generator=gen)  # 200: whole vectors and a tail on every lane width
    w = torch.randn(301, 200, generator=gen)  # 301: panels, groups and tiles end part-way
    b = torch.randn(301, generator=gen)
    panels, scales, _ = held(w, kind)
    full = rowwise.linear(x, panels, b, 301, scales)
    for start, size in [(0, 1), (5, 1), (49, 1), (0, 2), (3, 3), (7, 4), (10, 6), (11, 13), (0, 49)]:
        got = rowwise.linear(x[start:start + size], panels, b, 301, scales)
        assert torch.equal(got, full[start:start + size]), (start, size)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(rowwise.linear(x, panels, b, 301, scales), full)
        assert torch.equal(rowwise.linear(x[7:8], panels, b, 301, scales), full[7:8])
    finally:
        torch.set_num_threads(threads)
    # a weight's rows in another grouping (a fused q/k/v matrix and its members) give each output its bits
    part_panels, part_scales, _ = held(w[96:250], kind)
    assert torch.equal(rowwise.linear(x, part_panels, b[96:250], 154, part_scales), full[:, 96:250])


@pytest.mark.skipif(not rowwise.native_bf16(), reason="the CPU has no AVX512-BF16 (or it is not compiled in)")
@pytest.mark.parametrize("rows,width", [(1, 576), (6, 77), (13, 1536)])
def test_avx512_bf16_computes_what_its_emulation_computes(rows, width):
    """The emulation (two fused multiply-adds a pair, the odd input first; rounding by bits) is what CPUs
    without AVX512-BF16 run: it must be the instruction's arithmetic, not an approximation of it."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(rows, width, generator=gen) * torch.logspace(-3, 3, width)  # wide exponents
    # every third input halfway between two bfloat16 (rounded to the even one), every seventh subnormal (zero)
    halves = x.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    x[:, ::3] = ((halves << 16) | 0x8000).to(torch.int32).view(torch.float32)[:, ::3]
    x[:, ::7] = 1e-39
    if rows > 1:
        x[-1] = -1e-39  # a row of subnormals alone: zeros, and a zero sum, where nothing else hides them
    w = torch.randn(300, width, generator=gen)
    panels = rowwise.pack(w.to(torch.bfloat16))
    native = rowwise.linear(x, panels, None, 300)
    assert torch.equal(native, rowwise.linear(x, panels, None, 300, emulated=True))
    assert not torch.equal(native, F.linear(x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()))
    # and its inputs are PyTorch's bfloat16, ties to even, but for the subnormals it flushes
    normal = x.clone()
    normal[:, ::7] = 0.0
    normal[-1] = 0.0 if rows > 1 else normal[-1]
    torch.testing.assert_close(native, F.linear(normal.to(torch.bfloat16).float(), w.to(torch.bfloat16).float()),
                               rtol=1e-5, atol=1e-5 * native.abs().max().item())


# instruction sets a bfloat16 linear may be built for, and the CPU flags running each needs
ISAS = {"haswell": {"avx2", "fma"}, "skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


@pytest.mark.skipif(platform.machine() != "x86_64" or compiled.compiler() is None, reason="x86-64 builds only")
@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_panels_give_the_same_bits_built_for_any_vector_width(tmp_path, isa):
    """The kernel built for AVX2 (8 lanes) or AVX-512 without BF16 (16 lanes, emulated) computes what this
    machine's build computes, AVX512-BF16's instruction included: a bfloat16 model's numbers do not depend on
    which x86 CPU it runs on."""
    if not ISAS[isa] <= cpu_flags():
        pytest.skip(f"this CPU cannot run {isa} code")
    library = tmp_path / f"rowwise-{isa}.so"
    flags = [f if f != "-march=native" else f"-march={isa}" for f in compiled.FLAGS]
    subprocess.run([compiled.compiler(), *flags, "-o", str(library), str(rowwise.SOURCE), "-lm"], check=True)
    other = ctypes.CDLL(str(library)).linear_bf16
    gen = torch.Generator().manual_seed(3)
    for rows, width, outputs in [(1, 576, 1536), (6, 77, 300), (13, 1536, 100)]:
        x = torch.randn(rows, width, generator=gen) * torch.logspace(-3, 3, width)
        panels = rowwise.pack(torch.randn(outputs, width, generator=gen).to(torch.bfloat16))
        out = torch.empty(rows, outputs)
        other(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(rows), ctypes.c_int64(width),
              ctypes.c_void_p(panels.data_ptr()), ctypes.c_int64(outputs), ctypes.c_int64(width), None,
              ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(outputs), ctypes.c_int(2), ctypes.c_int(0))
        assert torch.equal(out, rowwise.linear(x, panels, None, outputs)), (isa, rows, width)


def test_bad_input_is_refused():
    panels = rowwise.pack(torch.randn(4, 8))
    with pytest.raises(ValueError, match="float32"):
        rowwise.linear(torch.randn(2, 8, dtype=torch.bfloat16), panels, None, 4)
    with pytest.raises(ValueError, match="float32"):
        rowwise.linear(torch.randn(2, 9), panels, None, 4)
    with pytest.raises(ValueError, match="rowwise.pack"):
        rowwise.linear(torch.randn(2, 8), panels, None, 17)
    int8_panels, scales, _ = held(torch.randn(4, 8), "int8")
    for wrong in (None, scales.to(torch.bfloat16), scales[:3]):  # int8 panels need float32 scales, one an output
        with pytest.raises(ValueError, match="int8 ones with float32 scales"):
            rowwise.linear(torch.randn(2, 8), int8_panels, None, 4, wrong)
    with pytest.raises(ValueError, match="int8 ones with float32 scales"):
        rowwise.linear(torch.randn(2, 8), panels, None, 4, scales)  # float32 panels take none
    bf16_panels = rowwise.pack(torch.randn(4, 7).to(torch.bfloat16))  # 7 inputs, packed as 8
    assert rowwise.linear(torch.randn(2, 7), bf16_panels, None, 4).shape == (2, 4)
    with pytest.raises(ValueError, match="float32"):
        rowwise.linear(torch.randn(2, 9), bf16_panels, None, 4)


def test_a_buffer_it_cannot_allocate_raises_instead_of_returning_garbage(monkeypatch):
    """The bfloat16 call rounds its inputs into a buffer of rows x inputs x 2 bytes; where that malloc fails
    the kernel returns 1 before reading or writing anything, and every caller raises MemoryError."""
    panels = rowwise.pack(torch.randn(4, 16).to(torch.bfloat16))
    x, out = torch.randn(1, 16), torch.empty(1, 4)
    huge = 1 << 42  # 2^42 rows x 16 inputs x 2 bytes: a 128 TiB buffer, far past any RAM, so malloc fails
    status = rowwise.kernel("linear_bf16")(x.data_ptr(), huge, 16, panels.data_ptr(), 4, 16, None,
                                           out.data_ptr(), 4, 1, 0)
    assert status == 1
    monkeypatch.setattr(rowwise, "kernel", lambda symbol="linear": lambda *args: 1)
    with pytest.raises(MemoryError, match="fewer rows"):
        rowwise.linear(x, panels, None, 4)
