"""One forward of a causal LM over a KV cache, returning the logits and hidden states the decoding loops need.

On the CPU fast path (``fastpath``), a plain Llama's forward runs a lean copy of transformers' Llama forward
(:class:`LeanLlama`), over packed linears or over the model's own (:class:`PlainLinears`): the same
operations in the same order, so the same numbers bit for bit (tested), without what a general library
needs and a decode step does not: a module call per norm, attention, MLP and linear with its hooks and
keyword plumbing, output records, a hook to read a hidden state. Why: on the testbed target (30 layers,
packed bfloat16) transformers' decode step spent about 7 of its 29 ms in Python between the kernels
(torch.profiler); the lean forward took 15-21% off the 1- and 6-token forwards in bfloat16, 8-15% in float32
and 21-28% on the small draft (benchmarks/cpu_forwards.py); over the float32 testbed draft's own linears,
14% off its forwards in a batch of 8 (0.77 to 0.66 s of a 16-problem PAD run, same process). Where every
linear runs on the row-wise kernel, the lean forward goes further (:meth:`LeanLlama.through_fused`): each
layer's ops around attention are two C calls (``fused``), each row still computed alone, its numbers
PyTorch's to rounding rather than bit for bit. Every other model, and every model off the CPU, goes through
transformers.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pivotspec.decoding import query_attention
from pivotspec.decoding.attention import FLOAT32_ATTENTION, key_counts
from pivotspec.decoding.fused import FusedLayers
from pivotspec.decoding.packing import FusedMember, PackedLinear, kernel_of

LEAN = "_pivotspec_lean"  # the attribute that holds a model's lean forward
DIRECT_ATTENTION = ("sdpa", FLOAT32_ATTENTION)  # attention functions whose one-query case the lean forward inlines


def cache_keyword(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that hands ``cache`` to ``model``'s forward: ``cache`` from transformers 5.24 (which still
    takes the old name with a warning), ``past_key_values`` before it. An unknown keyword would be swallowed
    by ``**kwargs`` and the model would decode without its cache, silently."""
    forward = model.forward
    return {cache_argument(getattr(forward, "__func__", forward)): cache}


@functools.cache
def cache_argument(forward: Any) -> str:
    # Read once per forward function: ``inspect.signature`` on every call cost 0.15 ms, 4% of the testbed
    # draft's decode step.
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's computation, op for op (float32 inside, the input's dtype out)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as transformers applies it, ``x * cos + rotate_half(x) * sin``, with
    rotate_half's minus folded into ``signed_sin`` (:func:`signed`): ``(-a) * b`` and ``a * (-b)`` round alike,
    so the numbers are the same, in two ops fewer."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, -1) * signed_sin)


def signed(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


@dataclass(frozen=True)
class Ragged:
    """Rows of different lengths in one [rows, width] input: row b's first ``fed[b]`` positions are tokens,
    the rest padding, and its last ``keep[b]`` tokens give outputs. The lean forward computes the tokens only,
    so a prompt of 80 tokens joining 7 rows of 6 (``batch.Batch``) costs 122 token rows of every linear, not
    8 x 80, and the LM head runs on the kept rows only."""

    fed: list[int]
    keep: list[int]

    def tokens(self, width: int, device: torch.device) -> torch.Tensor:
        """Where the tokens are in the flattened [rows * width] input."""
        return torch.tensor([b * width + i for b, n in enumerate(self.fed) for i in range(n)], dtype=torch.long,
                            device=device)

    def kept(self, device: torch.device) -> torch.Tensor:
        """Where the kept tokens are among the tokens (in ``tokens``' order)."""
        out, start = [], 0
        for n, k in zip(self.fed, self.keep, strict=True):
            out.extend(range(start + n - k, start + n))
            start += n
        return torch.tensor(out, dtype=torch.long, device=device)


class PlainLinears:
    """``nn.Linear`` modules that read one input, computed as transformers computes them (one ``F.linear``
    each), their outputs side by side: what a packed group (``packing.FusedLinears``) gives the lean forward,
    for a model whose linears are not packed."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears

    def compute(self, flat: torch.Tensor) -> torch.Tensor:
        outs = [F.linear(flat, lin.weight, lin.bias) for lin in self.linears]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


def lean_kernel(module: nn.Module, *names: str) -> Any:
    """What computes ``module``'s linears ``names`` (which read one input) for the lean forward: their packed
    weight or group, or :class:`PlainLinears` over the modules themselves."""
    first = getattr(module, names[0])
    return kernel_of(first) if isinstance(first, (PackedLinear, FusedMember)) else \
        PlainLinears([getattr(module, n) for n in names])


class LeanLlama:
    """transformers' ``LlamaForCausalLM`` forward, as straight-line code. It reads the model's own modules
    (weights, rotary embedding, attention function and mask builder), so it computes what the model computes;
    only the call structure is flattened."""

    def __init__(self, model: nn.Module):
        config, body = model.config, model.model
        self.config, self.body = config, body
        attn = body.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.inter = config.intermediate_size
        self.layers = [(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                        lean_kernel(layer.self_attn, "q_proj", "k_proj", "v_proj"),
                        lean_kernel(layer.self_attn, "o_proj"),
                        layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                        lean_kernel(layer.mlp, "gate_proj", "up_proj"), lean_kernel(layer.mlp, "down_proj"),
                        layer.self_attn)
                       for layer in body.layers]
        self.head = lean_kernel(model, "lm_head")
        self.fused = FusedLayers.build(self.layers, self.heads + self.kv_heads, self.head_dim, self.inter)
        self.final = body.norm.weight.detach().float().contiguous()

    def __call__(self, input_ids: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, keep: int, layers: tuple[int, ...],
                 ragged: Ragged | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        from transformers.masking_utils import create_causal_mask

        if self.fused is not None:
            return self.through_fused(input_ids, cache, attention_mask, position_ids, keep, layers, ragged)
        if ragged is not None:
            return self.ragged(input_ids, cache, attention_mask, position_ids, layers, ragged)
        body, config = self.body, self.config
        rows, width = input_ids.shape
        x = body.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = (torch.arange(width, device=x.device) + cache.get_seq_length()).unsqueeze(0)
        mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        cos, sin = body.rotary_emb(x, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), signed(sin).unsqueeze(1)
        attention = self.attention()
        split = (rows, width, -1, self.head_dim)
        # One new token per row and no mask (a lone sequence's decode step, most of a decode's forwards) calls
        # PyTorch's SDPA directly, as transformers' SDPA attention (and ``attention.sdpa_in_float32`` in float32
        # over it) would; its wrappers cost about 3% of the testbed target's step (same-process A/B). Heads wider
        # than 256 take transformers' other grouped-query path there, so they keep its function.
        # Not where the compiled per-query attention runs (``query_attention``): the lone step must be summed as
        # the batch's and the verification's queries are, so it goes through the attention function as they do.
        direct = (width == 1 and mask is None and config._attn_implementation in DIRECT_ATTENTION
                  and self.head_dim <= 256
                  and not (config._attn_implementation == FLOAT32_ATTENTION and query_attention.enabled()))
        gqa = self.heads != self.kv_heads
        heads, kv_end, inter = self.heads, self.q_size + self.kv_size, self.inter
        captured: dict[int, torch.Tensor] = {}
        for index, (w_in, eps_in, qkv, out, w_post, eps_post, gate_up, down, module) in enumerate(self.layers):
            flat = rms_norm(x, w_in, eps_in).reshape(rows * width, -1)
            fused = qkv.compute(flat)
            turned = rotate(fused[:, :kv_end].view(split).transpose(1, 2), cos, sin)  # q's and k's heads at once
            q, k = turned[:, :heads], turned[:, heads:]
            v = fused[:, kv_end:].view(split).transpose(1, 2)
            k, v = cache.update(k, v, index)
            if direct:  # what transformers' SDPA path computes for one query and no mask, without its wrappers
                attended = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=module.scaling,
                                                          enable_gqa=gqa).transpose(1, 2).to(x.dtype)
            else:
                attended, _ = attention(module, q, k, v, mask, dropout=0.0, scaling=module.scaling)
            x = x + out.compute(attended.reshape(rows * width, -1).contiguous()).view(rows, width, -1)
            hidden = gate_up.compute(rms_norm(x, w_post, eps_post).reshape(rows * width, -1))
            x = x + down.compute(F.silu(hidden[:, :inter]) * hidden[:, inter:]).view(rows, width, -1)
            if index + 1 in layers:
                captured[index + 1] = x[:, width - keep:]
        final = body.norm
        last = rms_norm(x[:, width - keep:], final.weight, final.variance_epsilon)
        logits = self.head.compute(last.reshape(rows * keep, -1))
        return logits.view(rows, keep, -1), captured

    def attention(self) -> Any:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)

    def through_fused(self, input_ids: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None, keep: int, layers: tuple[int, ...], ragged: Ragged | None
                      ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The forward of :meth:`__call__` (or of :meth:`ragged`, with ``ragged``) over :class:`fused.FusedLayers`:
        the tokens as [tokens, d] rows through two C calls a layer, attention between them. Each query attends
        over exactly its keys (``query_attention``) wherever the mask shows a prefix of keys to every query (a
        sequence's cache, the batch's slot cache), so the lone step, a verification and a batch's rows sum
        alike; elsewhere (the rollouts' left padding) through the model's attention with the mask."""
        from transformers.masking_utils import create_causal_mask

        body, fused = self.body, self.fused
        rows, width = input_ids.shape
        device = input_ids.device
        if ragged is None:
            x = body.embed_tokens(input_ids)
            if position_ids is None:
                position_ids = (torch.arange(width, device=device) + cache.get_seq_length()).unsqueeze(0)
            mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                      position_ids=position_ids)
            tokens = None
            kept = (torch.arange(rows, device=device)[:, None] * width + torch.arange(width - keep, width,
                                                                                       device=device)).reshape(-1)
            x = x.reshape(rows * width, -1)
        else:
            mask, tokens, kept = attention_mask, ragged.tokens(width, device), ragged.kept(device)
            x = body.embed_tokens(input_ids.reshape(-1)[tokens])
        cos, sin = body.rotary_emb(x, position_ids=position_ids)
        cos, sin = (c.expand(rows, width, -1).reshape(rows * width, -1) for c in (cos, signed(sin)))
        cos, sin = (c.contiguous() if tokens is None else c[tokens] for c in (cos, sin))
        attention, scratch, counts = self.attention(), fused.scratch(x), None
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        all_heads = heads + 2 * kv_heads
        captured: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            module = layer[-1]
            qkv = fused.front(index, x, cos, sin, scratch["normed"])
            if tokens is None:
                split = qkv.view(rows, width, all_heads, dim).transpose(1, 2)
            else:
                padded = qkv.new_zeros((rows * width, all_heads, dim))
                padded[tokens] = qkv.view(len(tokens), all_heads, dim)
                split = padded.view(rows, width, all_heads, dim).transpose(1, 2)
            q = split[:, :heads]
            k, v = cache.update(split[:, heads:heads + kv_heads], split[:, heads + kv_heads:], index)
            if index == 0 and query_attention.supports(q, k):
                counts = key_counts(mask, rows, width, k.shape[2])
            if counts is not None:
                attended = query_attention.attend(q, k, v, counts, module.scaling)
            else:
                attended, _ = attention(module, q, k, v, mask, dropout=0.0, scaling=module.scaling)
            attended = attended.reshape(rows * width, -1)
            fused.back(index, x, attended.contiguous() if tokens is None else attended[tokens], scratch)
            if index + 1 in layers:
                captured[index + 1] = x[kept]
        logits = self.head.compute(fused.norm(x[kept], self.final, body.norm.variance_epsilon))
        if ragged is not None:
            return logits, captured
        return logits.view(rows, keep, -1), {i: h.view(rows, keep, -1) for i, h in captured.items()}

    def ragged(self, input_ids: torch.Tensor, cache: Any, mask: Any, position_ids: torch.Tensor,
               layers: tuple[int, ...], ragged: Ragged) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The forward of :meth:`__call__` over the tokens of a :class:`Ragged` input only: every op but
        attention works on the [tokens, d] rows, as the same op does on the same rows of a padded input (they
        are row by row, and the linears give a row the same numbers in any block up to their ``max_rows``);
        attention gets them scattered back into [rows, width] (padding zeros, seeing no key under the mask
        ``slots.attention_masks`` makes with ``fed``). Returns the logits of the kept tokens [kept, vocab] and
        the hidden states there [kept, d]. ``mask``: the prepared [rows, 1, width, keys] mask."""
        body = self.body
        rows, width = input_ids.shape
        tokens = ragged.tokens(width, input_ids.device)
        x = body.embed_tokens(input_ids.reshape(-1)[tokens])
        cos, sin = body.rotary_emb(x, position_ids=position_ids)
        cos = cos.reshape(rows * width, 1, -1)[tokens]
        sin = signed(sin).reshape(rows * width, 1, -1)[tokens]
        attention = self.attention()
        heads, kv_end, inter, dim = self.heads, self.q_size + self.kv_size, self.inter, self.head_dim
        all_heads = heads + 2 * self.kv_heads
        captured: dict[int, torch.Tensor] = {}
        kept = ragged.kept(input_ids.device)
        for index, (w_in, eps_in, qkv, out, w_post, eps_post, gate_up, down, module) in enumerate(self.layers):
            fused = qkv.compute(rms_norm(x, w_in, eps_in))
            padded = fused.new_zeros((rows * width, all_heads, dim))
            padded[tokens, :heads + self.kv_heads] = rotate(fused[:, :kv_end].view(len(tokens), -1, dim), cos, sin)
            padded[tokens, heads + self.kv_heads:] = fused[:, kv_end:].view(len(tokens), -1, dim)
            padded = padded.view(rows, width, all_heads, dim).transpose(1, 2)
            k, v = cache.update(padded[:, heads:heads + self.kv_heads], padded[:, heads + self.kv_heads:], index)
            attended, _ = attention(module, padded[:, :heads], k, v, mask, dropout=0.0, scaling=module.scaling)
            x = x + out.compute(attended.reshape(rows * width, -1)[tokens])
            hidden = gate_up.compute(rms_norm(x, w_post, eps_post))
            x = x + down.compute(F.silu(hidden[:, :inter]) * hidden[:, inter:])
            if index + 1 in layers:
                captured[index + 1] = x[kept]
        final = body.norm
        return self.head.compute(rms_norm(x[kept], final.weight, final.variance_epsilon)), captured


def lean_supported(model: nn.Module) -> bool:
    """Whether :class:`LeanLlama` computes this model: a plain Llama (SiLU MLP, default or scaled rotary
    embedding, no tensor-parallel split) whose linears are all packed, fused where they share an input, or all
    plain ``nn.Linear``."""
    config = model.config
    if type(model).__name__ != "LlamaForCausalLM" or getattr(config, "hidden_act", None) != "silu":
        return False
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        return False
    layers = model.model.layers
    if all(packed_layer(layer) for layer in layers) and isinstance(model.lm_head, PackedLinear):
        return True
    plain = [getattr(layer.self_attn, n) for layer in layers for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    plain += [getattr(layer.mlp, n) for layer in layers for n in ("gate_proj", "up_proj", "down_proj")]
    return all(type(lin) is nn.Linear for lin in [*plain, model.lm_head])

def packed_layer(layer: nn.Module) -> bool:
    """Whether a decoder layer's linears are packed as the lean forward reads them: q, k and v fused, gate
    and up fused, the other two packed alone."""
    attn, mlp = layer.self_attn, layer.mlp
    return (isinstance(attn.q_proj, FusedMember) and attn.q_proj.index == 0 and len(attn.q_proj.group.sizes) == 3
            and isinstance(mlp.gate_proj, FusedMember) and len(mlp.gate_proj.group.sizes) == 2
            and isinstance(attn.o_proj, PackedLinear) and isinstance(mlp.down_proj, PackedLinear))


def make_lean(model: nn.Module) -> bool:
    """Give ``model`` a lean forward if it qualifies (:func:`lean_supported`); returns whether it did."""
    if not lean_supported(model):
        return False
    setattr(model, LEAN, LeanLlama(model))
    return True


def is_lean(model: nn.Module) -> bool:
    return getattr(model, LEAN, None) is not None


def runs_lean(model: nn.Module) -> bool:
    """Whether :func:`model_forward` runs ``model``'s lean forward now. A model whose forward was replaced on
    the instance or that carries hooks on its top module is being watched or changed (tests slow it down,
    users trace it): it goes through transformers, which runs them."""
    return (getattr(model, LEAN, None) is not None and "forward" not in vars(model)
            and not (model._forward_hooks or model._forward_pre_hooks))


def model_forward(model: nn.Module, input_ids: torch.Tensor, cache: Any, *, keep: int = 1,
                  attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                  layers: tuple[int, ...] = (), ragged: Ragged | None = None
                  ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Feed ``input_ids`` [rows, width] through ``model`` over ``cache``; return the logits of the last
    ``keep`` positions [rows, keep, vocab] in the model's dtype, and the hidden states there after each block
    in ``layers`` (1 = after the first block, HF's ``hidden_states`` convention) [rows, keep, d]. With
    ``ragged`` (rows of different lengths, :class:`Ragged`): the logits and hidden states of each row's kept
    tokens, rows one after another, [kept, vocab] and [kept, d]; only the lean forward skips the padding
    (:func:`runs_lean`), transformers' computes it and the outputs are picked from its."""
    if runs_lean(model):
        return getattr(model, LEAN)(input_ids, cache, attention_mask, position_ids, keep, layers, ragged)
    if ragged is not None:
        rows, width = input_ids.shape
        logits, hidden = model_forward(model, input_ids, cache, keep=width, attention_mask=attention_mask,
                                       position_ids=position_ids, layers=layers)
        picked = ragged.tokens(width, input_ids.device)[ragged.kept(input_ids.device)]
        return (logits.reshape(rows * width, -1)[picked],
                {layer: h.reshape(rows * width, -1)[picked] for layer, h in hidden.items()})
    captured: dict[int, torch.Tensor] = {}
    handles = [model.model.layers[layer - 1].register_forward_hook(
        lambda _m, _i, out, layer=layer: captured.__setitem__(layer, out[0] if isinstance(out, tuple) else out))
        for layer in layers]
    extra = {k: v for k, v in (("attention_mask", attention_mask), ("position_ids", position_ids)) if v is not None}
    try:
        out = model(input_ids=input_ids, **cache_keyword(model, cache), use_cache=True, logits_to_keep=keep, **extra)
    finally:
        for handle in handles:
            handle.remove()
    return out.logits[:, -keep:], {layer: h[:, -keep:] for layer, h in captured.items()}
