"""The lean Llama forward computes what transformers computes, bit for bit, in every way the decoding loops call
it: one sequence over a growing cache (decode steps, verification blocks, rollback), a batch over the slot
cache with its masks and positions, and rollouts with a padding mask; and it is used only where it applies."""

from __future__ import annotations

import functools

import pytest
import torch

from pivotspec.decoding import fastpath
from pivotspec.decoding.forward import LEAN, is_lean, model_forward
from pivotspec.decoding.kvcache import growing_cache
from pivotspec.decoding.slots import SlotCache, attention_masks
from tests.test_fastpath import DTYPES


def tiny_llama(seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = dict(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.2)
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides})).eval()


@pytest.fixture(params=[True, False], ids=["packed", "plain"])
def packed(request):
    return request.param


def pair_of(dtype: str, packed: bool, **overrides):
    """The same model twice, its linears packed or not: with the lean forward, and through transformers (its lean
    one removed)."""
    lean, reference = (fastpath.convert(tiny_llama(**overrides), fastpath.CpuPath(dtype, packed)) for _ in range(2))
    delattr(reference, LEAN)  # (packed weights are opaque tensors: a model is built twice, not copied)
    assert is_lean(lean) and not is_lean(reference)
    return lean, reference


def same(a, b):
    (logits_a, hidden_a), (logits_b, hidden_b) = a, b
    assert torch.equal(logits_a, logits_b)
    assert hidden_a.keys() == hidden_b.keys() and all(torch.equal(hidden_a[k], hidden_b[k]) for k in hidden_a)


@pytest.mark.parametrize("kv_heads", [2, 4])  # grouped-query attention and plain multi-head (the testbed drafts)
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_sequence_over_a_growing_cache(dtype, kv_heads, packed):
    lean, reference = pair_of(dtype, packed, num_key_value_heads=kv_heads)
    caches = {id(m): growing_cache(m.config) for m in (lean, reference)}
    with torch.inference_mode():
        for ids, keep, layers in [([3, 9, 4, 17, 5, 8, 1], 2, (1,)), ([22], 1, (1, 3)), ([6, 2, 7, 30, 11, 4], 6, (2,)),
                                  ("rollback", 4, ()), ([40, 12, 3], 3, (1,))]:
            outs = []
            for model in (lean, reference):
                cache = caches[id(model)]
                if ids == "rollback":
                    cache.crop(-keep)
                    continue
                outs.append(model_forward(model, torch.tensor([ids]), cache, keep=keep, layers=layers))
            if outs:
                same(*outs)
                assert outs[0][0].shape == (1, keep, 50)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_over_the_slot_cache_with_masks_and_positions(dtype, packed):
    lean, reference = pair_of(dtype, packed)
    prompts = [[3, 9, 4, 17, 5], [8, 1], [22, 6, 2, 7, 30, 11, 4, 40]]
    with torch.inference_mode():
        outs = []
        for model in (lean, reference):
            slots = SlotCache(model.config, model.dtype, torch.device("cpu"))
            for ids in prompts:  # each row joins from its own batch-1 prefill, as the batch does
                prefill = growing_cache(model.config)
                model_forward(model, torch.tensor([ids]), prefill)
                slots.add_row(prefill, len(ids))
            width = 3
            slots.prepare(width)
            masks = attention_masks(model.config, slots.lengths, width, max(slots.lengths) + width,
                                    torch.device("cpu"), model.dtype)
            positions = torch.tensor(slots.lengths)[:, None] + torch.arange(width)
            ids = torch.tensor([[5, 6, 7], [9, 0, 0], [1, 2, 3]])
            outs.append(model_forward(model, ids, slots, keep=width, attention_mask=masks, position_ids=positions,
                                      layers=(2,)))
        same(*outs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rollouts_with_a_padding_mask(dtype, packed):
    lean, reference = pair_of(dtype, packed)
    with torch.inference_mode():
        outs = []
        for model in (lean, reference):
            cache = growing_cache(model.config)
            mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding, as the rollout engine pads
            model_forward(model, torch.tensor([[0, 0, 4, 5, 6], [7, 8, 9, 10, 11]]), cache, attention_mask=mask,
                          position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            outs.append(model_forward(model, torch.tensor([[12], [13]]), cache, attention_mask=mask,
                                      position_ids=torch.tensor([[3], [5]])))
        same(*outs)


def test_lean_forward_only_where_it_computes_the_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    assert is_lean(fastpath.convert(tiny_llama(), fastpath.CpuPath("float32", True)))
    assert is_lean(fastpath.convert(tiny_llama(), fastpath.CpuPath("float32", False)))  # over its own linears
    assert not is_lean(fastpath.convert(tiny_llama(hidden_act="gelu"), fastpath.CpuPath("float32", True)))
    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_dir["qwen3_target"]).eval()  # q/k norms: not a plain Llama
    assert not is_lean(fastpath.convert(qwen3, fastpath.CpuPath("float32", True)))


def test_a_watched_model_goes_through_transformers():
    model = fastpath.convert(tiny_llama(), fastpath.CpuPath("float32", True))
    seen = []
    real = model.forward
    # replaced on the instance (wrapped: the cache keyword is read from its signature)
    model.forward = functools.wraps(real)(lambda *a, **k: seen.append("forward") or real(*a, **k))
    model_forward(model, torch.tensor([[3, 4]]), growing_cache(model.config))
    del model.forward
    handle = model.register_forward_hook(lambda *_: seen.append("hook"))
    model_forward(model, torch.tensor([[3, 4]]), growing_cache(model.config))
    handle.remove()
    model_forward(model, torch.tensor([[3, 4]]), growing_cache(model.config))  # lean again: nothing seen
    assert seen == ["forward", "hook"]
