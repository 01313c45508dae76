"""The batched loop: every row decodes what batch 1 decodes (greedy: the same tokens and stats; sampling: the
same draws from its own generator, hence the target's distribution), rows join late and leave early, and
rows of different policies share a batch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pivotspec.decoding import batch as batch_module
from pivotspec.decoding.acceptance import PAD, constant_classifier
from pivotspec.decoding.batch import Batch, Request, decode_many
from pivotspec.decoding.loop import decode
from pivotspec.decoding.sampling import SamplingConfig
from tests.test_decoding import prompts
from tests.test_sampling import VOCAB, chi_square_pvalue, exact_marginals, small_vocab_pair  # noqa: F401

COUNTS = ("target_forwards", "draft_forwards", "drafted", "accepted", "override", "corrected", "bonus", "target",
          "new_tokens", "stop_reason", "tau", "eta")


@pytest.fixture(params=["llama", "qwen3"])
def pair(request, tiny_dir, load):
    return load(tiny_dir[f"{request.param}_target"]), load(tiny_dir[f"{request.param}_draft"])


def hidden_classifier(v):
    """Reads the target's hidden states, so a row given another row's (or another position's) hidden
    states would keep other drafts than batch 1 does."""
    return torch.sigmoid(v.hidden[1:].sum(-1) * 7.0)


def reference(method, target, draft, r: Request):
    return decode(method, target, draft, r.prompt_ids, r.policy, cfg=r.cfg, gamma=r.gamma,
                  max_new_tokens=r.max_new_tokens, eos_ids=r.eos_ids, stop_strings=r.stop_strings, seed=r.seed)


def assert_rows_equal_batch1(target, draft, jobs, max_batch):
    """jobs: (method, Request); a batch decodes them together, at most ``max_batch`` at a time. Returns it."""
    batch = Batch(target, draft)
    outs = batch.decode([r for _, r in jobs], max_batch)
    for (method, r), out in zip(jobs, outs, strict=True):
        ref = reference(method, target, draft, r)
        assert out.token_ids == ref.token_ids, (method, r.prompt_ids)
        assert out.trace == ref.trace
        assert {k: out.stats[k] for k in COUNTS} == {k: ref.stats[k] for k in COUNTS}
    return batch


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_rows_equal_batch1_with_late_joins(pair, gamma):
    target, draft = pair
    pad0 = PAD(constant_classifier(0.0), sigma=0.0, p_floor=0.0)
    pad = PAD(hidden_classifier, sigma=0.5, p_floor=0.0, hidden_layer=-1)
    jobs = []
    for i, ids in enumerate(prompts(10)):  # prompts of 1 to 12 tokens
        method, policy = [("ar", None), ("sd", None), ("pad", pad0), ("pad", pad)][i % 4]
        jobs.append((method, Request(ids, policy=policy, gamma=gamma, max_new_tokens=5 + 3 * i,
                                     speculate=method != "ar")))
    # 3 rows at a time: budgets differ, so rows leave at different steps and the others join late
    assert_rows_equal_batch1(target, draft, jobs, max_batch=3)
    assert any(r.policy is pad for _, r in jobs)


def test_pad_overrides_and_stop_strings_per_row(pair):
    target, draft = pair
    always = PAD(constant_classifier(0.0), sigma=1.0, p_floor=0.0)  # keeps every draft token
    ar = decode("ar", target, None, [5, 6, 7], max_new_tokens=16, eos_ids=set())
    stop = target.tokenizer.decode(ar.token_ids[6:8])
    jobs = [("pad", Request([5, 6, 7], policy=always, gamma=3, max_new_tokens=20)),
            ("sd", Request([5, 6, 7], gamma=3, max_new_tokens=16, stop_strings=[stop])),
            ("pad", Request([9, 3], policy=always, gamma=5, max_new_tokens=11, eos_ids={ar.token_ids[4]}))]
    assert_rows_equal_batch1(target, draft, jobs, max_batch=3)
    outs = decode_many(target, [r for _, r in jobs], draft=draft, max_batch=3)
    assert outs[0].stats["override"] > 0
    assert outs[1].stats["stop_reason"] == "stop_string"


def test_draft_only_rows_and_a_cancelled_row(pair):
    target, draft = pair
    seen = []

    def cancel_after_first_step(pairs):
        seen.append(pairs)
        return False

    rows = [Request([4, 5], max_new_tokens=12, speculate=False),
            Request([4, 5, 6], max_new_tokens=12, speculate=False, on_step=cancel_after_first_step)]
    outs = decode_many(draft, rows)  # the draft model decoding alone, as method "draft" does
    assert outs[0].token_ids == decode("ar", draft, None, [4, 5], max_new_tokens=12, eos_ids=set()).token_ids
    assert outs[1].stats["stop_reason"] == "cancelled" and len(seen) == 1 and len(outs[1].token_ids) == 1


def test_rows_leave_and_join_between_steps(pair):
    target, draft = pair
    batch = Batch(target, draft)
    batch.add(Request([3, 4, 5], max_new_tokens=4, gamma=3))
    batch.add(Request([7], max_new_tokens=40, gamma=3))
    finished = []
    while batch.rows:
        finished += [gen for _, gen in batch.step()]
        if len(finished) == 1 and len(batch.rows) == 1:
            batch.add(Request(list(range(2, 14)), max_new_tokens=9, gamma=2))  # joins mid-way
    assert len(finished) == 3
    assert [len(g.token_ids) for g in finished[:1]] == [4]
    assert batch.caches[id(target)].lengths == []


def test_leaving_rows_are_filled_from_the_end_and_the_rows_that_stay_keep_their_keys():
    from transformers import LlamaConfig

    from pivotspec.decoding.slots import SlotCache, compacted

    assert compacted(8, {2, 5}) == [0, 1, 6, 3, 4, 7]  # two moves, not four shifts
    assert compacted(8, {7}) == list(range(7)) and compacted(3, {0, 1, 2}) == [] and compacted(4, {0, 1}) == [2, 3]
    config = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1)
    cache = SlotCache(config, torch.float32, torch.device("cpu"))
    for length in (3, 5, 2, 4):
        cache.add_row(None, 0)
        cache.lengths[-1] = length
    with torch.inference_mode():  # as a forward writes them
        for layer in cache.layers:  # each row's used columns hold its own number
            for b, length in enumerate(cache.lengths):
                layer.keys[b, :, :length], layer.values[b, :, :length] = b + 1, -(b + 1)
    buffer = cache.layers[0].keys
    cache.keep_rows(compacted(4, {0, 2}))  # row 3 moves into row 0's place, row 1 stays
    assert cache.lengths == [4, 5] and cache.layers[0].keys is buffer  # moved in place, nothing reallocated
    for layer in cache.layers:
        assert (layer.keys[0, :, :4] == 4).all() and (layer.values[0, :, :4] == -4).all()
        assert (layer.keys[1, :, :5] == 2).all() and (layer.values[1, :, :5] == -2).all()
    cache.add_row(None, 0)  # a join reuses a free buffer row
    assert cache.layers[0].keys is buffer and cache.lengths == [4, 5, 0]


def test_bad_request_is_refused_before_it_joins(pair):
    from pivotspec.errors import UsageError

    target, draft = pair
    batch = Batch(target, draft)
    with pytest.raises(UsageError, match="empty"):
        batch.add(Request([]))
    with pytest.raises(UsageError, match="positions"):
        batch.add(Request([3], max_new_tokens=10_000))
    assert batch.rows == []


SAMPLED_ROWS = 480


def sampled_batch(target, draft, cfg, share_generator=False):
    """First two tokens of SAMPLED_ROWS decodes of [1, 2, 3] (seeds 0..), batched 16 at a time between rows of
    another prompt, and the same decodes one at a time."""
    jobs = []
    for seed in range(SAMPLED_ROWS):
        jobs.append(Request([1, 2, 3], cfg=cfg, gamma=2, max_new_tokens=2, seed=seed))
        jobs.append(Request([6, 7, 5, 4, 6], cfg=cfg, gamma=3, max_new_tokens=5, seed=10_000 + seed))
    if share_generator:  # the bug this test must catch: one stream of random numbers for every row
        shared = torch.Generator().manual_seed(0)
        original = batch_module.Row.__init__

        def init(self, request, lm):
            original(self, request, lm)
            self.generator = shared

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(batch_module.Row, "__init__", init)
            outs = decode_many(target, jobs, draft=draft, max_batch=16)
    else:
        outs = decode_many(target, jobs, draft=draft, max_batch=16)
    mine = outs[::2]
    alone = [decode("sd", target, draft, [1, 2, 3], cfg=cfg, gamma=2, max_new_tokens=2, eos_ids=set(), seed=s)
             for s in range(SAMPLED_ROWS)]
    same = sum(a.token_ids == b.token_ids for a, b in zip(mine, alone, strict=True)) / SAMPLED_ROWS
    counts = [torch.tensor([float(Counter(g.token_ids[k] for g in mine)[i]) for i in range(VOCAB)]) for k in (0, 1)]
    return same, counts


@pytest.mark.slow  # ~1,000 sampled rows
def test_sampled_rows_draw_what_batch1_draws(small_vocab_pair):  # noqa: F811
    target, draft = small_vocab_pair
    cfg = SamplingConfig(temperature=1.0)
    first, second = exact_marginals(target, [1, 2, 3], cfg)
    same, (c1, c2) = sampled_batch(target, draft, cfg)
    assert same >= 0.98  # draw for draw, up to a last-bit flip of a sample at an interval's edge
    assert chi_square_pvalue(c1, first) > 0.001 and chi_square_pvalue(c2, second) > 0.001
    shared, _ = sampled_batch(target, draft, cfg, share_generator=True)
    assert shared < 0.5  # a shared generator is caught


@pytest.mark.slow  # real models
@pytest.mark.parametrize("pair_name", ["testbed", "testbed-hard"])
def test_testbed_pairs_batched_equal_batch1(pair_name, testbed_pair):
    from pivotspec import api
    from pivotspec.decoding.models import eos_ids
    from pivotspec.tasks import encode_problem

    pair = testbed_pair if pair_name == "testbed" else api.load_pair(pair=pair_name)
    task = api.get_task(api.pair_task(pair_name))
    pad = api.make_policy(pair, "pad", sigma=0.5, pair_name=pair_name)
    jobs = []
    for i, problem in enumerate(task.problems("validation", 4)):
        method = ("sd", "pad")[i % 2]
        jobs.append((method, Request(encode_problem(pair.target.tokenizer, problem), policy=pad if method == "pad"
                                     else None, max_new_tokens=48, eos_ids=eos_ids(pair.target))))
    assert_rows_equal_batch1(pair.target, pair.draft, jobs, max_batch=4)


def test_a_finished_batch_frees_its_caches_without_the_garbage_collector(pair):
    """Reference counting alone frees a batch's KV caches: a cycle through them waited for a full collection,
    and the labeler's batches of rollouts piled up gigabytes until the process was killed."""
    import gc
    import weakref

    target, draft = pair
    batch = Batch(target, draft)
    batch.decode([Request([5, 6, 7], gamma=3, max_new_tokens=6)])
    caches = [weakref.ref(c) for c in batch.caches.values()]
    gc.disable()
    try:
        del batch
        assert [c() for c in caches] == [None] * len(caches)
    finally:
        gc.enable()
