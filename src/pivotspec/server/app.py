"""An OpenAI-compatible HTTP server over ``pivotspec.api`` (FastAPI).

Requests decode together: up to ``max_batch`` rows share each speculative step (``scheduler``: continuous
batching on one thread, so the event loop stays free), the rest wait FIFO for a free row, and past
``max_queue`` waiting a request is answered 429 at once. Streaming is server-sent events in OpenAI's chunk
format; a client that disconnects leaves the batch within one step (``on_step`` returns False) and the
other rows go on.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from pivotspec import api
from pivotspec.errors import UsageError
from pivotspec.server.metrics import Metrics, speculative_metrics
from pivotspec.server.scheduler import Job, Scheduler

PLAYGROUND = Path(__file__).parent / "playground.html"


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


@dataclass
class Settings:
    model: str
    method: str = "pad"
    classifier: str | None = None
    sigma: float | None = None
    gamma: int = 5
    max_queue: int = 16
    api_key: str | None = None
    max_tokens: int = 256
    max_batch: int = 8
    max_model_len: int | None = None  # prompt + max_tokens above it is refused (400); None: the target's positions
    prefix_caching: bool = True  # a joining request may take the keys of a start it shares (``Batch.add``)


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if bad or not math.isfinite(value) or not lo <= value <= hi:
        raise APIError(400, f"{key} must be a number in [{lo}, {hi}], got {value!r}", param=key)
    return float(value)


class Server:
    """The loaded pair, its batching scheduler and the counters; the routes below only translate HTTP."""

    def __init__(self, pair: api.Pair, settings: Settings):
        self.pair, self.settings, self.metrics = pair, settings, Metrics()
        self.lock = threading.Lock()
        self.policies: dict[tuple, Any] = {}
        self.max_model_len = settings.max_model_len or pair.target.max_positions or 4096
        self.scheduler = Scheduler(pair, settings.max_batch, self.metrics.set_queue, settings.prefix_caching)

    def policy(self, method: str, sigma: float | None) -> Any:
        """The acceptance policy for a request's ``method`` (ar, draft, sd, pad or a baseline spec), built once."""
        key = (method, sigma)
        if key not in self.policies:
            try:
                self.policies[key] = api.make_policy(self.pair, method, classifier=self.settings.classifier,
                                                     sigma=sigma)
            except UsageError as exc:
                raise APIError(400, str(exc), param="method") from None
        return self.policies[key]

    def parse(self, body: dict, chat: bool) -> dict[str, Any]:
        """The decode arguments of an OpenAI request (plus pivotspec's extra fields), or an APIError."""
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if body.get("model") not in (None, self.settings.model):
            raise APIError(404, f"model {body.get('model')!r} does not exist: this server serves "
                           f"{self.settings.model!r}", kind="not_found_error", param="model")
        if body.get("n", 1) != 1:
            raise APIError(400, "only n = 1 is supported", param="n")
        args: dict[str, Any] = {}
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs):
                raise APIError(400, "messages must be a non-empty list of {role, content} strings", param="messages")
            args["messages"] = [{"role": m["role"], "content": m["content"]} for m in msgs]
        else:
            if not isinstance(body.get("prompt"), str):
                raise APIError(400, "prompt must be a string", param="prompt")
            args["prompt"] = body["prompt"]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or self.settings.max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise APIError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "stop must be a non-empty string or a list of them", param="stop")
        # No seed: a fresh one, as in OpenAI's API and vLLM (a fixed default would give every unseeded sampled
        # request the same random numbers: equal prompts, equal answers).
        seed = body.get("seed", secrets.randbits(63))
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise APIError(400, "seed must be an integer", param="seed")
        gamma = body.get("gamma", self.settings.gamma)
        if not isinstance(gamma, int) or isinstance(gamma, bool) or not 1 <= gamma <= 64:
            raise APIError(400, "gamma must be an integer in [1, 64]", param="gamma")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise APIError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        method = body.get("method", self.settings.method)
        if not isinstance(method, str):
            raise APIError(400, "method must be a string", param="method")
        sigma = body.get("sigma", self.settings.sigma)
        if sigma is not None:
            sigma = _number(body, "sigma", 0.0, 0.0, 1.0)
        args.update(method=method, policy=self.policy(method, sigma), max_new_tokens=max_tokens,
                    temperature=_number(body, "temperature", 0.0, 0.0, 100.0),
                    top_p=_number(body, "top_p", 1.0, 1e-9, 1.0), stop=stop, seed=seed, gamma=gamma,
                    chat=chat, chat_template_kwargs=kwargs)
        return args

    def request(self, args: dict[str, Any], on_step: Any) -> Any:
        """The batch row for parsed ``args``, or an APIError (400) if it cannot run: checked before it queues."""
        fields = {k: v for k, v in args.items() if k != "chat"}
        try:
            request = api.make_request(self.pair, chat=args["chat"], on_step=on_step, **fields)
            if len(request.prompt_ids) + request.max_new_tokens > self.max_model_len:
                raise APIError(400, f"the prompt ({len(request.prompt_ids)} tokens) plus max_tokens "
                               f"({request.max_new_tokens}) exceeds this server's --max-model-len "
                               f"{self.max_model_len}: lower max_tokens or shorten the prompt", param="max_tokens")
            api.check_request(self.pair, request)
        except UsageError as exc:
            raise APIError(400, str(exc)) from None
        return request

    def submit(self, args: dict[str, Any], loop: asyncio.AbstractEventLoop) -> tuple[Job, asyncio.Queue]:
        """Queue a decode; its steps arrive as ("tokens", pairs) events and its end as ("done", generation) or
        ("error", exception). Setting ``job.cancelled`` makes the row leave at its next step."""
        events: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def on_step(pairs: list[tuple[int, str]]) -> bool:
            loop.call_soon_threadsafe(events.put_nowait, ("tokens", pairs))
            return not cancelled.is_set()

        def done(gen: Any, exc: BaseException | None) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("error", exc) if exc is not None else ("done", gen))

        request = self.request(args, on_step)
        with self.lock:
            if self.scheduler.queued() >= self.settings.max_queue:
                raise APIError(429, f"the queue is full ({self.settings.max_queue} waiting): retry later",
                               kind="rate_limit_error")
            job = Job(request, done, cancelled)
            self.scheduler.submit(job)
        return job, events


def visible_text(tokenizer: Any, ids: list[int], stop: list[str]) -> tuple[str, bool]:
    """The text of ``ids`` up to the first stop string (excluded), and whether one was found."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def finish_reason(stats: dict[str, Any], stopped: bool) -> str | None:
    if stopped or stats["stop_reason"] in ("eos", "stop_string"):
        return "stop"
    return "length" if stats["stop_reason"] == "max_tokens" else None


def create_app(pair: api.Pair, settings: Settings) -> FastAPI:
    server = Server(pair, settings)
    app = FastAPI(title="pivotspec", docs_url=None, redoc_url=None)
    app.state.server = server
    tokenizer = pair.target.tokenizer

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        if settings.api_key and request.url.path not in ("/health", "/"):
            if request.headers.get("authorization", "") != f"Bearer {settings.api_key}":
                return error_response(401, "missing or wrong API key: send Authorization: Bearer KEY",
                                      "authentication_error")
        try:
            return await call_next(request)
        except Exception:  # never a traceback to the client
            server.metrics.count("request_failure")
            return error_response(500, "internal error while decoding", "server_error")

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind, exc.param)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": 0,
                                            "owned_by": "pivotspec"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def playground() -> HTMLResponse:
        return HTMLResponse(PLAYGROUND.read_text() if PLAYGROUND.is_file() else "<p>pivotspec server</p>")

    async def complete(request: Request, chat: bool) -> Any:
        arrived = time.perf_counter()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        args = server.parse(body, chat)
        job, events = server.submit(args, asyncio.get_running_loop())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not body.get("stream"):
            first = None
            try:
                while (event := await events.get())[0] == "tokens":
                    first = first or time.perf_counter()
            except asyncio.CancelledError:  # the client went away: its row leaves at the next step
                job.cancelled.set()
                raise
            if event[0] == "error":
                server.metrics.count("request_failure")
                raise APIError(500, f"internal error while decoding: {event[1]}", kind="server_error") from None
            return JSONResponse(response_body(event[1], args, rid, created, chat, arrived, first, server))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(stream(server, tokenizer, args, rid, created, chat, include_usage, arrived, job,
                                        events), media_type="text/event-stream")

    def response_body(gen: Any, args: dict, rid: str, created: int, chat: bool, arrived: float,
                      first: float | None, server: Server) -> dict[str, Any]:
        text, stopped = visible_text(tokenizer, gen.token_ids, args["stop"])
        reason = finish_reason(gen.stats, stopped)
        server.metrics.add_response(gen.stats)
        server.metrics.count("request_success")
        latency = time.perf_counter() - arrived
        server.metrics.observe("request_latency_seconds", latency)
        server.metrics.observe("time_to_first_token_seconds", (first - arrived) if first else latency)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                  if chat else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": settings.model, "choices": [choice], "usage": usage(gen.stats),
                "metrics": {"speculative_decoding": speculative_metrics(gen.stats), "method": args["method"]}}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, False)

    return app


def usage(stats: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose keys the batch
    already held (prefix caching, ``Batch.add``), as OpenAI and vLLM report them."""
    prompt = stats.get("prompt_tokens", 0)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": stats["new_tokens"],
                           "total_tokens": prompt + stats["new_tokens"]}
    if "cached_prompt_tokens" in stats:
        out["prompt_tokens_details"] = {"cached_tokens": stats["cached_prompt_tokens"]}
    return out


async def stream(server: Server, tokenizer: Any, args: dict, rid: str, created: int, chat: bool,
                 include_usage: bool, arrived: float, job: Job, events: asyncio.Queue) -> Any:
    """SSE chunks as the decode emits tokens; a disconnect (the generator closed) cancels the decode."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    hold = max((len(s) for s in args["stop"]), default=1) - 1  # never send the start of a stop string

    def chunk(delta_text: str | None, reason: str | None, tokens: list | None = None, role: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": delta_text} if delta_text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": reason, "logprobs": None}
        body = {"id": rid, "object": obj, "created": created, "model": server.settings.model, "choices": [choice]}
        if tokens:
            body["pivotspec"] = {"tokens": tokens}
        return f"data: {json.dumps(body)}\n\n"

    ids: list[int] = []
    sent, first = "", True
    try:
        if chat:
            yield chunk(None, None, role=True)
        while True:
            kind, payload = await events.get()
            if kind == "error":
                server.metrics.count("request_failure")
                yield f"data: {json.dumps({'error': {'message': str(payload), 'type': 'server_error'}})}\n\n"
                break
            if kind == "tokens":
                ids += [t for t, _ in payload]
                text, stopped = visible_text(tokenizer, ids, args["stop"])
                safe = text if stopped else text.rstrip("\ufffd")[: max(0, len(text) - hold)]
                if first and payload:
                    server.metrics.observe("time_to_first_token_seconds", time.perf_counter() - arrived)
                    first = False
                tokens = [[tokenizer.decode([t]), s] for t, s in payload]
                yield chunk(safe[len(sent):], None, tokens)
                sent = safe if len(safe) > len(sent) else sent
                continue
            gen = payload
            text, stopped = visible_text(tokenizer, gen.token_ids, args["stop"])
            server.metrics.add_response(gen.stats)
            server.metrics.count("request_success")
            server.metrics.observe("request_latency_seconds", time.perf_counter() - arrived)
            final = json.loads(chunk(text[len(sent):], finish_reason(gen.stats, stopped))[6:])
            final["metrics"] = {"speculative_decoding": speculative_metrics(gen.stats), "method": args["method"]}
            yield f"data: {json.dumps(final)}\n\n"
            if include_usage:
                yield ("data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                              "model": server.settings.model, "choices": [],
                                              "usage": usage(gen.stats)}) + "\n\n")
            yield "data: [DONE]\n\n"
            break
    finally:
        job.cancelled.set()  # a client gone mid-stream leaves the batch at its next step
