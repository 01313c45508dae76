"""The in-place KV cache gives the same logits as transformers' DynamicCache through the edits decoding and
labeling make (append, rollback, copy, batch repeat and select), and really appends in place."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from pivotspec.decoding.kvcache import GrowingLayer, growing_cache


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_growing_cache_matches_dynamic_cache(tiny_dir, load, arch):
    model = load(tiny_dir[f"{arch}_target"]).model
    g = torch.Generator().manual_seed(0)

    @torch.inference_mode()
    def script(cache):
        outs = []

        def step(ids):
            out = model(input_ids=ids, cache=cache, use_cache=True).logits
            outs.append(out)

        step(torch.randint(0, 20, (1, 7), generator=g))  # prefill
        for _ in range(70):  # past the first buffer's 64 slots: one regrowth
            step(torch.randint(0, 20, (1, 1), generator=g))
        cache.crop(-5)  # rollback, then overwrite the dropped slots
        step(torch.randint(0, 20, (1, 3), generator=g))
        cache = copy.deepcopy(cache)
        cache.batch_repeat_interleave(4)
        step(torch.randint(0, 20, (4, 1), generator=g))
        cache.batch_select_indices(torch.tensor([0, 2]))
        for _ in range(3):
            step(torch.randint(0, 20, (2, 1), generator=g))
        return outs, cache

    g.manual_seed(0)
    want, plain = script(DynamicCache(config=model.config))
    g.manual_seed(0)
    got, grown = script(growing_cache(model.config))
    assert all(isinstance(layer, GrowingLayer) for layer in grown.layers)
    assert grown.get_seq_length() == plain.get_seq_length() == 79
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_growing_layer_appends_into_its_buffer():
    layer = GrowingLayer()
    k = torch.randn(1, 2, 3, 4)
    layer.update(k, k.clone())
    ptr = layer.keys.data_ptr()
    for _ in range(10):
        layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert layer.keys.data_ptr() == ptr and layer.keys.shape[-2] == 13  # no copy while capacity lasts
    torch.testing.assert_close(layer.keys[..., :3, :], k)
    layer.crop(-4)
    new = torch.randn(1, 2, 1, 4)
    layer.update(new, new.clone())
    assert layer.keys.shape[-2] == 10 and torch.equal(layer.keys[..., -1:, :], new)
