"""The decoding loop: exactness of SD and PAD(sigma=0), stopping, stats, cache rollback."""

from __future__ import annotations

import random

import pytest
import torch

from pivotspec.decoding.acceptance import PAD, constant_classifier
from pivotspec.decoding.loop import decode, generate

ARCHS = ["llama", "qwen3"]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 32) for _ in range(rng.randint(1, 12))] for _ in range(n)]


@pytest.fixture(params=ARCHS)
def pair(request, tiny_dir, load):
    return load(tiny_dir[f"{request.param}_target"]), load(tiny_dir[f"{request.param}_draft"])


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_sd_and_pad_sigma0_equal_target_only(pair, gamma):
    target, draft = pair
    # sigma = 0 with a classifier that calls nothing a pivot: any override would show up as a difference.
    pad = PAD(constant_classifier(0.0), sigma=0.0, p_floor=0.0)
    for i, ids in enumerate(prompts(12)):
        max_new = 7 + 3 * i  # budgets that end inside a draft block for most gammas
        ar = decode("ar", target, None, ids, max_new_tokens=max_new, eos_ids=set())
        sd = decode("sd", target, draft, ids, gamma=gamma, max_new_tokens=max_new, eos_ids=set())
        pd = decode("pad", target, draft, ids, pad, gamma=gamma, max_new_tokens=max_new, eos_ids=set())
        assert sd.token_ids == ar.token_ids
        assert pd.token_ids == ar.token_ids
        assert len(ar.token_ids) == max_new
        assert sd.stats["override"] == pd.stats["override"] == 0


def test_eos_inside_a_draft_stops_like_target_only(pair):
    target, _ = pair
    checked = 0
    for ids in prompts(8, seed=1):
        ar_full = decode("ar", target, None, ids, max_new_tokens=20, eos_ids=set())
        eos = ar_full.token_ids[5]  # declare a token the target emits mid-way to be EOS
        expected = ar_full.token_ids[: ar_full.token_ids.index(eos) + 1]
        # Draft = target: every draft is accepted, so the EOS arrives inside an accepted draft block.
        sd = decode("sd", target, target, ids, gamma=8, max_new_tokens=20, eos_ids={eos})
        assert sd.token_ids == expected
        assert sd.stats["stop_reason"] == "eos"
        checked += sd.trace[-1][1] == "accepted"
    assert checked > 0


def test_stop_string_truncates_mid_draft(pair):
    target, _ = pair
    ids = prompts(1, seed=2)[0]
    ar = decode("ar", target, None, ids, max_new_tokens=16, eos_ids=set())
    stop_word = target.tokenizer.decode([ar.token_ids[6]])
    expected = ar.token_ids[: next(i for i, t in enumerate(ar.token_ids) if t == ar.token_ids[6]) + 1]
    sd = decode("sd", target, target, ids, gamma=8, max_new_tokens=16, eos_ids=set(), stop_strings=[stop_word])
    assert sd.token_ids == expected
    assert sd.stats["stop_reason"] == "stop_string"


def test_pad_sigma1_tau0_keeps_every_draft_token(pair):
    """sigma = 1, tau = 0 accepts every draft token, so each emitted token is the draft's greedy choice
    except the bonus token closing each block, which by definition comes from the target."""
    target, draft = pair
    pad = PAD(constant_classifier(0.9), sigma=1.0, p_floor=0.0)
    for ids in prompts(6, seed=3):
        pd = decode("pad", target, draft, ids, pad, gamma=4, max_new_tokens=15, eos_ids=set())
        assert pd.stats["corrected"] == 0 and pd.stats["drafted"] == 12
        assert pd.stats["accepted"] + pd.stats["override"] == 12 and pd.stats["bonus"] == 3
        draft.reset()
        logits, _ = draft.forward(ids + pd.token_ids, keep_logits=len(pd.token_ids) + 1)
        draft_choice = logits.argmax(-1)[:-1].tolist()
        for pos, (token, source) in enumerate(pd.trace):
            if source != "bonus":
                assert token == draft_choice[pos]
        # With the bonus positions teacher-forced, draft-only decoding gives the same tokens.
        dr = decode("draft", None, draft, ids + pd.token_ids[:5], max_new_tokens=4, eos_ids=set())
        assert dr.token_ids == pd.token_ids[5:9]
        assert dr.stats["target_forwards"] == 0 and dr.stats["draft_forwards"] == 4


def test_stats_add_up(pair):
    target, draft = pair
    pad = PAD(constant_classifier(0.4), sigma=0.5, p_floor=0.0)
    for method, policy in [("ar", None), ("sd", None), ("pad", pad)]:
        for ids in prompts(4, seed=4):
            g = decode(method, target, draft, ids, policy, gamma=3, max_new_tokens=17, eos_ids=set())
            s = g.stats
            emitted = s["accepted"] + s["override"] + s["corrected"] + s["bonus"] + s["target"]
            assert emitted == s["new_tokens"] == len(g.token_ids) == len(g.trace)
            assert [src for _, src in g.trace].count("override") == s["override"]
            assert s["tau"] == pytest.approx(s["new_tokens"] / s["target_forwards"])
            if method != "ar":
                assert s["eta"] == pytest.approx((s["accepted"] + s["override"]) / s["drafted"])
                assert s["corrected"] + s["bonus"] == s["target_forwards"]
            if method == "pad":
                assert s["override"] > 0


@pytest.mark.parametrize("gamma", [2, 5])
def test_draft_equal_to_target_gives_tau_gamma_plus_one(pair, gamma):
    target, _ = pair
    steps = 4
    g = decode("sd", target, target, [5, 6, 7], gamma=gamma, max_new_tokens=steps * (gamma + 1), eos_ids=set())
    assert g.stats["target_forwards"] == steps
    assert g.stats["tau"] == gamma + 1
    assert g.stats["accepted"] == steps * gamma and g.stats["bonus"] == steps


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_rollback_matches_fresh_forward(tiny_dir, load, arch):
    lm = load(tiny_dir[f"{arch}_target"])
    a, b = [3, 4, 5, 6, 7, 8], [9, 10, 11]
    lm.reset()
    lm.forward(a, keep_logits=0)
    lm.forward([20, 21, 22, 23], keep_logits=1)  # tokens to be rejected
    lm.rollback(4)
    assert lm.cached_ids == a and lm.cache.get_seq_length() == len(a)
    after, _ = lm.forward(b, keep_logits=len(b))
    lm.reset()
    fresh, _ = lm.forward(a + b, keep_logits=len(b))
    # Chunked and one-pass float32 forwards round differently (1.4e-5 seen on logits of size ~1 with AVX2 and
    # AVX-512 kernels); a stale or misaligned cache after rollback moves logits by orders of magnitude more.
    torch.testing.assert_close(after, fresh, atol=1e-4, rtol=1e-4)


def test_hidden_state_is_the_chosen_layer(tiny_dir, load):
    lm = load(tiny_dir["llama_target"])
    ids = [3, 4, 5, 6]
    lm.reset()
    _, hidden = lm.forward(ids, keep_logits=2, hidden_layer=2)
    out = lm.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(hidden, out.hidden_states[2][0, -2:], atol=1e-5, rtol=1e-4)  # fused layers: rounding


def test_generate_does_not_recompute_the_prompt(tiny_dir, load):
    target, draft = load(tiny_dir["llama_target"]), load(tiny_dir["llama_draft"])
    fed = []
    original = target.forward

    def spy(ids, *a, **k):
        fed.append(len(ids))
        return original(ids, *a, **k)

    target.forward = spy
    try:
        g = generate(target, list(range(2, 22)), draft=draft, gamma=3, max_new_tokens=12, eos_ids=set())
    finally:
        del target.forward
    # prefill: 19 tokens once; then each step feeds 1 pending token + at most gamma drafts.
    assert fed[0] == 19 and all(n <= 4 for n in fed[1:])
    assert sum(fed) == 19 + g.stats["target_forwards"] + g.stats["drafted"]


def test_reduced_vocab_draft_drafts_without_full_vocab_logits(tiny_dir, load, tmp_path):
    """A draft whose output layer covers a subset of ids (the testbed draft's shape): its greedy token is
    found in its own rows and mapped to an id, which must equal the argmax over the full id space, and
    greedy SD with it must still equal target-only decoding."""
    from transformers import AutoModelForCausalLM

    from pivotspec.decoding.models import reduced_vocab_lm
    from tests.conftest import make_tiny_model

    target = load(tiny_dir["llama_target"])
    token_ids = list(range(1, 32, 2))  # 16 ids; output row 16 is the shared unknown-id row
    path = make_tiny_model(tmp_path / "reduced", "llama", seed=5, layers=1, vocab=len(token_ids) + 1)
    draft = reduced_vocab_lm("reduced", AutoModelForCausalLM.from_pretrained(path), target.tokenizer, token_ids,
                             target.vocab_size)
    rows = torch.randn(20, len(token_ids) + 1) * 3
    for row in rows:
        assert draft.greedy_token(row, target.vocab_size) == int(draft.full_vocab(row[None]).argmax())
    for i, ids in enumerate(prompts(6, seed=3)):
        ar = decode("ar", target, None, ids, max_new_tokens=9 + i, eos_ids=set())
        sd = decode("sd", target, draft, ids, gamma=4, max_new_tokens=9 + i, eos_ids=set())
        assert sd.token_ids == ar.token_ids
        dr = decode("draft", None, draft, ids, max_new_tokens=6, eos_ids=set())
        assert set(dr.token_ids) <= set(token_ids)


def test_the_cache_goes_by_the_name_the_model_takes(tiny_dir, load):
    """transformers 5.24 takes ``cache`` (and the old name, with a warning); 5.17, on the GPU machines, only
    ``past_key_values``: an unknown keyword would vanish into ``**kwargs`` and the model run without its cache."""
    import types

    lm = load(tiny_dir["llama_target"])
    assert list(lm.with_cache("C")) == ["cache"]
    old = types.SimpleNamespace(forward=lambda input_ids=None, past_key_values=None, **kwargs: None)
    assert lm.__class__.with_cache(types.SimpleNamespace(model=old), "C") == {"past_key_values": "C"}
