"""Fused layers (``decoding/fused.py``, the layer glue of ``rowwise.c``): on the row-wise paths the lean forward
computes what PyTorch's ops compute to float32 rounding, and every row's numbers are its own, bit for bit: a
prompt in one forward or token by token, a verification block or its steps, a batch's rows or rows alone."""

from __future__ import annotations

import pytest
import torch

from pivotspec.decoding import fastpath, fused, rowwise
from pivotspec.decoding.forward import LEAN, model_forward
from pivotspec.decoding.kvcache import growing_cache
from pivotspec.decoding.slots import SlotCache, attention_masks
from pivotspec.errors import UsageError
from tests.test_forward import tiny_llama

pytestmark = pytest.mark.skipif(not rowwise.available(), reason="no C compiler to build the row-wise kernel")
PATHS = {"float32": fastpath.ROWWISE, "int8": fastpath.INT8_ROWWISE, "bfloat16": fastpath.BF16_ROWWISE}


def build(monkeypatch, dtype: str, layers: str = "fused", **overrides):
    monkeypatch.setenv("PIVOTSPEC_LAYERS", layers)
    model = fastpath.convert(tiny_llama(**overrides), PATHS[dtype])
    assert (getattr(model, LEAN).fused is not None) == (layers == "fused")
    return model


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 4}, {"attention_bias": True, "mlp_bias": True}],
                         ids=["gqa", "mha", "biases"])
@pytest.mark.parametrize("dtype", PATHS)
def test_fused_layers_compute_what_pytorchs_ops_compute(monkeypatch, dtype, overrides):
    ours, theirs = build(monkeypatch, dtype, **overrides), build(monkeypatch, dtype, "torch", **overrides)
    caches = [growing_cache(m.config) for m in (ours, theirs)]
    with torch.inference_mode():
        for ids, keep in [([3, 9, 4, 17, 5, 8, 1], 2), ([22], 1), ([6, 2, 7, 30, 11, 4], 6)]:
            (a, ha), (b, hb) = (model_forward(m, torch.tensor([ids]), c, keep=keep, layers=(1, 3))
                                for m, c in zip((ours, theirs), caches, strict=True))
            assert a.shape == b.shape == (1, keep, 50) and ha.keys() == hb.keys() == {1, 3}
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            for layer in ha:
                assert ha[layer].shape == (1, keep, 64)
                torch.testing.assert_close(ha[layer], hb[layer], rtol=1e-4, atol=1e-4)
    # the left padding of the rollout engine: attention through the model's own function, with the mask
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.inference_mode():
        a, b = (model_forward(m, torch.tensor([[0, 0, 4, 5, 6], [7, 8, 9, 10, 11]]), growing_cache(m.config),
                              attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), keep=3)[0]
                for m in (ours, theirs))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", PATHS)
def test_each_row_is_computed_alone(monkeypatch, dtype):
    model = build(monkeypatch, dtype)
    ids = [3, 9, 4, 17, 5, 8, 1, 22, 6, 2]
    with torch.inference_mode():
        whole = model_forward(model, torch.tensor([ids]), growing_cache(model.config), keep=len(ids), layers=(2,))
        cache = growing_cache(model.config)
        model_forward(model, torch.tensor([ids[:4]]), cache)
        steps = [model_forward(model, torch.tensor([[t]]), cache, layers=(2,)) for t in ids[4:]]
        # a verification block over the same prefix: its tokens get the steps' numbers
        cache = growing_cache(model.config)
        model_forward(model, torch.tensor([ids[:4]]), cache)
        block = model_forward(model, torch.tensor([ids[4:]]), cache, keep=6, layers=(2,))
    for i, (logits, hidden) in enumerate(steps):
        assert torch.equal(logits[0, 0], whole[0][0, 4 + i]) and torch.equal(logits[0, 0], block[0][0, i])
        assert torch.equal(hidden[2][0, 0], whole[1][2][0, 4 + i]) and torch.equal(hidden[2][0, 0], block[1][2][0, i])
    # a batch over the slot cache, rows of different lengths, equals each row decoded alone
    prompts = [[3, 9, 4, 17, 5], [8, 1], [22, 6, 2, 7, 30, 11, 4, 40]]
    step = [[5, 6, 7], [9, 2, 4], [1, 2, 3]]
    with torch.inference_mode():
        slots = SlotCache(model.config, model.dtype, torch.device("cpu"))
        alone = []
        for ids, nxt in zip(prompts, step, strict=True):
            prefill = growing_cache(model.config)
            model_forward(model, torch.tensor([ids]), prefill)
            slots.add_row(prefill, len(ids))
            own = growing_cache(model.config)
            model_forward(model, torch.tensor([ids]), own)
            alone.append(model_forward(model, torch.tensor([nxt]), own, keep=3)[0][0])
        slots.prepare(3)
        masks = attention_masks(model.config, slots.lengths, 3, max(slots.lengths) + 3, torch.device("cpu"),
                                model.dtype)
        positions = torch.tensor(slots.lengths)[:, None] + torch.arange(3)
        batch = model_forward(model, torch.tensor(step), slots, keep=3, attention_mask=masks, position_ids=positions)[0]
    for row, own in enumerate(alone):
        assert torch.equal(batch[row], own)


def test_pytorchs_ops_on_request_and_a_bad_setting_named(monkeypatch):
    monkeypatch.setenv("PIVOTSPEC_LAYERS", "torch")
    assert not fused.wanted()
    monkeypatch.setenv("PIVOTSPEC_LAYERS", "fast")
    with pytest.raises(UsageError, match="PIVOTSPEC_LAYERS='fast': use fused"):
        fused.wanted()
    monkeypatch.setenv("PIVOTSPEC_LAYERS", "fused")
    assert fastpath.convert(tiny_llama(), fastpath.CpuPath("float32", True)).__dict__[LEAN].fused is None  # oneDNN
