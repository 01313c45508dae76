"""A Llama layer's work around attention in two calls of the row-wise C kernel (``rowwise.c``): ``layer_front``
(RMSNorm, the fused q/k/v linear, the rotary embedding) and ``layer_back`` (the output projection, RMSNorm,
the gate/up linear, SiLU, the down projection, both residuals), for the lean forward (``forward``) of a model
whose linears are all on the row-wise kernel.

Why: once the row-wise kernel brought the linears near the read bandwidth, the ~35 small PyTorch ops a layer
around them cost more than the linears on the testbed target's decode step (a 2-core AMD EPYC with AVX2:
float32 25.2 ms against a 15.2 ms read time, int8 16.9 against 3.8; benchmarks/README, "CPU forwards"), and
a C RMSNorm alone saved nothing (one ctypes call costs what the ops it replaces cost): the calls, not their
arithmetic, were the cost. Every value of a row depends on that row alone, as in the linear, so greedy SD
equals the target alone and batched rows equal rows alone by construction; the numbers differ from PyTorch's
ops at rounding (a C sum of squares, ``expf``), so ``$PIVOTSPEC_LAYERS=torch`` keeps PyTorch's (to compare),
read when a model gets its lean forward.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

from pivotspec.decoding import compiled, rowwise
from pivotspec.errors import UsageError

_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64


class _Linear(ctypes.Structure):  # as rowwise.c's Linear
    _fields_ = [("w", _POINTER), ("scales", _POINTER), ("bias", _POINTER), ("outputs", _SIZE), ("width", _SIZE),
                ("q", _SIZE)]


class _Layer(ctypes.Structure):  # as rowwise.c's Layer
    _fields_ = [("norm_in", _POINTER), ("norm_post", _POINTER), ("eps_in", ctypes.c_double),
                ("eps_post", ctypes.c_double), ("qkv", _Linear), ("out", _Linear), ("gate_up", _Linear),
                ("down", _Linear)]


_SIGNATURES = {
    "layer_front": [_POINTER, _POINTER, _SIZE, _POINTER, _POINTER, _SIZE, _SIZE, _POINTER, _POINTER, ctypes.c_int],
    "layer_back": [_POINTER, _POINTER, _SIZE, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, ctypes.c_int],
    "norm": [_POINTER, _SIZE, _SIZE, _POINTER, ctypes.c_double, _POINTER],
}


@functools.cache
def function(symbol: str) -> ctypes._CFuncPtr | None:
    return compiled.load(rowwise.SOURCE, symbol, _SIGNATURES[symbol])


def wanted() -> bool:
    """Whether models loaded now get fused layers (``$PIVOTSPEC_LAYERS``: fused, the default, or torch) and the
    kernel builds here."""
    choice = os.environ.get("PIVOTSPEC_LAYERS", "fused")
    if choice not in ("fused", "torch"):
        raise UsageError(f"PIVOTSPEC_LAYERS={choice!r}: use fused (the default) or torch")
    return choice == "fused" and all(function(s) is not None for s in _SIGNATURES)


_KINDS = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}  # rowwise.c's kinds of weights


def _linear(kernel: Any) -> _Linear:
    return _Linear(kernel.packed.data_ptr(), 0 if kernel.scales is None else kernel.scales.data_ptr(),
                   0 if kernel.bias is None else kernel.bias.data_ptr(), kernel.outputs, kernel.in_features,
                   _KINDS[kernel.packed.dtype])


def on_rowwise(kernel: Any) -> bool:
    """Whether a lean forward's linear (``forward.lean_kernel``) runs on the row-wise kernel."""
    name, bias = getattr(kernel, "kernel", None), getattr(kernel, "bias", None)
    return (isinstance(name, str) and name.startswith("rowwise")
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


class FusedLayers:
    """The C descriptions of a lean forward's layers (weights' addresses, sizes, norms' epsilons), built once:
    the packed tensors they point at are held here and never replaced after packing."""

    def __init__(self, layers: list[tuple], turned_heads: int, head_dim: int, inter: int):
        self.held = [(w_in.detach().float().contiguous(), w_post.detach().float().contiguous())
                     for w_in, _, _, _, w_post, *_ in layers]
        # the kernels whose tensors the descriptions point at, kept alive with them
        self.kernels = [(qkv, out, gate_up, down) for _, _, qkv, out, _, _, gate_up, down, _ in layers]
        self.layers = (_Layer * len(layers))(*[
            _Layer(norm_in.data_ptr(), norm_post.data_ptr(), float(eps_in), float(eps_post), _linear(qkv),
                   _linear(out), _linear(gate_up), _linear(down))
            for (norm_in, norm_post), (_, eps_in, qkv, out, _, eps_post, gate_up, down, _) in zip(self.held, layers,
                                                                                                strict=True)])
        self.addresses = [ctypes.addressof(layer) for layer in self.layers]
        self.turned, self.head_dim, self.inter = turned_heads, head_dim, inter
        self.qkv_size = layers[0][2].outputs
        self.front_call, self.back_call, self.norm_call = (function(s) for s in _SIGNATURES)

    @classmethod
    def build(cls, layers: list[tuple], turned_heads: int, head_dim: int, inter: int) -> FusedLayers | None:
        """Fused layers for a lean forward's ``layers`` where every linear runs on the row-wise kernel and
        ``$PIVOTSPEC_LAYERS`` asks for them (:func:`wanted`), else None."""
        kernels = [k for layer in layers for k in (layer[2], layer[3], layer[6], layer[7])]
        if not all(on_rowwise(k) for k in kernels) or head_dim > 1024 or not wanted():
            return None
        return cls(layers, turned_heads, head_dim, inter)

    def front(self, index: int, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
              normed: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s q, k and v [tokens, q + k + v] of ``x`` [tokens, d], q's and k's heads turned by
        ``cos`` and ``signed_sin`` [tokens, head_dim] (``forward.signed``); ``normed`` [tokens, d] is scratch."""
        qkv = x.new_empty((x.shape[0], self.qkv_size))
        rowwise.checked(self.front_call(self.addresses[index], x.data_ptr(), x.shape[0], cos.data_ptr(),
                                        signed_sin.data_ptr(), self.turned, self.head_dim, normed.data_ptr(),
                                        qkv.data_ptr(), torch.get_num_threads()))
        return qkv

    def back(self, index: int, x: torch.Tensor, attended: torch.Tensor, scratch: dict[str, torch.Tensor]) -> None:
        """``x`` [tokens, d] plus the rest of layer ``index`` over ``attended`` [tokens, heads * head_dim], in
        place; ``scratch`` from :meth:`scratch`."""
        rowwise.checked(self.back_call(self.addresses[index], x.data_ptr(), x.shape[0], attended.data_ptr(),
                                       scratch["normed"].data_ptr(), scratch["delta"].data_ptr(),
                                       scratch["hidden"].data_ptr(), scratch["act"].data_ptr(),
                                       torch.get_num_threads()))

    def scratch(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = x.shape[0]
        return {"normed": torch.empty_like(x), "delta": torch.empty_like(x),
                "hidden": x.new_empty((tokens, 2 * self.inter)), "act": x.new_empty((tokens, self.inter))}

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of ``x`` [rows, d] (contiguous float32) by ``weight`` (float32), as the layers compute it."""
        out = torch.empty_like(x)
        self.norm_call(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), float(eps), out.data_ptr())
        return out
