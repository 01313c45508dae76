"""vLLM engines of their own (a file apart from test_vllm_plugin.py, so that pytest-xdist, which keeps a file on
one worker, runs them beside that file's engine): method ar in vLLM against pivotspec's loop, and `pivotspec
serve --engine vllm` end to end."""

from __future__ import annotations

import json
import subprocess

import pytest

from pivotspec.decoding.sampling import SamplingConfig
from tests.test_vllm_plugin import arith_prompts, needs_vllm


@pytest.mark.slow(seconds=150)  # one more vLLM engine: the target alone
@needs_vllm
def test_greedy_ar_in_vllm_equals_pivotspec():
    """Method ar, 20 arith problems, greedy: vLLM's tokens are pivotspec's, prefill token included."""
    import os

    from pivotspec import api

    os.environ.setdefault("PIVOTSPEC_VLLM_ARGS", '{"enforce_eager": true}')
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    pair = api.load_pair(pair="testbed", dtype="float32")
    prompts, stop = arith_prompts(pair), api.stop_ids(pair.target)
    decoder = api.vllm_decoder(pair, "ar")
    try:
        got = decoder.decode_many(prompts, SamplingConfig(), 128, stop)
    finally:
        decoder.close()
    ref = api.generate_many(pair, prompts, method="ar", max_new_tokens=128, batch_size=10)
    assert [g.token_ids for g in got] == [g.token_ids for g in ref]


@pytest.mark.slow(seconds=180)  # starts vLLM's own OpenAI server with the plugin
@needs_vllm
def test_serve_engine_vllm_answers_openai_requests_with_pad(tmp_path):
    """`pivotspec serve --engine vllm`: vLLM's OpenAI server answers greedy completions whose tokens are
    pivotspec's PAD tokens (after vLLM's prefill token, as above), and its /metrics carries pivotspec's override
    counter beside vLLM's speculative-decoding counters."""
    import os
    import socket
    import sys
    import time
    import urllib.request

    from pivotspec import api

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (open for the server's lifetime)
    proc = subprocess.Popen([sys.executable, "-m", "pivotspec.cli", "serve", "--pair", "testbed", "--method", "pad",
                             "--engine", "vllm", "--port", str(port), "--model-name", "testbed", "--",
                             "--enforce-eager"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        start = time.time()
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.time() - start < 600, "vLLM's server did not come up in 10 minutes"
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5).read()
                break
            except OSError:
                time.sleep(2)
        pair = api.load_pair(pair="testbed", dtype="float32")
        for ids in arith_prompts(pair, 3):
            body = {"model": "testbed", "prompt": ids, "max_tokens": 48, "temperature": 0, "return_token_ids": True}
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as resp:
                got = json.loads(resp.read())["choices"][0]["token_ids"]
            ref = api.generate(pair, prompt_ids=ids + got[:1], method="pad", policy=api.make_policy(pair, "pad"),
                               max_new_tokens=47)
            assert got == got[:1] + ref.token_ids
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        assert "pivotspec:pad_overrides_total" in text and "vllm:spec_decode_num_draft_tokens" in text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
