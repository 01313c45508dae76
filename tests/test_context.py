"""Context-aware pivot classifiers (issue 30, item 5): what the draft wrote of the answer so far, computed the
same way by the decoding loops, the labeling walk and its rollouts, and training (the training side is checked
against a decode in test_classifier's feature-equality test)."""

from __future__ import annotations

import math

import torch

from pivotspec.classifier.model import context_features
from pivotspec.decoding.acceptance import PAD, Context
from pivotspec.decoding.sampling import SamplingConfig
from pivotspec.labels.rollouts import PolicyEngine, RolloutRequest


def test_context_of_sources():
    assert Context.of([]) == Context(0, 0, 0)
    assert Context.of(["target", "override", "accepted", "corrected"]) == Context(4, 1, 2)
    assert Context.of(["override"]) == Context(1, 1, 0)
    assert Context.of(["accepted", "bonus"]) == Context(2, 0, 2)  # no override: since the answer began


def test_context_features_count_the_step_s_earlier_rejections_as_overrides():
    """d_i is emitted only if d_1 .. d_{i-1} were all kept, so each of those SD rejected was an override."""
    got = context_features(Context(10, 2, 3), torch.tensor([True, False, True, False]))
    overrides, generated, since = [2, 2, 3, 3], [10, 11, 12, 13], [3, 4, 0, 1]
    want = [[math.log1p(o), o / g, math.log1p(s)] for o, g, s in zip(overrides, generated, since, strict=True)]
    torch.testing.assert_close(got, torch.tensor(want))
    assert context_features(Context(0, 0, 0), torch.tensor([False]))[0].tolist() == [0.0, 0.0, 0.0]


def test_policy_rollouts_see_the_walk_s_answer_as_context(tiny_dir, load):
    """A rollout continues the walk's answer: its rows' first verification sees the walk's overrides, plus d as
    one more when the rollout starts with d."""
    target, draft = load(tiny_dir["llama_target"]), load(tiny_dir["llama_draft"])
    seen = []

    def classify(v):
        seen.append((int(v.draft_tokens.shape[0]), v.context))
        return torch.ones(v.draft_tokens.shape[0])  # never overrides: only the context is under test

    engine = PolicyEngine(target, draft, PAD(classify, sigma=0.5, p_floor=0.0), gamma=2)
    d, t = 5, 6
    request = RolloutRequest([3, 4, 7, 8], [d, t], torch.Generator().manual_seed(0), 6,
                             sources=["target", "override", "target"], draft_token=d)
    engine.rollouts_many([request], SamplingConfig(1.0, 0, 1.0), set())
    firsts = {c for _, c in seen if c.generated == 4}
    assert firsts == {Context(4, 2, 0), Context(4, 1, 2)}
