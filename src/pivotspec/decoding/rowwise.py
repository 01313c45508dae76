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

The same kernel reads int8 panels with a float32 scale per output (``--dtype int8``, ``packing.quantize``'s
weights): a quarter of the bytes, the inputs kept float32, each row still alone. On the same CPU the testbed
target's 1-token forward took 16.9 ms against 27.2 ms on PyTorch's int8 kernel and 25.2 ms on float32 panels
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


@functools.cache
def kernel(symbol: str = "linear") -> ctypes._CFuncPtr | None:
    """The compiled ``linear`` (float32 panels) or ``linear_int8`` function (built on first use), or None
    where it cannot be built here."""
    return compiled.load(SOURCE, symbol, _INT8_ARGS if symbol == "linear_int8" else _ARGS)


def available() -> bool:
    return kernel() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] as the kernel reads it: panels [ceil(out / 16), in, 16], each panel the next 16
    outputs' weights interleaved by input (the last panel zero-padded), float32, or int8 for int8 weights."""
    outputs, width = weight.shape
    panels = -(-outputs // PANEL)
    dtype = torch.int8 if weight.dtype == torch.int8 else torch.float32
    padded = weight.detach().new_zeros((panels * PANEL, width), dtype=dtype)
    padded[:outputs] = weight.detach()
    return padded.reshape(panels, PANEL, width).transpose(1, 2).contiguous()


def linear(flat: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, outputs: int,
           scales: torch.Tensor | None = None) -> torch.Tensor:
    """``flat @ W.T + bias`` for a float32 CPU ``flat`` [rows, in], ``W`` [outputs, in] packed by :func:`pack`
    (and ``bias`` [outputs]); int8 panels take ``scales`` [outputs], W being ``scales[:, None] * int8
    weights``. Check :func:`available` first."""
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, width = flat.shape
    quantized = panels.dtype == torch.int8
    if (flat.dtype != torch.float32 or panels.dtype not in (torch.float32, torch.int8) or panels.shape[1] != width
            or panels.shape[0] * PANEL < outputs or quantized != (scales is not None)
            or (quantized and (scales.dtype != torch.float32 or scales.numel() < outputs))):
        raise ValueError(f"rowwise.linear takes float32 [rows, {panels.shape[1]}] inputs and weights packed by "
                         f"rowwise.pack (int8 ones with float32 scales), got {flat.dtype} {tuple(flat.shape)}")
    out = torch.empty((rows, outputs), dtype=torch.float32)
    if rows:
        rest = (None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
        head = (flat.data_ptr(), rows, flat.stride(0), panels.data_ptr(), outputs, width)
        if quantized:
            kernel("linear_int8")(*head, scales.data_ptr(), *rest)
        else:
            kernel()(*head, *rest)
    return out
