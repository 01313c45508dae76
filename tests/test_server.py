"""`pivotspec serve` on 127.0.0.1, driven by the official openai client and plain HTTP."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_dir):
    import uvicorn

    from pivotspec import api
    from pivotspec.server import Settings, create_app

    pair = api.load_pair(str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"]))
    settings = Settings(model="tiny", method="sd", classifier="const:0.3", max_queue=2, api_key=KEY, max_tokens=16,
                        max_batch=3)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(pair, settings), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(100):
        if srv.started:
            break
        time.sleep(0.05)
    yield {"url": f"http://127.0.0.1:{port}", "pair": pair}
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)


def http(server, path, body=None, key=KEY, method=None):
    req = urllib.request.Request(server["url"] + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_chat_completion_equals_generate(server, client):
    from pivotspec import api

    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1 w2 w3"}],
                                         max_tokens=12, extra_body={"method": "sd", "gamma": 3})
    gen = api.generate(server["pair"], messages=[{"role": "user", "content": "w1 w2 w3"}], method="sd", gamma=3,
                       max_new_tokens=12)
    assert out.choices[0].message.content == gen.text
    assert out.usage.completion_tokens == gen.stats["new_tokens"]
    spec = out.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] == gen.stats["drafted"] and spec["num_accepted_tokens"] == gen.stats["accepted"]


def test_completions_and_pad_extra_fields(client):
    out = client.completions.create(model="tiny", prompt="w4 w5", max_tokens=8,
                                    extra_body={"method": "pad", "sigma": 1.0, "gamma": 4})
    spec = out.model_extra["metrics"]["speculative_decoding"]
    assert out.model_extra["metrics"]["method"] == "pad" and out.usage.completion_tokens == 8
    assert spec["pad_overrides"] > 0  # const:0.3 <= sigma 1: every SD rejection with p >= tau is kept


def test_unseeded_sampled_requests_draw_fresh_numbers_and_a_seed_repeats(client):
    """Like OpenAI's API and vLLM: without a seed each sampled request gets its own random numbers (a fixed
    default seed answered equal prompts with equal samples); with one, the answer repeats."""
    def ask(**extra):
        out = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=16, temperature=2.0, **extra)
        return out.choices[0].text

    assert len({ask() for _ in range(4)}) > 1
    assert ask(seed=7) == ask(seed=7)


def test_streaming_chat_with_usage(client):
    from pivotspec import api  # noqa: F401

    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w1 w2 w3"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"method": "sd", "gamma": 3}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1 w2 w3"}],
                                           max_tokens=12, extra_body={"method": "sd", "gamma": 3})
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and chunks[-1].choices == []
    # prefix caching's count, as OpenAI reports it (0 here: the tiny float32 model is not token-exact, Batch.add)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_streaming_completions(client):
    chunks = list(client.completions.create(model="tiny", prompt="w4 w5", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) and chunks[-1].choices[0].finish_reason


def test_error_statuses(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 4}
    assert http(server, "/health", key=None)[0] == 200
    assert http(server, "/v1/models", key=None)[0] == 401
    assert http(server, "/v1/models", key="wrong")[0] == 401
    status, body = http(server, "/v1/chat/completions", {**chat, "model": "other"})
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    for bad in ({"messages": "hi"}, {"temperature": float("inf")}, {"n": 2}, {"stop": [""]}, {"method": "nope"},
                {"max_tokens": -1}, {"sigma": 2}):
        status, body = http(server, "/v1/chat/completions", {**chat, **bad})
        assert status == 400 and "Traceback" not in body and json.loads(body)["error"]["message"], bad
    assert http(server, "/v1/models")[0] == 200 and http(server, "/metrics")[0] == 200


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Every forward of the target takes 20 ms more, so requests overlap; returns each forward's row count."""
    model = server["pair"].target.model
    calls = []
    real = model.forward

    @functools.wraps(real)  # keeps the signature: the cache keyword is chosen from it
    def slow(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0] if "input_ids" in kwargs else 1)
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow)
    return calls


def gauge(server, name):
    text = http(server, "/metrics")[1]
    return int(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"pivotspec:{name} ")))


def concurrently(server, bodies):
    results = [None] * len(bodies)

    def one(i):
        results[i] = http(server, "/v1/chat/completions", bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def chat_body(words, max_tokens, **extra):
    return {"model": "tiny", "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens, **extra}


def test_concurrent_requests_decode_together_and_equal_alone(server, slow_steps):
    bodies = [chat_body("w1 w2", 40, method="sd", gamma=3), chat_body("w5", 36, method="pad", sigma=1.0),
              chat_body("w3 w4 w5 w6", 44, method="ar")]
    together = concurrently(server, bodies)
    assert max(slow_steps) == 3  # one target forward held all three rows
    assert gauge(server, "num_requests_running") == 0 and gauge(server, "num_requests_waiting") == 0
    for body, (code, reply) in zip(bodies, together, strict=True):
        alone = http(server, "/v1/chat/completions", body)
        assert code == alone[0] == 200
        assert json.loads(reply)["choices"] == json.loads(alone[1])["choices"]


def test_a_long_request_does_not_stall_a_short_one(server, slow_steps):
    done = {}

    def long():
        done["reply"] = http(server, "/v1/chat/completions", chat_body("w3 w4", 200, method="ar"))  # no EOS
        done["long"] = time.time()

    thread = threading.Thread(target=long)
    thread.start()
    time.sleep(0.5)
    assert http(server, "/v1/chat/completions", chat_body("w2", 4, method="ar"))[0] == 200
    done["short"] = time.time()
    thread.join()
    assert json.loads(done["reply"][1])["usage"]["completion_tokens"] == 200
    assert done["long"] - done["short"] > 1.5  # the short one joined the batch and left it while the long one ran


def test_past_max_model_len_is_400(server):
    status, body = http(server, "/v1/chat/completions", chat_body("w1", 600))
    assert status == 400 and "--max-model-len 512" in json.loads(body)["error"]["message"]


def test_full_queue_answers_429_and_metrics_add_up(server, slow_steps):
    body = chat_body("w1 w2", 16, method="sd")
    before = http(server, "/metrics")[1]
    results = concurrently(server, [body] * 8)
    codes = sorted(code for code, _ in results)
    # 3 rows decode and 2 wait; the rest are refused (exactly 3 if all 8 arrive before the first finishes)
    assert codes.count(429) >= 1 and codes.count(200) >= 5
    after = http(server, "/metrics")[1]

    def counter(text, name):
        return int(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"pivotspec:{name}_total")))

    drafted = sum(json.loads(b)["metrics"]["speculative_decoding"]["num_draft_tokens"] for c, b in results if c == 200)
    assert counter(after, "spec_decode_num_draft_tokens") - counter(before, "spec_decode_num_draft_tokens") == drafted
    cached = sum(json.loads(b)["usage"]["prompt_tokens_details"]["cached_tokens"] for c, b in results if c == 200)
    prompt = sum(json.loads(b)["usage"]["prompt_tokens"] for c, b in results if c == 200)
    assert counter(after, "prefix_cache_hits") - counter(before, "prefix_cache_hits") == cached
    assert counter(after, "prefix_cache_queries") - counter(before, "prefix_cache_queries") == prompt


def test_disconnect_mid_stream_stops_that_row_only(server, slow_steps):
    """A client that goes away mid-stream leaves the batch within a step: the 480-token decode it asked for
    would take ~10 s at 20 ms a forward, but the row is gone within a second or two, and a request decoding
    beside it finishes."""
    body = json.dumps(chat_body("w3 w4", 480, stream=True, method="ar")).encode()
    sock = socket.create_connection(("127.0.0.1", int(server["url"].rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while b'"content"' not in received:  # a token has arrived: the decode is under way
        received += sock.recv(4096)
    beside = {}
    thread = threading.Thread(target=lambda: beside.update(r=http(server, "/v1/chat/completions",
                                                                  chat_body("w2", 40, method="ar"))))
    thread.start()
    time.sleep(0.3)
    sock.close()
    closed_at = time.time()
    thread.join()
    while time.time() - closed_at < 10 and gauge(server, "num_requests_running") != 0:
        time.sleep(0.05)
    assert time.time() - closed_at < 3 and len(slow_steps) < 200
    assert beside["r"][0] == 200 and json.loads(beside["r"][1])["usage"]["completion_tokens"] == 40


@pytest.mark.slow  # starts a server process
def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(tiny_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pivotspec.cli", "serve", "--target", str(tiny_dir["llama_target"]),
                             "--draft", str(tiny_dir["llama_draft"]), "--method", "sd", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        result = {}
        body = {"model": str(tiny_dir["llama_target"]), "messages": [{"role": "user", "content": "w1"}],
                "max_tokens": 200}
        worker = threading.Thread(target=lambda: result.update(reply=http({"url": url}, "/v1/chat/completions",
                                                                          body, key=None)))
        worker.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        worker.join(timeout=40)
        out, err = proc.communicate(timeout=40)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert result["reply"][0] == 200  # the request in flight was finished, not dropped


CHROMIUM = "/usr/bin/chromium"


@pytest.mark.slow  # starts a browser
def test_playground_streams_coloured_tokens_in_a_real_browser(server):
    import os

    if not os.path.exists(CHROMIUM):
        if os.environ.get("PIVOTSPEC_REQUIRE_BROWSER"):
            pytest.fail("Debian's chromium is required for the playground test (install.sh installs it as root)")
        pytest.skip("Debian's chromium is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            page.goto(server["url"] + "/")
            page.fill("#prompt", "w1 w2 w3")
            page.fill("#key", KEY)
            page.select_option("#method", "pad")
            page.fill("#max", "24")
            page.click("#go")
            page.wait_for_function("document.querySelector('#stats').textContent.includes('acceptance rate')",
                                   timeout=30000)
            sources = page.eval_on_selector_all("#out span.tok", "els => els.map(e => e.title)")
        finally:
            browser.close()
    assert len(sources) == 24 and set(sources) <= {"accepted", "override", "corrected", "bonus"}
    assert "override" in sources  # const:0.3 <= the default sigma 0.5: PAD's overrides are coloured as such


def test_no_prefix_caching_reaches_the_batch(server):
    from pivotspec import api
    from pivotspec.cli.main import build_parser
    from pivotspec.server.scheduler import Scheduler

    args = build_parser().parse_args(["serve", "--pair", "testbed", "--no-prefix-caching"])
    assert args.prefix_caching is False
    assert build_parser().parse_args(["serve", "--pair", "testbed"]).prefix_caching is True
    request = api.make_request(server["pair"], prompt="w1 w2", method="sd", max_new_tokens=2)
    for on in (True, False):
        assert Scheduler(server["pair"], 2, prefix_caching=on)._lane(request).prefix_caching is on
