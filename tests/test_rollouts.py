"""Rollouts of several prefixes in one left-padded batch equal each prefix's own batch: the same tokens,
greedy and sampled (each request draws from its own generator), with per-request length caps and stop ids."""

from __future__ import annotations

import pytest
import torch

from pivotspec.decoding.sampling import SamplingConfig
from pivotspec.labels.rollouts import RolloutRequest, TorchEngine, batched_rollouts, can_pad, padded_rollouts
from tests.test_architectures import config_for
from tests.test_sampling import small_vocab_pair  # noqa: F401

PREFIXES = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 3], [5, 6, 7, 20, 21, 22]]  # different lengths: real padding


def requests(seed: int, lm) -> list[RolloutRequest]:
    firsts = [[4, 4, 9, 1], [7, 7, 7], [13, 1, 2, 2, 2]]  # token 1 is a stop id: that row ends at once
    caps = [12, 6, 9]
    return [RolloutRequest(p, f, torch.Generator(device=lm.device).manual_seed(seed + k), cap)
            for k, (p, f, cap) in enumerate(zip(PREFIXES, firsts, caps, strict=True))]


@pytest.mark.parametrize("name", ["llama_target", "qwen3_target"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_batch_equals_one_prefix_at_a_time(tiny_dir, load, name, temperature):
    lm = load(tiny_dir[name])
    cfg = SamplingConfig(temperature, 0, 1.0)
    assert can_pad(lm)
    alone = [batched_rollouts(lm, r.prefix, r.first_tokens, cfg, r.max_tokens, {1}, r.generator)
             for r in requests(7, lm)]
    together = padded_rollouts(lm, requests(7, lm), cfg, {1})
    assert together == alone
    assert TorchEngine(lm).rollouts_many(requests(7, lm), cfg, {1}) == alone
    for out, r in zip(together, requests(7, lm), strict=True):
        assert [c[0] for c in out] == r.first_tokens
        assert all(len(c) <= r.max_tokens and 1 not in c[1:-1] for c in out)
    assert max(len(c) for c in together[0]) == 12  # the long cap was reached by some row


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_rollouts_are_the_target_s_own_greedy_continuations(tiny_dir, load, padded):
    """Temperature 0 is greedy: every row is what the target alone decodes greedily after prefix + its first
    token. (It sampled at temperature 1 before: ``logits_to_probs`` gives the plain softmax when greedy, and the
    rollouts drew from it; vLLM's rollouts were greedy, so the two engines' labels differed at temperature 0.)"""
    from pivotspec.decoding.loop import decode

    lm = load(tiny_dir["llama_target"])
    cfg = SamplingConfig(0.0, 0, 1.0)
    reqs = requests(5, lm)
    outs = (padded_rollouts(lm, reqs, cfg, {1}) if padded else
            [batched_rollouts(lm, r.prefix, r.first_tokens, cfg, r.max_tokens, {1}, r.generator) for r in reqs])
    for r, out in zip(reqs, outs, strict=True):
        for first, row in zip(r.first_tokens, out, strict=True):
            if first == 1:  # a stop id: nothing follows
                assert row == [1]
                continue
            ar = decode("ar", lm, None, r.prefix + [first], max_new_tokens=r.max_tokens - 1, eos_ids={1})
            assert row == [first] + ar.token_ids, (r.prefix, first)


def test_a_walks_cache_is_read_not_changed(tiny_dir, load):
    lm = load(tiny_dir["llama_target"])
    cfg = SamplingConfig(1.0, 0, 1.0)
    reqs = requests(3, lm)
    lm.reset()
    lm.advance(reqs[0].prefix)
    reqs[0].cache = lm.cache
    keys = [layer.keys.clone() for layer in lm.cache.layers]
    lm.cache, lm.cached_ids = None, []  # as the labeling driver leaves it: the walk's cache is put aside
    with_cache = padded_rollouts(lm, reqs, cfg, {1})
    assert all(torch.equal(layer.keys, k) for layer, k in zip(reqs[0].cache.layers, keys, strict=True))
    assert with_cache == padded_rollouts(lm, requests(3, lm), cfg, {1})  # the same as running the prefix anew


def test_sliding_window_models_roll_out_one_prefix_at_a_time(tmp_path):
    from transformers import AutoModelForCausalLM

    from pivotspec.decoding.models import load_lm
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    for arch in ("mistral", "gemma3"):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config_for(arch, 2, len(tok))).save_pretrained(tmp_path / arch)
        tok.save_pretrained(tmp_path / arch)
        lm = load_lm(str(tmp_path / arch))
        assert not can_pad(lm)
        cfg = SamplingConfig(1.0, 0, 1.0)
        alone = [batched_rollouts(lm, r.prefix, r.first_tokens, cfg, r.max_tokens, {1}, r.generator)
                 for r in requests(5, lm)]
        assert TorchEngine(lm).rollouts_many(requests(5, lm), cfg, {1}) == alone


def test_policy_rollouts_are_batch1_decodes_of_the_policy(tiny_dir, load):
    """Every continuation is what ``decode`` gives for prefix + first token under the same policy and the row's
    seed (drawn from the request's generator), whether its request is batched with others or alone."""
    from pivotspec.decoding.acceptance import PAD, constant_classifier
    from pivotspec.decoding.loop import decode
    from pivotspec.labels.rollouts import PolicyEngine

    target, draft = load(tiny_dir["llama_target"]), load(tiny_dir["llama_draft"])
    pad = PAD(constant_classifier(0.2), sigma=0.5, p_floor=0.0)  # keeps drafts SD would reject
    engine = PolicyEngine(target, draft, pad, gamma=3)
    cfg = SamplingConfig(1.0, 0, 1.0)
    together = engine.rollouts_many(requests(7, target), cfg, {1})
    alone = [engine.rollouts(r.prefix, r.first_tokens, cfg, r.max_tokens, {1}, r.generator)
             for r in requests(7, target)]
    assert together == alone
    overrides = 0
    for r, outs in zip(requests(7, target), together, strict=True):
        seeds = torch.randint(0, 2**62, (len(r.first_tokens),), generator=r.generator).tolist()
        for t, seed, out in zip(r.first_tokens, seeds, outs, strict=True):
            if t == 1:
                assert out == [1]
                continue
            ref = decode("pad", target, draft, r.prefix + [t], pad, cfg=cfg, gamma=3, max_new_tokens=r.max_tokens - 1,
                         eos_ids={1}, seed=seed)
            assert out == [t] + ref.token_ids
            overrides += ref.stats["override"]
    assert overrides > 0  # the policy did act


@pytest.mark.parametrize("sigma, follows_target", [(0.0, True), (1.0, False)])
def test_policy_rollouts_at_sigma0_sample_the_target(small_vocab_pair, sigma, follows_target):  # noqa: F811
    """Under PAD at sigma 0 (lossless SD) a rollout's next token follows the target's distribution (chi-square
    against the exact one); at sigma 1 with a classifier that keeps everything it follows the draft's, and the
    same test rejects it."""
    from pivotspec.decoding.acceptance import PAD, constant_classifier
    from pivotspec.labels.rollouts import PolicyEngine
    from tests.test_sampling import chi_square_pvalue, exact_marginals

    target, draft = small_vocab_pair
    cfg = SamplingConfig(1.0, 0, 1.0)
    engine = PolicyEngine(target, draft, PAD(constant_classifier(0.0), sigma=sigma, p_floor=0.0), gamma=2)
    outs = engine.rollouts([1, 2], [3] * 1200, cfg, 3, set(), torch.Generator().manual_seed(5))
    counts = torch.tensor([float(sum(o[1] == i for o in outs)) for i in range(8)])
    expected, _ = exact_marginals(target, [1, 2, 3], cfg)
    assert (chi_square_pvalue(counts, expected) > 0.001) == follows_target
