"""Relaxed acceptance baselines: each rule's defining property, and exact SD at its neutral knob."""

from __future__ import annotations

import math

import pytest
import torch

from pivotspec.decoding.acceptance import Verification
from pivotspec.decoding.baselines import Divergence, Ensemble, Threshold, TopK, Typical, label, make_baseline
from pivotspec.decoding.loop import decode
from pivotspec.decoding.sampling import SamplingConfig
from pivotspec.errors import UsageError

P = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0]])
Q = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])


def verification(drafts: list[int]) -> Verification:
    return Verification(torch.tensor(drafts), torch.log(P.clamp_min(1e-12)), torch.log(Q), SamplingConfig())


def test_typical_acceptance():
    v = verification([1, 2])
    got = Typical(epsilon=0.09, delta=0.3).override(v)
    h = [-(row[row > 0] * row[row > 0].log()).sum().item() for row in P[:2]]
    floors = [min(0.09, 0.3 * math.exp(-x)) for x in h]
    assert got.tolist() == [P[0, 1] > floors[0], P[1, 2] > floors[1]]
    assert not Typical(epsilon=1.0, delta=float("inf")).override(v).any()


def test_topk_relaxed():
    v = verification([1, 3])
    assert TopK(k=2, ratio=0.5).override(v).tolist() == [True, True]  # 0.3 >= 0.25; uniform row: all tied
    assert TopK(k=2, ratio=0.7).override(v).tolist() == [False, True]
    assert TopK(k=1, ratio=0.0).override(verification([1, 0])).tolist()[0] is False
    assert not TopK(k=0).override(v).any()


def test_threshold():
    v = verification([2, 0])
    assert Threshold(0.2).override(v).tolist() == [False, True]
    assert Threshold(0.1).override(v).tolist() == [True, True]


def test_ensemble_greedy_uses_the_mixture_argmax():
    v = verification([1, 0])
    # w = 0.3: 0.3 * 0.5 + 0.7 * 0.1 = 0.22 for token 0 vs 0.3 * 0.3 + 0.7 * 0.6 = 0.51 for token 1
    assert Ensemble(w=0.3).override(v).tolist()[0] is True
    assert Ensemble(w=1.0).override(v).tolist()[0] is False  # w = 1 is the target itself


def test_divergence():
    v = verification([1, 0])
    got = Divergence(threshold=1e-6, divergence="js").override(v)
    assert got.tolist() == [False, True]  # row 2: p == q
    assert Divergence(threshold=10, divergence="kl").override(v).all()


@pytest.mark.parametrize("neutral", ["typical:epsilon=1,delta=inf", "topk:k=0", "threshold:threshold=1",
                                     "ensemble:w=1", "divergence:threshold=0"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_neutral_knob_is_lossless_sd(tiny_dir, load, neutral, temperature):
    target, draft = load(tiny_dir["llama_target"]), load(tiny_dir["llama_draft"])
    cfg = SamplingConfig(temperature)
    policy = make_baseline(neutral)
    for seed, ids in enumerate([[3, 4, 5], [9, 10], [20, 21, 22, 23]]):
        sd = decode("sd", target, draft, ids, cfg=cfg, gamma=3, max_new_tokens=12, eos_ids=set(), seed=seed)
        bl = decode("pad", target, draft, ids, policy, cfg=cfg, gamma=3, max_new_tokens=12, eos_ids=set(), seed=seed)
        assert bl.token_ids == sd.token_ids and bl.stats["override"] == 0


def test_relaxed_rule_accepts_more(tiny_dir, load):
    target, draft = load(tiny_dir["llama_target"]), load(tiny_dir["llama_draft"])
    sd = decode("sd", target, draft, [3, 4, 5], gamma=4, max_new_tokens=20, eos_ids=set())
    relaxed = decode("pad", target, draft, [3, 4, 5], make_baseline("threshold:threshold=0.0"), gamma=4,
                     max_new_tokens=20, eos_ids=set())
    assert relaxed.stats["corrected"] == 0 and relaxed.stats["target_forwards"] <= sd.stats["target_forwards"]


def test_specs_and_labels():
    assert label(make_baseline("topk:k=3,ratio=0.2")) == "topk(k=3,ratio=0.2)"
    for bad, match in [("nope", "unknown baseline"), ("topk:q=1", "no knob"), ("topk:k=x", "bad value"),
                       ("divergence:divergence=xx", "unknown divergence")]:
        with pytest.raises(UsageError, match=match):
            make_baseline(bad)
