"""Rollout engines: the vLLM engine's protocol and order, and torch / vLLM labels that agree statistically."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pivotspec import store
from pivotspec.decoding.sampling import SamplingConfig
from pivotspec.errors import UsageError
from pivotspec.labels.rollouts import RolloutRequest, VllmEngine, group_requests
from pivotspec.labels.walk import LabelConfig

FAKE_VLLM = '''
"""A stand-in for vllm's offline API: continuation j of a request is [base + j, base + j + 1, ...] with
base = 100 * last prompt token, cut at max_tokens or after a stop id."""
__version__ = "fake"


class SamplingParams:
    def __init__(self, n, temperature, top_p, top_k, max_tokens, stop_token_ids, detokenize):
        self.n, self.max_tokens, self.stop = n, max_tokens, set(stop_token_ids)


class Out:
    def __init__(self, ids):
        self.token_ids = ids


class Result:
    def __init__(self, outs):
        self.outputs = outs


class LLM:
    def __init__(self, **kwargs):
        assert kwargs["enable_prefix_caching"] and kwargs["skip_tokenizer_init"]
        import os
        if os.environ.get("FAKE_VLLM_INIT"):  # the engine's length limit, for the test that reads it
            with open(os.environ["FAKE_VLLM_INIT"], "w") as fh:
                fh.write(str(kwargs["max_model_len"]))

    def generate(self, prompts, params, use_tqdm=False):
        import os
        if os.environ.get("FAKE_VLLM_CALLS"):  # one line per engine call
            with open(os.environ["FAKE_VLLM_CALLS"], "a") as fh:
                fh.write(f"{len(prompts)}\\n")
        results = []
        for prompt, p in zip(prompts, params):
            base = 100 * prompt["prompt_token_ids"][-1]
            outs = []
            for j in range(p.n):
                ids = []
                for k in range(p.max_tokens):
                    ids.append(base + j + k)
                    if ids[-1] in p.stop:
                        break
                outs.append(Out(ids))
            results.append(Result(outs))
        return results
'''


def install_fake_vllm(tmp_path: Path, monkeypatch) -> None:
    """Make the fake vllm package importable by child processes (the engine's worker)."""
    pkg = tmp_path / "fake" / "vllm"
    (pkg / "inputs").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (pkg / "inputs" / "__init__.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                                 "    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    install_fake_vllm(tmp_path, monkeypatch)
    engine = VllmEngine("/nowhere", python=sys.executable)
    yield engine
    engine.close()


def test_group_requests_keeps_first_appearance_order():
    assert group_requests([5, 5, 9, 5, 9, 2]) == [(5, 3), (9, 2), (2, 1)]


def test_vllm_engine_protocol_order_and_stop_tokens(fake_vllm):
    cfg = SamplingConfig(0.7, 0, 1.0)
    outs = fake_vllm.rollouts([1, 2, 3], [4, 4, 7, 4, 2], cfg, 4, {2, 403}, torch.Generator())
    # One request per distinct first token with n = its count; the i-th occurrence gets continuation i;
    # a continuation ends at a stop id; a first token that is itself a stop id is not sent at all.
    assert outs == [[4, 400, 401, 402], [4, 401, 402, 403], [7, 700, 701, 702], [4, 402, 403], [2]]
    assert fake_vllm.rollouts([1], [5], cfg, 1, {2}, torch.Generator()) == [[5]]  # no room for more tokens


@pytest.fixture
def engine_calls(tmp_path, monkeypatch):
    """A file the fake vLLM appends a line to per engine call (request it before ``fake_vllm``)."""
    monkeypatch.setenv("FAKE_VLLM_CALLS", str(tmp_path / "calls"))
    return tmp_path / "calls"


def test_vllm_engine_sends_all_requests_in_one_call_per_length_cap(engine_calls, fake_vllm):
    """Walks running side by side share vLLM's steps: their requests go in one engine call (one per length cap),
    and each request gets what it would get alone."""
    cfg, gen = SamplingConfig(0.7, 0, 1.0), torch.Generator()
    reqs = [RolloutRequest([1, 2, 3], [4, 4, 7], gen, 4), RolloutRequest([9], [5, 2, 5], gen, 4),
            RolloutRequest([8, 8], [6], gen, 3), RolloutRequest([3], [2], gen, 4)]
    together = fake_vllm.rollouts_many(reqs, cfg, {2, 403})
    assert engine_calls.read_text().split() == ["3", "1"]  # cap 4: (4, 7) and 5 in one call; cap 3: 6 alone
    alone = [fake_vllm.rollouts(r.prefix, r.first_tokens, cfg, r.max_tokens, {2, 403}, gen) for r in reqs]
    assert together == alone == [[[4, 400, 401, 402], [4, 401, 402, 403], [7, 700, 701, 702]],
                                 [[5, 500, 501, 502], [2], [5, 501, 502, 503]], [[6, 600, 601]], [[2]]]


def test_vllm_engine_length_limit_is_the_model_s_own_when_shorter(tiny_dir, load, tmp_path, monkeypatch):
    """vLLM refuses a max_model_len above the model's positions (the tiny models have 512): capped there."""
    from pivotspec.labels.rollouts import make_engine

    monkeypatch.setenv("FAKE_VLLM_INIT", str(tmp_path / "init"))
    install_fake_vllm(tmp_path, monkeypatch)
    engine = make_engine("vllm", load(tiny_dir["llama_target"]), python=sys.executable)
    engine.close()
    assert (tmp_path / "init").read_text() == "512"


def test_vllm_worker_failure_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # no vllm importable there
    with pytest.raises(UsageError, match="vLLM worker failed: ModuleNotFoundError"):
        VllmEngine("/nowhere", python=sys.executable)
    with pytest.raises(UsageError, match="install.sh --with-vllm"):
        VllmEngine("/nowhere", python=str(tmp_path / "no-python"))


def test_engine_is_recorded_only_when_not_torch():
    assert "engine" not in LabelConfig().as_dict()  # files labeled before engines existed still resume
    assert LabelConfig(engine="vllm").as_dict()["engine"] == "vllm"
    with pytest.raises(UsageError, match="--engine must be one of torch, vllm"):
        LabelConfig(engine="sglang")


def agreement(a: list[dict], b: list[dict], side: str, n: int) -> tuple[float, float, float]:
    """Two-engine agreement on one side's success rates over the same candidates: (z of the summed difference,
    chi-square of the per-candidate differences, the chance of a chi-square at least that large under "same
    sampling distribution"). Under that hypothesis, given a candidate's s successes out of 2n rollouts, the
    first engine's count is hypergeometric (mean s/2), and the chance is simulated from those exact laws: with
    6 rollouts a side and success rates near 0 or 1 the chi-square law's own 0.999 quantile was exceeded about
    one time in ten in simulation (a flaky test)."""
    import numpy as np

    x = np.array([round(r[side] * n) for r in a])
    s = x + np.array([round(r[side] * n) for r in b])
    var = s * (2 * n - s) / (4 * (2 * n - 1))  # the hypergeometric variance of x given s
    some = var > 0
    if not some.any():
        return 0.0, 0.0, 1.0
    x, s, var = x[some], s[some], var[some]
    z = float((x - s / 2).sum() / np.sqrt(var.sum()))
    chi2 = float(((x - s / 2) ** 2 / var).sum())
    draws = np.random.default_rng(0).hypergeometric(s, 2 * n - s, n, size=(20_000, len(s)))
    null = ((draws - s / 2) ** 2 / var).sum(axis=1)
    return z, chi2, float((null >= chi2 - 1e-9).mean())


def vllm_installed() -> bool:
    import subprocess

    from pivotspec.labels.rollouts import vllm_python

    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([vllm_python(), "-c", probe], capture_output=True).returncode == 0


needs_vllm = pytest.mark.skipif(not os.environ.get("PIVOTSPEC_REQUIRE_VLLM") and not vllm_installed(),
                                reason="no vLLM environment (./install.sh --with-vllm, PIVOTSPEC_VLLM_PYTHON)")


@pytest.mark.slow(seconds=170)  # starts vLLM and loads the testbed pair
@needs_vllm
def test_torch_and_vllm_labels_agree_within_binomial_noise(tmp_path, monkeypatch, capsys):
    """The same candidates (the walk follows the target, so it does not depend on labels) labeled by both
    engines: U_acc and U_rej agree within binomial noise. The same statistics reject the answers a mixed-up
    engine would give (sides swapped, or each candidate paired with its neighbour's rollouts), so the test
    can fail. (A run at temperature 1.4 instead of 0.7 moved the testbed target's success rates by only ~5
    points on 12 candidates: not a check this test could make cheaply.)"""
    from pivotspec import api
    from pivotspec.cli import main

    monkeypatch.setenv("PIVOTSPEC_VLLM_ARGS", '{"enforce_eager": true}')  # no torch.compile: a faster start
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: its KV cache warm-up took 34 s at 3.2 GiB, 3 s at 1
    pair = api.load_pair(pair="testbed", device="cpu")
    # Sized for CI (vLLM's rollouts run at about a third of the torch engine's rate on 2 cores): 2 problems
    # (12 candidates), 4 rollouts a side, walks batched 4 at a time. The swapped and shifted checks below show
    # the statistics still tell engines apart: drawing 4 rollouts a side from these 12 candidates' success
    # rates (as measured with 6), 400 times, swapped sides and the shifted pairing were caught every time and
    # two draws from the same rates never failed.
    n = 4
    run = dict(task="arith", split="train", n_problems=2, rollouts=n, max_rollout_tokens=64, follow="target",
               min_target_rate=-1.0, seed=3, concurrency=4)
    torch_rows = api.label(pair, tmp_path / "torch.jsonl", **run)
    vllm_rows = api.label(pair, tmp_path / "vllm.jsonl", engine="vllm", **run)

    def cands(rows):
        return sorted((r for r in rows if r["type"] == "candidate"), key=lambda r: (r["problem_id"], r["step"]))

    a, b = cands(torch_rows), cands(vllm_rows)
    assert len(a) >= 8 and [(r["problem_id"], r["step"], r["d"], r["t"]) for r in a] == \
        [(r["problem_id"], r["step"], r["d"], r["t"]) for r in b]
    assert b[0]["config"]["engine"] == "vllm" and "engine" not in a[0]["config"]
    for side in ("u_acc", "u_rej"):
        z, chi2, chance = agreement(a, b, side, n)
        assert abs(z) < 3.29 and chance > 0.001, (side, z, chi2, chance)
    swapped = [{**r, "u_acc": r["u_rej"], "u_rej": r["u_acc"]} for r in b]
    shifted = b[1:] + b[:1]
    for wrong in (swapped, shifted):
        verdicts = [agreement(a, wrong, side, n) for side in ("u_acc", "u_rej")]
        assert any(abs(z) >= 3.29 or chance <= 0.001 for z, _, chance in verdicts), verdicts
    assert main(["labels", "stats", str(tmp_path / "vllm.jsonl")]) == 0
    assert "candidates" in capsys.readouterr().out
    assert store.read_records(tmp_path / "vllm.jsonl")[0]["config"]["engine"] == "vllm"


def test_vllm_needs_a_target_directory(tiny_dir, load):
    from pivotspec.labels.rollouts import make_engine

    lm = load(tiny_dir["llama_draft"])
    lm_copy = type(lm)(**{**lm.__dict__, "source": None})
    with pytest.raises(UsageError, match="Hugging Face directory"):
        make_engine("vllm", lm_copy)
    assert Path(lm.source).is_dir()
