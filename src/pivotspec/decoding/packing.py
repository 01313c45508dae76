"""Linears on oneDNN-packed weights: the kernels of the CPU fast path (``fastpath`` chooses whether a model
uses them, and at which lone-row width).

Why: PyTorch's plain ``F.linear`` reaches about a third of the read bandwidth at one row (measured: a
bfloat16 576x1536 layer at 8 GB/s against 28 GB/s for a sum over the same bytes), because it hands oneDNN
the weights in their stored layout on every call and one row of bfloat16 goes through a slow path.
:class:`PackedLinear` reorders each weight once into oneDNN's blocked layout (what ``torch.compile``'s
freezing pass does for CPU linears), which ran those layers at 20-25 GB/s, bfloat16 and float32 alike, and
brought the 6-row verification forward to 1.06-1.11x the 1-row one (benchmarks/cpu_forwards.py).
The same layers may instead hold int8 weights (:func:`quantize`, ``--dtype int8``), or float32 weights, in
panels computed by the row-wise kernel (``rowwise``), or int8 weights computed by PyTorch's weight-only int8
kernel where that kernel does not build: the fast paths of CPUs without bfloat16 instructions; or bfloat16
weights in the row-wise kernel's panels (AVX512-BF16's dot product). ``KERNELS`` names the five.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pivotspec.decoding import rowwise
from pivotspec.errors import UsageError

LONE_WIDTHS = (1, 2, 4)  # how many rows a lone row may be computed as; which are exact and fastest is measured
LONE_ROWS = 2  # the width before it is measured (and where none is exact): what every earlier number used
ROW_LIMIT = 256  # the most rows one call may take (more go in chunks); how many are exact is measured below it
MAX_ROWS = 128  # the limit before it is measured
# what a packed linear computes with (:meth:`PackedCompute.hold`): oneDNN, PyTorch's int8 kernel, the row-wise
# kernel over float32, int8 or bfloat16 weights
KERNELS = ("onednn", "int8", "rowwise", "rowwise-int8", "rowwise-bf16")


def weight_product(flat: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   scales: torch.Tensor | None = None) -> torch.Tensor:
    """``flat @ W.T + bias`` with ``W`` held as oneDNN-packed weights, or, with ``scales``, as int8 weights
    with a scale per output row (:func:`quantize`), whose kernel multiplies bfloat16 rows: ``flat`` is rounded
    to bfloat16 for it and the product comes back in ``flat``'s dtype."""
    if scales is None:
        return torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    out = torch.ops.aten._weight_int8pack_mm(flat.to(scales.dtype), packed, scales).to(flat.dtype)
    return out if bias is None else out + bias


def packed_linear(flat: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  lone_rows: int = LONE_ROWS, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``flat @ W.T + bias`` on oneDNN-packed weights. A lone row is computed as ``lone_rows`` rows (the rest
    zeros): oneDNN may sum one row differently from two or more, and where it does the results part at
    rounding, in bfloat16 by a whole step, enough to move greedy SD away from the target alone. Whether it does,
    and which width runs fastest, depend on the CPU, the dtype and the shapes (on an AMD EPYC with AVX512-BF16:
    one row alone kept the many-row numbers for the testbed draft's bfloat16 weights and ran 18% faster, not
    for the target's, where 4 rows ran 3-8% faster than 2; in float32 it parted), so :func:`choose` measures
    it among the exact widths (:func:`exact_lone_widths`)."""
    if flat.shape[0] == 1 and lone_rows > 1:
        return weight_product(F.pad(flat, (0, 0, 0, lone_rows - 1)), packed, bias, scales)[:1]
    return weight_product(flat, packed, bias, scales)


def pack(weight: torch.Tensor) -> torch.Tensor:
    # The batch-size hint only guides oneDNN's blocking; any number of rows runs on the packed weight.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8, symmetric, one bfloat16 scale per output row: what
    ``torch.ops.aten._weight_int8pack_mm`` multiplies bfloat16 rows with. Why: a decode step on a CPU reads
    every weight once, and int8 is a quarter of float32's bytes; that kernel needs no bfloat16 instructions, so
    it also serves AVX2-only CPUs, where oneDNN has no bfloat16 path at all (measured on a 2-core AVX2 AMD EPYC,
    the testbed target's linears at one row: 18 ms against 49 ms float32 packed). It computes each row alone
    (1 to 256 rows gave every row the same bits there), and needs input widths that are multiples of 8."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16)
    q = torch.round(w / scales.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class PackedCompute:
    """What a packed linear and a fused group share: ``compute`` over ``packed``, ``bias``, ``lone_rows`` and
    ``max_rows``. A lone row is copied into a zeroed scratch block kept between calls rather than padded anew:
    the padding was three small ops on each of the 121 linears of a testbed-target step (``F.pad``: allocate,
    fill, copy). More than ``max_rows`` rows go in chunks of at most that many: oneDNN may sum a row of a large
    block differently from the same row in a small one (on an Intel Xeon with AMX, the testbed target's
    1536-wide down projection parted at 67 of the block sizes 150-256, and at none up to 128), so a prompt
    computed inside a batch's forward, or a batch of 32 rows, would not get the numbers of the same tokens
    computed alone (:func:`exact_row_limit` measures the limit)."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    lone_rows: int
    max_rows: int = MAX_ROWS
    kernel: str = "onednn"  # one of KERNELS
    outputs: int  # the weight's rows (the row-wise kernel's panels are padded past them)
    scales: torch.Tensor | None = None  # int8 weights' row scales (:func:`quantize`; float32 for rowwise-int8)
    _scratch: torch.Tensor | None = None

    def hold(self, weight: torch.Tensor, kernel: str) -> None:
        """Keep ``weight`` [out, in] as ``kernel`` computes with it: oneDNN-packed (``onednn``), int8 with row
        scales (``int8``), or in the row-wise kernel's panels, float32 (``rowwise``) or int8 with row scales
        (``rowwise-int8``) or bfloat16 (``rowwise-bf16``: the inputs rounded to bfloat16 too; the three need
        the C kernel built here). Both int8 kernels hold the same int8 weights and scales (:func:`quantize`):
        PyTorch's rounds the inputs to bfloat16, the row-wise one keeps them float32."""
        if kernel not in KERNELS or (kernel.startswith("rowwise") and not rowwise.available()):
            raise UsageError(f"no {kernel!r} linear kernel here: use one of {', '.join(KERNELS[:2])}")
        self.kernel, self.outputs = kernel, weight.shape[0]
        if kernel in ("int8", "rowwise-int8"):
            self.packed, self.scales = quantize(weight)
            if kernel == "rowwise-int8":
                self.packed, self.scales = rowwise.pack(self.packed), self.scales.float()
        elif kernel == "rowwise":
            self.packed = rowwise.pack(weight)
        elif kernel == "rowwise-bf16":
            self.packed = rowwise.pack(weight.detach().to(torch.bfloat16))
        else:
            self.packed = pack(weight)

    def product(self, flat: torch.Tensor, lone_rows: int = 1) -> torch.Tensor:
        """The layer on ``flat``, a lone row computed as ``lone_rows`` rows, in one kernel call (the row-wise
        kernel computes each row alone at any width, so it needs no padding)."""
        if self.kernel.startswith("rowwise"):
            return rowwise.linear(flat, self.packed, self.bias, self.outputs, self.scales)
        return packed_linear(flat, self.packed, self.bias, lone_rows, self.scales)

    def compute(self, flat: torch.Tensor) -> torch.Tensor:
        """The layer (or every member of the group, side by side) on a [rows, in_features] input."""
        if flat.shape[0] > self.max_rows:
            return torch.cat([self.compute(part) for part in flat.split(self.max_rows)])
        if flat.shape[0] != 1 or self.lone_rows == 1:
            return self.product(flat, self.lone_rows)
        scratch = self._scratch
        if scratch is None or scratch.shape[0] != self.lone_rows or scratch.dtype != flat.dtype:
            scratch = self._scratch = flat.new_zeros((self.lone_rows, flat.shape[1]))
        scratch[:1].copy_(flat)  # rows 1.. stay zero: the same block packed_linear pads to
        return self.product(scratch)[:1]


class PackedLinear(PackedCompute, nn.Module):
    """``nn.Linear`` whose weight is also held in oneDNN's prepacked layout. The original parameter stays
    (shared, so a lm_head tied to the embeddings stays tied, and fingerprints and state dicts see it)."""

    def __init__(self, linear: nn.Linear, kernel: str = "onednn"):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.hold(linear.weight, kernel)
        self.lone_rows = LONE_ROWS

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compute(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)


class FusedLinears(PackedCompute):
    """Linears that read the same input (attention's q, k and v; the MLP's gate and up) as one packed
    matrix: one oneDNN call instead of three or two. Measured: the 210 separate calls of a 30-layer
    SmolLM2-shaped stack took 1.7x the time of the 120 fused ones at one row, the weights being the same bytes.
    The first member called with an input computes every member's output; the others take their slice."""

    def __init__(self, linears: list[nn.Linear], kernel: str = "onednn"):
        self.sizes = [lin.out_features for lin in linears]
        self.in_features, self.dtype = linears[0].in_features, linears[0].weight.dtype
        self.hold(torch.cat([lin.weight.detach() for lin in linears]), kernel)
        biases = [lin.bias for lin in linears]
        self.bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
        self.lone_rows = LONE_ROWS
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] = []

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x:  # a new input: compute every member's output once
            out = self.compute(x.reshape(-1, x.shape[-1]))
            self._outputs = [part.reshape(*x.shape[:-1], part.shape[-1]) for part in out.split(self.sizes, -1)]
            self._input = x
        return self._outputs[index]


class FusedMember(nn.Module):
    """One linear of a :class:`FusedLinears` group, in its place (its parameters stay registered)."""

    def __init__(self, linear: nn.Linear, group: FusedLinears, index: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.output(self.index, x)
        if self.index == len(self.group.sizes) - 1:  # the last member: let go of the input and outputs
            self.group._input, self.group._outputs = None, []
        return out


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # names that read one input in HF models


def pack_linears(model: nn.Module, kernel: str = "onednn") -> int:
    """Replace every ``nn.Linear`` of a CPU model by a packed one computed by ``kernel`` (one of ``KERNELS``:
    oneDNN-packed, weight-only int8 by :func:`quantize`, or the row-wise kernel), fusing the groups in
    ``FUSED`` that a module holds (members must agree on input width and on having a bias); returns how many
    linears were replaced."""
    if kernel == "int8":
        odd = sorted({m.in_features for m in model.modules() if type(m) is nn.Linear and m.in_features % 8})
        if odd:  # the int8 kernel computes wrong numbers (or crashes) on other widths (measured: 12, 20, 36, 50)
            raise UsageError(f"int8 weights need linear input widths that are multiples of 8 (this model has "
                             f"{odd[0]}): use --dtype bfloat16 or float32")
    replaced = 0
    for module in list(model.modules()):
        for names in FUSED:
            linears = [getattr(module, n, None) for n in names]
            if (all(type(lin) is nn.Linear for lin in linears) and len({lin.in_features for lin in linears}) == 1
                    and len({lin.bias is None for lin in linears}) == 1):
                group = FusedLinears(linears, kernel)
                for i, (name, lin) in enumerate(zip(names, linears, strict=True)):
                    setattr(module, name, FusedMember(lin, group, i))
                replaced += len(names)
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, PackedLinear(mod, kernel))
    return replaced + len(targets)


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, (PackedLinear, FusedMember)) for m in model.modules())


def weights_dtype(model: nn.Module) -> str:
    """The dtype a model computes in, as label files and eval runs record it: ``int8`` for weight-only int8
    linears, ``bfloat16`` for bfloat16 row-wise ones (the rest of such a model is float32, which is what
    ``model.dtype`` says), else ``model.dtype``."""
    kernels = packed_kernels(model)
    if any(k.scales is not None for k in kernels):
        return "int8"
    if any(k.kernel == "rowwise-bf16" for k in kernels):
        return "bfloat16"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def lowp_on_rowwise(model: nn.Module) -> bool:
    """Whether ``model``'s int8 or bfloat16 linears run on the row-wise kernel rather than PyTorch's or
    oneDNN's: int8 with float32 inputs instead of bfloat16 ones, bfloat16 with float32 everywhere but the
    linears' inputs; the same weights, other numbers, so runs record which."""
    return any(k.kernel in ("rowwise-int8", "rowwise-bf16") for k in packed_kernels(model))


def kernel_of(linear: nn.Module) -> PackedLinear | FusedLinears:
    """The packed weight a packed linear computes with: its own, or its fused group's."""
    return linear.group if isinstance(linear, FusedMember) else linear


def packed_kernels(model: nn.Module) -> list[PackedLinear | FusedLinears]:
    """Each packed weight of ``model`` once: its packed linears and fused groups."""
    kernels = {}
    for m in model.modules():
        if isinstance(m, PackedLinear):
            kernels[id(m)] = m
        elif isinstance(m, FusedMember):
            kernels[id(m.group)] = m.group
    return list(kernels.values())


def set_lone_rows(model: nn.Module, rows: int) -> None:
    for kernel in packed_kernels(model):
        kernel.lone_rows = rows


def set_max_rows(model: nn.Module, rows: int) -> None:
    for kernel in packed_kernels(model):
        kernel.max_rows = rows


def exact_row_limit(model: nn.Module, top: int = ROW_LIMIT, block: int = 6) -> int:
    """The most rows (up to ``top``) up to which every block size gives each row, bit for bit, the numbers a
    block of ``block`` rows gives it (the verification's width), for every packed weight shape of ``model``,
    probed with seeded random rows: every block size from 2, except on weights wider than 8,192 outputs (an LM
    head, which sees only the kept rows of a step) and int8 weights, where a set of sizes around the powers of
    two is probed, as probing every size took seconds. At least ``block`` (the widths a step computes at batch 1)."""
    gen = torch.Generator().manual_seed(0)
    sparse = sorted({m for p in (4, 8, 16, 32, 64, 128, 256) for m in (p - 1, p, p + 1) if 2 <= m <= top}
                    | set(range(2, 17)) | {top})
    first_bad = top + 1
    shapes = {(tuple(k.packed.shape), k.bias is None): k for k in packed_kernels(model)}
    with torch.inference_mode():
        for k in shapes.values():
            x = torch.randn(top, k.in_features, generator=gen).to(k.dtype)
            reference = torch.cat([k.product(x[i:i + block]) for i in range(0, top, block)])
            # int8 kernels too: they compute rows in blocks of 4, so the sizes around block edges tell (every
            # size took a minute of the testbed pair's first int8 load)
            sizes = sparse if reference.shape[1] > 8192 or k.scales is not None else range(2, top + 1)
            for m in sizes:
                if m >= first_bad:
                    break
                if not torch.equal(k.product(x[:m]), reference[:m]):
                    first_bad = m
    return max(block, first_bad - 1)


def exact_lone_widths(model: nn.Module, widths: tuple[int, ...] = LONE_WIDTHS, rows: int = 6) -> list[int]:
    """The widths at which a lone row gets, bit for bit, the numbers that a block of ``rows`` rows gives it, for
    every packed weight of ``model`` (probed with seeded random rows): the widths that keep greedy SD equal to
    the target alone and batched rows equal to rows alone."""
    gen = torch.Generator().manual_seed(0)
    probes = [(k, torch.randn(rows, k.in_features, generator=gen).to(k.dtype)) for k in packed_kernels(model)]
    exact = []
    with torch.inference_mode():
        for width in widths:
            if all(torch.equal(k.product(x), torch.cat([k.product(x[i:i + 1], width) for i in range(rows)]))
                   for k, x in probes):
                exact.append(width)
    return exact
