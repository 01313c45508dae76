"""A float32 linear that computes each row alone, near the read bandwidth: the CPU fast path's kernel where
neither PyTorch's nor oneDNN's float32 kernels come close (a small C kernel, ``rowwise.c``, built once per
machine by ``compiled``, over weights packed once into panels by :func:`pack`).

Why: a decode step reads every weight once, so its floor is the weights' bytes over the read bandwidth. On a
2-core AMD EPYC with AVX2 only, the testbed target's linears (538 MB, every matrix distinct so that none stays
in cache; a scratch script, one run) took 16.6 ms at one row here against 28.2 ms oneDNN-packed (PyTorch's
``F.linear``, MKL, 43 ms in an earlier run), about the 18 ms it takes to read them; at 6 rows (SD's
verification at gamma 5) 28.8 against 61.9 ms. And it keeps the exactness promises by construction rather than
by measurement: an output's bits depend on its row and the weights alone (``rowwise.c``), so greedy SD equals
the target alone and batched rows equal rows alone at any number of rows. From about 50 rows on oneDNN catches
up (48 rows: 152 against 176 ms; 96 rows: 294 against 258), so :mod:`fastpath` weighs it by measurement like
every other path.

The same kernel reads bfloat16 panels (``--dtype bfloat16``; auto weighs it where the CPU has AVX512-BF16):
half of float32's bytes, each row's inputs rounded to bfloat16 and summed in pairs by AVX512-BF16's dot product
(twice the multiply-adds of an FMA an instruction; emulated, to the bit, elsewhere), everything around the
linears float32. On a 2-core AMD EPYC with AVX512-BF16 the testbed target's linears (a scratch script) took
9.3 ms at 1 row against 16.3 on float32 panels, 10.0 against 17.7 at 6 rows and 38 against 67 at 48. It also
reads int8 panels with a float32 scale per output (``--dtype int8``, ``packing.quantize``'s weights): a quarter
of the bytes, the inputs kept float32, each row still alone. On the AVX2 EPYC the testbed target's 1-token
forward took 16.9 ms on them against 27.2 ms on PyTorch's int8 kernel and 25.2 ms on float32 panels
(benchmarks/cpu_forwards.py).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pivotspec.decoding import compiled

SOURCE = Path(__file__).with_suffix(".c")
PANEL = 16  # outputs per panel, as rowwise.c's PANEL
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
# x, rows, x's row stride, panels, outputs, width, [scales,] bias, out, out's row stride, threads
_ARGS = [_POINTER, _SIZE, _SIZE, _POINTER, _SIZE, _SIZE, _POINTER, _POINTER, _SIZE, ctypes.c_int]
_INT8_ARGS = [*_ARGS[:6], _POINTER, *_ARGS[6:]]
_BF16_ARGS = [*_ARGS, ctypes.c_int]  # ..., threads, emulated
_SIGNATURES = {"linear": _ARGS, "linear_int8": _INT8_ARGS, "linear_bf16": _BF16_ARGS, "native_bf16": []}


@functools.cache
def kernel(symbol: str = "linear") -> ctypes._CFuncPtr | None:
    """The compiled ``linear`` (float32 panels), ``linear_int8``, ``linear_bf16`` or ``native_bf16`` function
    (built on first use), or None where it cannot be built here."""
    return compiled.load(SOURCE, symbol, _SIGNATURES[symbol])


def checked(status: int) -> None:
    """Raise where a kernel call returned non-zero: it could not allocate the buffer its bfloat16 inputs are
    rounded into (rows x inputs x 2 bytes), and wrote nothing."""
    if status:
        raise MemoryError("the row-wise kernel could not allocate its bfloat16 inputs' buffer; "
                          "decode fewer rows at once (a smaller --batch-size or --max-batch)")


def available() -> bool:
    return kernel() is not None


def native_bf16() -> bool:
    """Whether bfloat16 panels run on AVX512-BF16's instructions here (else on their emulation: the same
    numbers; built for AVX2 it ran 1.5-1.7x faster than float32 panels at 1 and 6 rows and 0.77x at 48,
    benchmarks/README.md)."""
    return available() and bool(kernel("native_bf16")())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] as the kernel reads it: panels [ceil(out / 16), in, 16], each panel the next 16
    outputs' weights interleaved by input (the last panel zero-padded), float32, or int8 for int8 weights. A
    bfloat16 weight goes in panels [ceil(out / 16), ceil(in / 2), 16, 2]: inputs 2i and 2i + 1 side by side for
    each output (the odd tail's partner zero), subnormals as zero (AVX512-BF16 reads them so)."""
    outputs, width = weight.shape
    panels = -(-outputs // PANEL)
    dtype = weight.dtype if weight.dtype in (torch.int8, torch.bfloat16) else torch.float32
    if dtype == torch.bfloat16:
        w = weight.detach()
        w = torch.where(w.float().abs() < torch.finfo(torch.bfloat16).tiny, torch.zeros_like(w), w)
        padded = w.new_zeros((panels * PANEL, width + width % 2))
        padded[:outputs, :width] = w
        return padded.reshape(panels, PANEL, -1, 2).transpose(1, 2).contiguous()
    padded = weight.detach().new_zeros((panels * PANEL, width), dtype=dtype)
    padded[:outputs] = weight.detach()
    return padded.reshape(panels, PANEL, width).transpose(1, 2).contiguous()


def linear(flat: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, outputs: int,
           scales: torch.Tensor | None = None, emulated: bool = False) -> torch.Tensor:
    """``flat @ W.T + bias`` for a float32 CPU ``flat`` [rows, in], ``W`` [outputs, in] packed by :func:`pack`
    (and ``bias`` [outputs]); int8 panels take ``scales`` [outputs], W being ``scales[:, None] * int8
    weights``; bfloat16 panels round ``flat`` to bfloat16 (``emulated``: without AVX512-BF16's instructions
    even where they run, the reference the tests hold them to). Check :func:`available` first."""
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, width = flat.shape
    quantized = panels.dtype == torch.int8
    steps = -(-width // 2) if panels.dtype == torch.bfloat16 else width  # bfloat16 panels hold pairs of inputs
    if (flat.dtype != torch.float32 or panels.dtype not in (torch.float32, torch.int8, torch.bfloat16)
            or panels.shape[1] != steps or panels.shape[0] * PANEL < outputs or quantized != (scales is not None)
            or (quantized and (scales.dtype != torch.float32 or scales.numel() < outputs))):
        fits = (f"{2 * panels.shape[1] - 1} or {2 * panels.shape[1]}" if panels.dtype == torch.bfloat16
                else panels.shape[1])
        raise ValueError(f"rowwise.linear takes float32 [rows, {fits}] inputs and weights packed by "
                         f"rowwise.pack (int8 ones with float32 scales), got {flat.dtype} {tuple(flat.shape)}")
    out = torch.empty((rows, outputs), dtype=torch.float32)
    if rows:
        rest = (None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
        head = (flat.data_ptr(), rows, flat.stride(0), panels.data_ptr(), outputs, width)
        if quantized:
            checked(kernel("linear_int8")(*head, scales.data_ptr(), *rest))
        elif panels.dtype == torch.bfloat16:
            checked(kernel("linear_bf16")(*head, *rest, int(emulated)))
        else:
            checked(kernel()(*head, *rest))
    return out
