"""Attention in float32 of each query over exactly the keys it sees, all queries of a layer in one call of a
small C kernel (``query_attention.c``), compiled once per machine (``compiled``) and run on PyTorch's own
OpenMP threads.

Why: to keep greedy SD equal to the target alone, and batched rows equal to rows decoded alone, in bfloat16,
every query must be summed the way the lone decode step sums it (``attention.sdpa_in_float32``). With
PyTorch's attention that took one call per query: 1,440 calls per target step for 8 PAD rows at gamma 5,
about a quarter of a batched step (cProfile, benchmarks/README). The kernel computes each query in an order
that depends on nothing but that query's own keys, so one call per layer gives every query the lone step's
bits (measured on 8 rows x 6 queries x ~120 keys, an Intel Xeon with AMX: 0.31 ms a layer against 2.3-2.6 ms
for the per-query calls). Where no compiler is found, ``attention`` keeps PyTorch's per-query calls;
``$PIVOTSPEC_ATTENTION=torch`` asks for them (to compare). The two give numbers that differ at rounding, so
within one process all models use the same (:func:`enabled` is read once per process).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from pivotspec.decoding import compiled

SOURCE = Path(__file__).with_suffix(".c")
_ARGS = ([ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_int64] * 6
         + [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int])


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:
    """The compiled ``attend`` function (built on first use, ``compiled.load``), or None where it cannot be
    built here: attention then runs one PyTorch call per query."""
    return compiled.load(SOURCE, "attend", _ARGS)


@functools.cache
def enabled() -> bool:
    """Whether this process attends with the kernel (read once, so that every model in it sums alike)."""
    choice = os.environ.get("PIVOTSPEC_ATTENTION", "kernel")
    if choice not in ("kernel", "torch"):
        from pivotspec.errors import UsageError

        raise UsageError(f"PIVOTSPEC_ATTENTION={choice!r}: use kernel (the default) or torch")
    return choice == "kernel" and kernel() is not None


def supports(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel computes these: CPU tensors, float32 or bfloat16 keys, whole groups of query heads per
    key head, each head's vector contiguous."""
    return (enabled() and query.device.type == "cpu" and query.is_floating_point()
            and key.dtype in (torch.float32, torch.bfloat16)
            and query.shape[1] % key.shape[1] == 0 and query.stride(-1) == 1 and key.stride(-1) == 1)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, counts: list[list[int]],
           scale: float) -> torch.Tensor:
    """Each query's attention over its first ``counts[row][query]`` keys (zeros where that is 0). ``query``
    [rows, heads, width, dim] float32; ``key`` and ``value`` [rows, kv heads, total, dim] (float32 or bfloat16,
    the same dtype); returns [rows, width, heads, dim] float32. Check :func:`supports` first. The counts are
    checked and copied for C once per list: the layers of one forward pass the same one."""
    rows, heads, width, dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    if value.dtype != key.dtype or value.stride(-1) != 1:
        value = value.to(key.dtype).contiguous()
    table = _table(counts, rows, width, total)
    out = torch.empty((rows, width, heads, dim), dtype=torch.float32)
    failed = kernel()(query.data_ptr(), *query.stride()[:3], key.data_ptr(), value.data_ptr(),
                      int(key.dtype == torch.bfloat16), *key.stride()[:3], *value.stride()[:3],
                      table, rows, heads, kv_heads, width, dim, total, scale,
                      out.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError("the attention kernel could not allocate its scratch memory")
    return out


_last: tuple = (None, None, None)  # the counts list last turned into a table, its shape check, and the table


def _table(counts: list[list[int]], rows: int, width: int, total: int) -> ctypes.Array:
    """``counts`` as the C array the kernel reads, checked against the call's shape."""
    global _last
    last = _last  # one read: a triple another thread replaces whole
    if last[0] is counts and last[1] == (rows, width, total):
        return last[2]
    flat = [n for row in counts for n in row]
    if len(counts) != rows or len(flat) != rows * width or min(flat) < 0 or max(flat) > total:
        raise ValueError(f"key counts must be [rows, width] = [{rows}, {width}], each in 0..{total}")
    table = (ctypes.c_int64 * len(flat))(*flat)
    _last = (counts, (rows, width, total), table)
    return table
