"""Lossless SD under sampling reproduces the target's distribution (chi-square on a tiny vocabulary),
and the same test catches a wrong residual."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pivotspec.decoding.loop import decode
from pivotspec.decoding.sampling import SamplingConfig, logits_to_probs, residual, sample
from tests.conftest import make_tiny_model, make_tokenizer

VOCAB = 8
SAMPLES = 1500


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory, load):
    root = tmp_path_factory.mktemp("v8")
    tok = make_tokenizer([f"t{i}" for i in range(VOCAB)])
    # Small init: spread-out distributions, and target and draft that disagree often.
    target = make_tiny_model(root / "t", seed=11, layers=2, init=0.3, vocab=VOCAB, tokenizer=tok)
    draft = make_tiny_model(root / "d", seed=12, layers=1, init=0.3, vocab=VOCAB, tokenizer=tok)
    return load(target), load(draft)


def exact_marginals(target, prompt, cfg: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact target distribution of the first and of the second generated token."""
    target.reset()
    logits, _ = target.forward(prompt, keep_logits=1)
    first = logits_to_probs(logits, cfg)[0]
    second = torch.zeros(VOCAB)
    for x in range(VOCAB):
        target.reset()
        nxt, _ = target.forward(prompt + [x], keep_logits=1)
        second += first[x] * logits_to_probs(nxt, cfg)[0]
    return first, second


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; bins with expected count < 5 are pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def sampled_counts(target, draft, prompt, cfg, residual_fn) -> tuple[torch.Tensor, torch.Tensor]:
    c1, c2 = Counter(), Counter()
    for seed in range(SAMPLES):
        g = decode("sd", target, draft, prompt, cfg=cfg, gamma=2, max_new_tokens=2, eos_ids=set(), seed=seed,
                   residual_fn=residual_fn)
        c1[g.token_ids[0]] += 1
        c2[g.token_ids[1]] += 1
    to_tensor = lambda c: torch.tensor([float(c[i]) for i in range(VOCAB)])  # noqa: E731
    return to_tensor(c1), to_tensor(c2)


CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=5, top_p=0.95)]


@pytest.mark.slow  # thousands of sampled decodes
@pytest.mark.parametrize("cfg", CONFIGS, ids=["T1", "T0.8-k5-p0.95"])
def test_sd_samples_follow_target_distribution(small_vocab_pair, cfg):
    target, draft = small_vocab_pair
    prompt = [1, 2, 3]
    first, second = exact_marginals(target, prompt, cfg)
    c1, c2 = sampled_counts(target, draft, prompt, cfg, residual)
    assert chi_square_pvalue(c1, first) > 0.001
    assert chi_square_pvalue(c2, second) > 0.001


@pytest.mark.slow  # thousands of sampled decodes
def test_wrong_residual_is_detected(small_vocab_pair):
    """Resampling from p instead of norm(max(0, p - q)) over-weights tokens the draft already favours."""
    target, draft = small_vocab_pair
    cfg = SamplingConfig(temperature=1.0)
    prompt = [1, 2, 3]
    first, _ = exact_marginals(target, prompt, cfg)
    c1, _ = sampled_counts(target, draft, prompt, cfg, lambda p, q: p)
    assert chi_square_pvalue(c1, first) < 0.001


def test_residual_and_top_p():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    probs = logits_to_probs(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), SamplingConfig(1.0, top_p=0.8))
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    top1 = logits_to_probs(torch.tensor([[1.0, 3.0, 2.0]]), SamplingConfig(1.0, top_k=1))
    torch.testing.assert_close(top1[0], torch.tensor([0.0, 1.0, 0.0]))


def test_sample_matches_its_distribution_and_never_draws_zero_mass():
    g = torch.Generator().manual_seed(3)
    # Unnormalized rows with zero-mass tokens at both ends and inside (as top-k / top-p leave them).
    probs = torch.tensor([[0.0, 2.0, 0.0, 5.0, 3.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    draws = sample(probs.repeat(4000, 1), g).view(4000, 2)
    assert draws.shape == (4000, 2) and (draws[:, 1] == 0).all()
    counts = torch.bincount(draws[:, 0], minlength=6).float()
    assert counts[[0, 2, 5]].sum() == 0
    assert chi_square_pvalue(counts, probs[0] / probs[0].sum()) > 0.001
    assert chi_square_pvalue(torch.tensor([4000.0, 0, 0, 0, 0, 0]), probs[0] / probs[0].sum()) < 0.001
    assert sample(torch.tensor([0.0, 0.0, 1.0]), g).shape == ()  # one row in, one id out


def exact_marginal_at(target, prompt, cfg: SamplingConfig, position: int) -> torch.Tensor:
    """Exact target distribution of the generated token at ``position`` (0-based), by enumerating every
    earlier continuation with its probability (VOCAB ** position prefixes)."""
    frontier = {(): 1.0}
    for _ in range(position):
        nxt = {}
        for seq, w in frontier.items():
            target.reset()
            probs = logits_to_probs(target.forward(prompt + list(seq), keep_logits=1)[0], cfg)[0]
            for x in range(VOCAB):
                if probs[x] > 0:
                    nxt[seq + (x,)] = w * float(probs[x])
        frontier = nxt
    out = torch.zeros(VOCAB)
    for seq, w in frontier.items():
        target.reset()
        out += w * logits_to_probs(target.forward(prompt + list(seq), keep_logits=1)[0], cfg)[0]
    return out


@pytest.fixture(scope="module")
def close_drafts(tmp_path_factory):
    """A target and two drafts that agree with it often (its weights plus noise), so that later draft
    positions are reached: one over the full vocabulary, one whose output layer covers only some ids (the
    testbed draft's shape: q is 0 elsewhere)."""
    from transformers import AutoModelForCausalLM

    from pivotspec.decoding.models import load_lm, reduced_vocab_lm

    root = tmp_path_factory.mktemp("close")
    tok = make_tokenizer([f"t{i}" for i in range(VOCAB)])
    target_path = make_tiny_model(root / "t", seed=11, layers=2, init=0.3, vocab=VOCAB, tokenizer=tok)
    torch.manual_seed(14)
    model = AutoModelForCausalLM.from_pretrained(target_path)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(root / "d")
    tok.save_pretrained(root / "d")
    ids = [0, 2, 3, 5, 6]
    with torch.no_grad():  # keep the rows of ``ids`` (plus one row for every other id) in and out
        rows = torch.tensor(ids + [1])
        model.model.embed_tokens.weight = torch.nn.Parameter(model.model.embed_tokens.weight[rows].clone())
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight[rows].clone())
        model.config.vocab_size = len(ids) + 1
    target = load_lm(str(target_path))
    return target, load_lm(str(root / "d")), reduced_vocab_lm("reduced", model, target.tokenizer, ids, VOCAB)


@pytest.mark.slow  # thousands of sampled decodes
@pytest.mark.parametrize("which", ["full-vocab draft", "reduced-vocab draft"])
def test_sd_samples_follow_target_distribution_at_draft_position_4(close_drafts, which):
    """gamma 4 and 5 new tokens (so the first step drafts 4): the 4th token is the 4th draft position of the
    first step (kept, or the residual sample after a rejection), where a bug in the acceptance of later
    positions would show."""
    target, full, reduced = close_drafts
    draft = reduced if which.startswith("reduced") else full
    cfg, prompt = SamplingConfig(temperature=1.0), [1, 2, 3]
    expected = exact_marginal_at(target, prompt, cfg, 3)
    counts, depth = Counter(), Counter()
    for seed in range(SAMPLES):
        g = decode("sd", target, draft, prompt, cfg=cfg, gamma=4, max_new_tokens=5, eos_ids=set(), seed=seed)
        counts[g.token_ids[3]] += 1
        depth[g.stats["accepted"]] += 1
    assert depth[3] + depth[4] > SAMPLES // 4  # the 4th draft position was reached and kept often enough to matter
    assert chi_square_pvalue(torch.tensor([float(counts[i]) for i in range(VOCAB)]), expected) > 0.001


def test_pad_sigma0_equals_sd_draw_for_draw_when_sampling(small_vocab_pair):
    from pivotspec.decoding.acceptance import PAD, constant_classifier

    target, draft = small_vocab_pair
    cfg = SamplingConfig(temperature=0.9, top_p=0.95)
    pad = PAD(constant_classifier(0.0), sigma=0.0, p_floor=0.0)  # scores 0 everywhere: any override would show
    for seed in range(40):
        sd = decode("sd", target, draft, [1, 2, 3], cfg=cfg, gamma=3, max_new_tokens=12, eos_ids=set(), seed=seed)
        pd = decode("pad", target, draft, [1, 2, 3], pad, cfg=cfg, gamma=3, max_new_tokens=12, eos_ids=set(),
                    seed=seed)
        assert pd.token_ids == sd.token_ids and pd.trace == sd.trace
