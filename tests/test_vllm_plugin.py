"""PAD inside vLLM (pivotspec.integrations.vllm): the step logic against pivotspec's own policy, the counters, the
version and signature checks, and (slow) the plugin inside vLLM 0.32's CPU build against pivotspec's loop."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from pivotspec.decoding.acceptance import PAD, Verification, constant_classifier
from pivotspec.decoding.sampling import SamplingConfig
from pivotspec.errors import UsageError
from pivotspec.integrations.vllm import counters, step
from pivotspec.integrations.vllm.launch import check_vllm, engine_settings
from pivotspec.integrations.vllm.patches import ENV, SUPPORTED_VLLM, Settings, check
from pivotspec.labels.rollouts import vllm_python


def rows(g: int = 4, vocab: int = 11, seed: int = 0, temperature: float = 0.0) -> step.Rows:
    gen = torch.Generator().manual_seed(seed)
    return step.Rows(torch.randint(0, vocab, (g,), generator=gen), torch.randn(g + 1, vocab, generator=gen) * 3,
                     torch.randn(g + 1, 6, generator=gen), None, SamplingConfig(temperature))


def test_overrides_are_the_policy_s_own_on_the_same_rows():
    seen = []

    def classify(v: Verification) -> torch.Tensor:
        seen.append(v.hidden)
        return torch.linspace(0, 1, v.draft_tokens.shape[0])

    policy = PAD(classify, sigma=0.5, p_floor=0.0)
    a, b = rows(4, seed=1), rows(3, seed=2)
    mask = step.overrides([(policy, a), (policy, b)])
    expected = torch.cat([policy.override(Verification(r.draft_tokens, r.target_logits, lambda: None, r.cfg,
                                                       hidden=r.hidden)) for r in (a, b)])
    assert mask.tolist() == expected.tolist() == [True, True, False, False, True, True, False]
    assert torch.equal(seen[0], a.hidden)  # the classifier read the request's own hidden rows
    # a request without a policy (vLLM's own rule) and one holding padding drafts get no override
    padded = rows(3, seed=3)
    padded.draft_tokens[1] = -1
    assert step.overrides([(None, a), (policy, padded)]).tolist() == [False] * 7


def test_p_floor_and_sigma_zero_come_from_the_pad_policy():
    r = rows(4, seed=4)
    everything = step.overrides([(PAD(constant_classifier(0.0), sigma=0.5, p_floor=0.0), r)])
    assert everything.all()
    assert not step.overrides([(PAD(constant_classifier(0.0), sigma=0.0, p_floor=0.0), r)]).any()
    probs = torch.softmax(r.target_logits[:4], dim=-1).gather(-1, r.draft_tokens[:, None]).squeeze(-1)
    floor = float(probs.median())
    floored = step.overrides([(PAD(constant_classifier(0.0), sigma=0.5, p_floor=floor), r)])
    assert floored.tolist() == (probs >= floor).tolist()


def test_force_makes_masked_drafts_win_and_leaves_other_rows_bit_identical():
    logits = torch.randn(5, 50) * 4
    drafts = torch.tensor([3, 7, 9, 11, 13])
    mask = torch.tensor([False, True, False, True, False])
    forced = step.force(logits, drafts, mask)
    assert torch.equal(forced[~mask], logits[~mask])
    assert forced[mask].argmax(-1).tolist() == [7, 11]
    assert torch.softmax(forced[mask], -1).gather(-1, drafts[mask][:, None]).flatten().tolist() == [1.0, 1.0]
    assert torch.equal(step.force(logits, drafts, torch.zeros(5, dtype=torch.bool)), logits)
    assert forced.data_ptr() != logits.data_ptr()  # vLLM's own tensor (its logprobs read it) is not touched


def test_sd_accepts_is_the_lossless_rule():
    logits = torch.randn(6, 20) * 3
    drafts = logits.argmax(-1).clone()
    drafts[[1, 4]] = (drafts[[1, 4]] + 1) % 20
    greedy = torch.ones(6, dtype=torch.bool)
    assert step.sd_accepts(logits, drafts, None, None, greedy).tolist() == [True, False, True, True, False, True]
    q = torch.softmax(torch.randn(6, 20), -1)
    u = torch.rand(6, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    expected = [bool(p[i, d] / q[i, d] >= u[i]) for i, d in enumerate(drafts.tolist())]
    assert step.sd_accepts(logits, drafts, q, u, ~greedy).tolist() == expected


def test_counters_sum_every_process_file(tmp_path, monkeypatch):
    first = counters.Counter(tmp_path)
    first.add(steps=1, draft_tokens=5, overrides=2)
    monkeypatch.setattr("os.getpid", lambda: 999999)
    second = counters.Counter(tmp_path)
    second.add(draft_tokens=4, kept_by_sd=3, overrides=1)
    assert counters.totals(tmp_path) == {"steps": 1, "draft_tokens": 9, "kept_by_sd": 3, "overrides": 3}
    assert counters.totals(tmp_path / "none") == dict.fromkeys(counters.FIELDS, 0)


def test_engine_settings_per_method(tmp_path):
    assert engine_settings("ar", None, 5) == ({}, {ENV: json.dumps({"classifier": None})})
    args, env = engine_settings("sd", tmp_path, 4)
    assert args["speculative_config"]["method"] == "draft_model" and json.loads(env[ENV]) == {"classifier": None}
    assert args["speculative_config"]["num_speculative_tokens"] == 4
    args, env = engine_settings("pad", tmp_path, 5, classifier="clf", sigma=0.3, counts="c")
    assert json.loads(env[ENV])["sigma"] == 0.3 and json.loads(env[ENV])["classifier"].endswith("clf")
    for method, kwargs, words in [("topk", {}, "runs ar, sd, pad"), ("sd", {"draft": None}, "needs a draft"),
                                  ("pad", {}, "needs a pivot classifier"),
                                  ("pad", {"classifier": "const:0.1"}, "trained classifiers only")]:
        draft = kwargs.pop("draft", tmp_path)
        with pytest.raises(UsageError, match=words):
            engine_settings(method, draft, 5, **kwargs)
    context = tmp_path / "ctx"  # a context classifier reads each answer's overrides, which vLLM does not track
    context.mkdir()
    (context / "classifier.json").write_text(json.dumps({"type": "context"}))
    with pytest.raises(UsageError, match="use --engine torch") as err:
        engine_settings("pad", tmp_path, 5, classifier=str(context))
    assert "\n" not in str(err.value)


def test_another_vllm_version_is_refused_in_one_line(tmp_path):
    with pytest.raises(RuntimeError, match=f"supports vLLM {SUPPORTED_VLLM}, not 0.31.0") as err:
        check("0.31.0")
    assert "\n" not in str(err.value)
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 0.31.0\n")
    fake.chmod(0o755)
    with pytest.raises(UsageError, match=f"supports vLLM {SUPPORTED_VLLM}, {fake} has 0.31.0"):
        check_vllm(str(fake))
    with pytest.raises(UsageError, match="does not exist"):
        check_vllm(str(tmp_path / "missing"))


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert Settings.from_env() is None
    monkeypatch.setenv(ENV, '{"classifier": "c", "sigma": 0.2}')
    assert Settings.from_env() == Settings("c", 0.2)
    monkeypatch.setenv(ENV, '{"classifer": "c"}')
    with pytest.raises(RuntimeError, match=f"{ENV} must be a JSON object"):
        Settings.from_env()


VLLM = vllm_python()
HAS_VLLM = Path(VLLM).is_file() and subprocess.run([VLLM, "-c", "import vllm"], capture_output=True).returncode == 0
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="no vLLM: ./install.sh --with-vllm makes .venv-vllm")


@needs_vllm
def test_the_wrapped_functions_have_the_pinned_signatures():
    """The plugin wraps six vLLM functions and may replace one; a vLLM that changed one must fail here, not mis-wire
    at run time."""
    script = ("from pivotspec.integrations.vllm import patches\n"
              "print(patches.signature_changes())\n"
              "key = next(iter(patches.SIGNATURES)); patches.SIGNATURES[key] = '(self)'\n"
              "print(len(patches.signature_changes()))\n")
    out = subprocess.run([VLLM, "-c", script], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]"  # every signature as pinned
    assert out[1] == "1"  # and a changed one is seen


@pytest.fixture(scope="module")
def vllm_pad():
    """The testbed pair in vLLM with the plugin on (the shipped classifier), and the same pair in pivotspec."""
    import os

    from pivotspec import api

    os.environ.setdefault("PIVOTSPEC_VLLM_ARGS", '{"enforce_eager": true}')
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    pair = api.load_pair(pair="testbed", dtype="float32")
    decoder = api.vllm_decoder(pair, "pad")
    yield pair, decoder
    decoder.close()


def arith_prompts(pair, n: int = 20) -> list[list[int]]:
    from pivotspec import api
    from pivotspec.tasks import encode_problem

    return [encode_problem(pair.target.tokenizer, p, True, None) for p in api.get_task("arith").problems("test", n, 0)]


@pytest.mark.slow(seconds=150)  # starts vLLM with the plugin
@needs_vllm
def test_greedy_pad_in_vllm_equals_pivotspec_and_sigma_0_is_vllm_lossless(vllm_pad):
    """10 arith problems, greedy (20 took 90-110 s in CI). vLLM's prefill makes the first token by itself and its
    steps start after it, so pivotspec decodes from prompt + that token: with the same step boundaries every token
    must agree."""
    from pivotspec import api

    pair, decoder = vllm_pad
    prompts, stop = arith_prompts(pair, 10), api.stop_ids(pair.target)
    cfg = SamplingConfig()
    lossless = decoder.decode_many(prompts, cfg, 128, stop, lossless=True)
    at_zero = decoder.decode_many(prompts, cfg, 128, stop, sigma=0.0)
    before = counters.totals(decoder.counts)["overrides"]
    pad = decoder.decode_many(prompts, cfg, 128, stop)
    overrides = counters.totals(decoder.counts)["overrides"] - before
    assert [g.token_ids for g in at_zero] == [g.token_ids for g in lossless]  # sigma 0: vLLM's own result
    assert at_zero[0].stats["override"] == 0 and overrides > 0
    # pivotspec's batched loop (its rows equal one-at-a-time decodes, tests/test_batch.py), to keep CI short
    ref_sd = api.generate_many(pair, prompts, method="sd", max_new_tokens=128, batch_size=10)
    firsts = [g.token_ids[:1] for g in pad]
    ref_pad = api.generate_many(pair, [ids + f for ids, f in zip(prompts, firsts, strict=True)], method="pad",
                                policy=api.make_policy(pair, "pad"), max_new_tokens=127, batch_size=10)
    assert [g.token_ids for g in lossless] == [g.token_ids for g in ref_sd]
    assert [g.token_ids for g in pad] == [f + g.token_ids for f, g in zip(firsts, ref_pad, strict=True)]


def test_torch_expand_is_vllm_s_expand():
    """The CPU repair: x[r] once per token of request r, greedy temperature 0 turned into 1 as vLLM asks."""
    from pivotspec.integrations.vllm.patches import torch_expand

    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # the middle request has no draft tokens
    assert torch_expand(torch.tensor([0.7, 0.3, 0.0]), cu, 5, replace_from=0, replace_to=1).tolist() == pytest.approx(
        [0.7, 0.7, 1.0, 1.0, 1.0])
    assert torch_expand(torch.tensor([5, 7, 9]), cu, 5).tolist() == [5, 5, 9, 9, 9]

