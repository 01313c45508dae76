"""Minimal LoRA: wrap chosen Linear layers for training, export the adapters, merge them at load time.

Kept in-house (no peft) because the testbed needs only rank-r adapters on Llama linear layers and an
exact, dependency-free merge when the shipped target is loaded.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))  # zero: training starts at the base model
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def adapter_names(num_layers: int, top_layers: int) -> list[str]:
    """Qualified names of the Linear layers that get adapters: every MODULE of the top ``top_layers`` blocks."""
    names = []
    for i in range(num_layers - top_layers, num_layers):
        for mod in MODULES:
            part = "self_attn" if mod.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            names.append(f"model.layers.{i}.{part}.{mod}")
    return names


def add_adapters(model: nn.Module, names: list[str], rank: int, alpha: float) -> list[LoRALinear]:
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name in names:
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        lora = LoRALinear(getattr(parent, attr), rank, alpha)
        setattr(parent, attr, lora)
        wrapped.append(lora)
    return wrapped


def export_adapters(model: nn.Module, names: list[str], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in names:
        mod = model.get_submodule(name)
        tensors[f"{name}.lora_a"] = mod.lora_a.detach().to(dtype).contiguous()
        tensors[f"{name}.lora_b"] = mod.lora_b.detach().to(dtype).contiguous()
    return tensors


@torch.no_grad()
def merge_adapters(model: nn.Module, tensors: dict[str, torch.Tensor], scale: float) -> None:
    """W += scale * B @ A for each adapter, computed in float32 from the stored tensors."""
    names = sorted({key.rsplit(".", 1)[0] for key in tensors})
    for name in names:
        mod = model.get_submodule(name)
        base = mod.base if isinstance(mod, LoRALinear) else mod
        delta = tensors[f"{name}.lora_b"].float() @ tensors[f"{name}.lora_a"].float()
        base.weight += (scale * delta).to(base.weight.dtype)
