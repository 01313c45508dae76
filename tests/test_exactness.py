"""Exactness within each CPU dtype and kernel: greedy SD and PAD at sigma 0 equal the target alone, and batched
rows equal the same rows decoded alone (rows joining late, prompts computed inside a step, shared prefixes), on
the tiny models and the testbed, through the compiled per-query attention and PyTorch's calls."""

from __future__ import annotations

import pytest
import torch

from pivotspec.decoding import packing
from pivotspec.decoding.acceptance import PAD, constant_classifier
from pivotspec.decoding.loop import decode
from pivotspec.decoding.models import load_lm
from tests.test_fastpath import DTYPES, NO_CC, needs_bf16


@pytest.fixture(params=["kernel", "torch"])
def attention(request, monkeypatch):
    """Each per-query attention of bfloat16 models, as (name, the kernel's calls): the compiled kernel and
    PyTorch's calls (``query_attention``)."""
    from pivotspec.decoding import query_attention

    calls = []
    if request.param == "kernel":
        if query_attention.kernel() is None:
            pytest.skip("no C compiler to build the attention kernel")
        attend = query_attention.attend
        monkeypatch.setattr(query_attention, "attend", lambda *a: calls.append(1) or attend(*a))
    else:
        monkeypatch.setattr(query_attention, "enabled", lambda: False)
    return request.param, calls


ON_ROWWISE = pytest.param("rowwise", marks=NO_CC)
ON_INT8_ROWWISE = pytest.param("int8-rowwise", marks=NO_CC)
ON_BF16_ROWWISE = pytest.param("bf16-rowwise", marks=NO_CC)  # the dot product's emulation where the CPU lacks it
# path -> (dtype, PIVOTSPEC_CPU_KERNELS): float32 on PyTorch's plain kernels or the row-wise one, int8 and
# bfloat16 on the row-wise kernel; anything else (bfloat16, int8) a dtype on its packed kernels (for int8,
# PyTorch's)
PINS = {"float32": ("float32", "plain"), "rowwise": ("float32", "rowwise"), "int8-rowwise": ("int8", "rowwise"),
        "bf16-rowwise": ("bfloat16", "rowwise")}
ROWWISE_KERNELS = {"rowwise": "rowwise", "int8-rowwise": "rowwise-int8", "bf16-rowwise": "rowwise-bf16"}


def pinned(path: str, monkeypatch) -> str:
    """The dtype to load ``path`` with, its kernels pinned (``PINS``)."""
    dtype, kernels = PINS.get(path, (path, "packed"))
    monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", kernels)
    return dtype


@pytest.mark.parametrize("dtype", [*DTYPES, "int8", ON_ROWWISE, ON_INT8_ROWWISE, ON_BF16_ROWWISE])
def test_greedy_sd_and_pad_sigma0_equal_target_only_in_each_dtype(tiny_dir, dtype, attention, monkeypatch):
    path, dtype = dtype, pinned(dtype, monkeypatch)
    target = load_lm(str(tiny_dir["llama_target"]), dtype=dtype)
    draft = load_lm(str(tiny_dir["llama_draft"]), dtype=dtype)
    assert target.weights_dtype == draft.weights_dtype == dtype
    rowwise_path = path in ROWWISE_KERNELS
    if rowwise_path:
        expected = {ROWWISE_KERNELS[path]}
        assert {k.kernel for lm in (target, draft) for k in packing.packed_kernels(lm.model)} == expected
    pad = PAD(constant_classifier(0.0), sigma=0.0, p_floor=0.0)
    for ids in ([3, 4, 5], [7, 2, 9, 11, 4, 6], [20]):
        ar = decode("ar", target, None, ids, max_new_tokens=24, eos_ids=set())
        sd = decode("sd", target, draft, ids, gamma=5, max_new_tokens=24, eos_ids=set())
        pd = decode("pad", target, draft, ids, pad, gamma=5, max_new_tokens=24, eos_ids=set())
        assert sd.token_ids == ar.token_ids == pd.token_ids
    name, calls = attention
    # plain float32 attends with SDPA whole; bfloat16 and int8 per query, and the row-wise paths' fused layers
    # (``fused``) through the same kernel
    assert bool(calls) == (name == "kernel" and (dtype != "float32" or rowwise_path))
    if dtype == "int8":  # int8 weights, not float32's rounded: what it computes is its own
        assert packing.is_packed(target.model) and all(k.scales is not None for k in packing.packed_kernels(
            target.model))


@pytest.mark.slow  # real models
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16), "int8", ON_INT8_ROWWISE,
                                   ON_BF16_ROWWISE])
def test_testbed_greedy_sd_and_pad_sigma0_equal_target_only_in_bfloat16_and_int8(attention, dtype, monkeypatch):
    """PyTorch's int8 kernel rounds the linears' inputs to bfloat16, so float32 attention's last-bit differences
    between a query alone and beside others became whole bfloat16 steps there too: with SDPA whole, SD parted
    from ar on the 4th of these problems (an AVX2 AMD EPYC). The row-wise int8 kernel keeps them float32, and
    its fused layers attend per query through the same kernel."""
    if (dtype.startswith("int8") or dtype == "bf16-rowwise") and attention[0] == "torch":
        pytest.skip("int8 and the row-wise bfloat16 run the attention kernel here or none; the per-query PyTorch "
                    "calls are packed bfloat16's test")
    dtype = pinned(dtype, monkeypatch)
    from pivotspec import api
    from pivotspec.decoding.models import eos_ids
    from pivotspec.tasks import encode_problem

    pair = api.load_pair(pair="testbed", dtype=dtype)
    assert packing.is_packed(pair.target.model)
    task = api.get_task("arith")
    pad = PAD(constant_classifier(0.0), sigma=0.0, p_floor=0.0)
    for problem in task.problems("validation", 4):
        ids = encode_problem(pair.target.tokenizer, problem)
        kw = dict(max_new_tokens=64, eos_ids=eos_ids(pair.target))
        ar = decode("ar", pair.target, None, ids, **kw)
        assert decode("sd", pair.target, pair.draft, ids, gamma=5, **kw).token_ids == ar.token_ids
        assert decode("pad", pair.target, pair.draft, ids, pad, gamma=5, **kw).token_ids == ar.token_ids
    assert bool(attention[1]) == (attention[0] == "kernel")


def test_key_counts_reads_prefix_masks_and_refuses_the_rest():
    from pivotspec.decoding.attention import key_counts

    assert key_counts(None, 2, 3, 10) == [[8, 9, 10], [8, 9, 10]]
    cols = torch.arange(6)
    prefix = (cols[None, None, :] <= torch.tensor([[2, 3], [4, 5]])[:, :, None])[:, None]  # [B, 1, T, width]
    assert key_counts(prefix, 2, 2, 6) == [[3, 4], [5, 6]]
    window = prefix & (cols[None, None, None, :] > 1)  # a sliding window hides the first keys
    assert key_counts(window, 2, 2, 6) is None
    assert key_counts(prefix.float(), 2, 2, 6) is None


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16), "int8", ON_ROWWISE, ON_INT8_ROWWISE,
                                   ON_BF16_ROWWISE])
@pytest.mark.parametrize("gamma", [1, 4])
def test_batched_rows_equal_batch1_in_bfloat16_and_int8(tiny_dir, gamma, attention, dtype, monkeypatch):
    """The batched path through the per-query attention on tiny models (bfloat16), and through the int8 and
    the row-wise kernels' rows, rows leaving and joining. Their
    distributions are too peaked for a bfloat16 step to change a token (this passes without the per-query
    attention too); the testbed test below is the one that parts without it."""
    from pivotspec.decoding.batch import Request
    from tests.test_batch import assert_rows_equal_batch1
    from tests.test_decoding import prompts

    dtype = pinned(dtype, monkeypatch)
    target = load_lm(str(tiny_dir["llama_target"]), dtype=dtype)
    draft = load_lm(str(tiny_dir["llama_draft"]), dtype=dtype)
    pad0 = PAD(constant_classifier(0.0), sigma=0.0, p_floor=0.0)
    jobs = []
    for i, ids in enumerate(prompts(9, seed=3)):
        method, policy = [("ar", None), ("sd", None), ("pad", pad0)][i % 3]
        jobs.append((method, Request(ids, policy=policy, gamma=gamma, max_new_tokens=6 + 3 * i,
                                     speculate=method != "ar")))
    assert_rows_equal_batch1(target, draft, jobs, max_batch=3)  # rows leave and join at different steps
    # every path here attends per query through the kernel (the row-wise ones in their fused layers)
    assert bool(attention[1]) == (attention[0] == "kernel")


@needs_bf16
@pytest.mark.parametrize("max_batch", [1, 3])
def test_rows_take_a_shared_prefix_and_still_equal_batch1(tiny_dir, attention, max_batch):
    """Prefix caching: a joining row takes the keys of the start it shares with a row in the batch (3 at a
    time) or with the last row that left (1 at a time), a system prompt or an earlier turn, and computes the
    rest; every row still equals its batch-1 decode, and the rows count the tokens they took."""
    import random

    from pivotspec.decoding.batch import Batch, Request
    from tests.test_batch import assert_rows_equal_batch1

    target = load_lm(str(tiny_dir["llama_target"]), dtype="bfloat16")
    draft = load_lm(str(tiny_dir["llama_draft"]), dtype="bfloat16")
    rng = random.Random(5)
    system = [rng.randrange(2, 32) for _ in range(10)]
    prompts = [system + [first] + [rng.randrange(2, 32) for _ in range(rng.randint(1, 6))] for first in range(2, 8)]
    first = Batch(target, draft).decode([Request(prompts[0], gamma=3, max_new_tokens=8)])[0]
    prompts.insert(1, prompts[0] + first.token_ids[:3] + [9])  # the next turn of the first row's conversation
    jobs = [("sd", Request(ids, gamma=3, max_new_tokens=8)) for ids in prompts]
    batch = assert_rows_equal_batch1(target, draft, jobs, max_batch=max_batch)
    outs = batch.decode([r for _, r in jobs], max_batch)  # the same batch again: rows start from kept keys too
    assert [o.token_ids for o in outs] == [ref.token_ids for ref in Batch(target, draft).decode([r for _, r in jobs],
                                                                                                  max_batch)]
    cached = [o.stats["cached_prompt_tokens"] for o in outs]
    plain = Batch(target, draft, prefix_caching=False).decode([r for _, r in jobs], max_batch)  # to compare
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]
    assert [o.stats["cached_prompt_tokens"] for o in plain] == [0] * len(jobs)
    if attention[0] != "kernel":  # PyTorch's per-query calls: a key's numbers may depend on its block
        assert cached == [0] * len(jobs) and batch.reused_prompt_tokens == 0
    elif max_batch == 1:  # each row after the first takes the previous row's keys of what the two share
        assert cached[1:] == [len(prompts[0]) + 3] + [len(system)] * 5
    else:  # the first three join together, before any row has keys; later ones share the system prompt
        assert cached[3:] == [len(system)] * 4


@pytest.mark.slow  # real models
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16), "int8", ON_BF16_ROWWISE])
def test_testbed_batched_rows_equal_batch1_in_bfloat16_and_int8(attention, dtype, monkeypatch):
    if dtype in ("int8", "bf16-rowwise") and attention[0] == "torch":
        pytest.skip("int8 and bfloat16 rowwise run the attention kernel here; the per-query PyTorch calls are packed "
                    "bfloat16's test")
    dtype = pinned(dtype, monkeypatch)
    from pivotspec import api
    from pivotspec.decoding.batch import Request
    from pivotspec.decoding.models import eos_ids
    from pivotspec.tasks import encode_problem
    from tests.test_batch import assert_rows_equal_batch1

    pair = api.load_pair(pair="testbed", dtype=dtype)
    pad = api.make_policy(pair, "pad", sigma=0.5, pair_name="testbed")
    jobs = []
    for i, problem in enumerate(api.get_task("arith").problems("validation", 8)):
        method = ("sd", "pad", "ar")[i % 3]
        jobs.append((method, Request(encode_problem(pair.target.tokenizer, problem), policy=pad if method == "pad"
                                     else None, max_new_tokens=64, eos_ids=eos_ids(pair.target),
                                     speculate=method != "ar")))
    # Three rows at a time: rows join late, and with the kernel each prompt is computed inside a step, three
    # of about 90 tokens in the first (past the linears' exact row limit, so in chunks), and equal batch 1.
    batch = assert_rows_equal_batch1(pair.target, pair.draft, jobs, max_batch=3)
    assert bool(attention[1]) == (attention[0] == "kernel")
    assert batch.joined_in_step == (len(jobs) if attention[0] == "kernel" else 0)
    # the five that join later take the keys of the system prompt the arith prompts share from a row in the batch
    assert (batch.reused_prompt_tokens >= 5 * 20) == (attention[0] == "kernel")
