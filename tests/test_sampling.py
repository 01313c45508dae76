"""Lossless SD under sampling reproduces the target's distribution (chi-square on a tiny vocabulary),
and the same test catches a wrong residual."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pivotspec.decoding import decode
from pivotspec.sampling import SamplingConfig, logits_to_probs, residual, sample
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


@pytest.mark.parametrize("cfg", CONFIGS, ids=["T1", "T0.8-k5-p0.95"])
def test_sd_samples_follow_target_distribution(small_vocab_pair, cfg):
    target, draft = small_vocab_pair
    prompt = [1, 2, 3]
    first, second = exact_marginals(target, prompt, cfg)
    c1, c2 = sampled_counts(target, draft, prompt, cfg, residual)
    assert chi_square_pvalue(c1, first) > 0.001
    assert chi_square_pvalue(c2, second) > 0.001


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
