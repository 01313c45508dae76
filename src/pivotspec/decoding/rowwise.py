"""A float32 linear that computes each row alone, near the read bandwidth: the CPU fast path's kernel where
neither PyTorch's nor oneDNN's float32 kernels come close (a small C kernel, ``rowwise.c``, built once per
machine by ``compiled``).

Why: a decode step reads every weight once, so its floor is the weights' bytes over the read bandwidth. On a
2-core AMD EPYC with AVX2 only, the testbed target's linears (538 MB) took 43 ms at one row through
PyTorch's ``F.linear`` (MKL), 33 ms oneDNN-packed and 22 ms here, against 19 ms to read them; at 6 rows (SD's
verification at gamma 5) 81, 67 and 41 ms (a scratch script, every matrix distinct so that none stays in
cache). And it keeps the exactness promises by construction rather than by measurement: an output's bits
depend on its row and the weights alone (``rowwise.c``), so greedy SD equals the target alone and batched rows
equal rows alone at any number of rows. It is slower than oneDNN from a few dozen rows on (48 rows: 176
against 146 ms there), so :mod:`fastpath` weighs it by measurement like every other path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pivotspec.decoding import compiled

SOURCE = Path(__file__).with_suffix(".c")
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:
    """The compiled ``linear`` function (built on first use), or None where it cannot be built here."""
    return compiled.load(SOURCE, "linear", _ARGS)


def available() -> bool:
    return kernel() is not None


def linear(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``flat @ weight.T + bias`` for a float32 CPU ``flat`` [rows, in] and contiguous ``weight`` [out, in]
    (and ``bias`` [out]); check :func:`available` first."""
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, width = flat.shape
    if weight.dtype != torch.float32 or flat.dtype != torch.float32 or weight.shape[1] != width:
        raise ValueError(f"rowwise.linear takes float32 [rows, {weight.shape[1]}] inputs, got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    out = torch.empty((rows, weight.shape[0]), dtype=torch.float32)
    if rows:
        kernel()(flat.data_ptr(), rows, flat.stride(0), weight.data_ptr(), weight.shape[0], width,
                 None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out
