"""The API's decoding: one prompt (``generate``), a batch row (``make_request``, ``new_batch``), or many prompts
at once (``generate_many``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pivotspec import policies
from pivotspec.api.pairs import Pair, encode
from pivotspec.decoding.acceptance import DEFAULT_P_FLOOR
from pivotspec.decoding.batch import Batch, Request, decode_many
from pivotspec.decoding.loop import Generation, check_fits, decode
from pivotspec.decoding.models import eos_ids
from pivotspec.decoding.sampling import SamplingConfig, derive_seed
from pivotspec.errors import UsageError
from pivotspec.store import read_user_jsonl


def check_decoding(gamma: int = 5, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, stop: list[str] | None = None) -> None:
    """Decoding settings that cannot work, as one-line errors (before any model loads)."""
    if gamma < 1:
        raise UsageError(f"--gamma must be >= 1, got {gamma}")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if any(s == "" for s in stop or []):
        raise UsageError("--stop needs a non-empty string (an empty one would stop after the first token)")
    SamplingConfig(temperature, top_k, top_p)


def decode_method(method: str) -> str:
    """What the loop runs for ``method``: ar, draft, sd and pad as named; a baseline spec runs as pad (SD with
    an override policy)."""
    return "pad" if policies.is_baseline(method) else method


def make_policy(pair: Pair | None, method: str, *, classifier: str | None = None, sigma: float | None = None,
                p_floor: float = DEFAULT_P_FLOOR, pair_name: str | None = None, budget: float | None = None) -> Any:
    """The acceptance policy ``method`` names (ar, draft, sd, pad or a baseline spec such as ``topk:k=3``).
    With ``pair=None`` only the arguments are checked (a pad classifier's files included; ``pair_name``
    finds a registered pair's shipped classifier) and None is returned for pad. ``budget``: PAD per answer
    (``policies.make_policy``)."""
    target, name = (pair.target, pair.name) if pair is not None else (None, pair_name)
    return policies.make_policy(method, target, classifier=classifier, sigma=sigma, p_floor=p_floor, pair=name,
                                budget=budget)


def make_request(pair: Pair, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                 prompt_ids: list[int] | None = None, method: str | None = None, classifier: str | None = None,
                 sigma: float | None = None, budget: float | None = None, p_floor: float = DEFAULT_P_FLOOR,
                 policy: Any = None, gamma: int = 5,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, stop: list[str] | None = None, chat: bool = True,
                 chat_template_kwargs: dict[str, Any] | None = None, on_step: Any = None) -> Request:
    """One decode's checked settings, as a row a batch can take (``new_batch``; method ``draft`` rows go to the
    batch made with ``draft_only``). The arguments are ``generate``'s."""
    if prompt is None and messages is None and prompt_ids is None:
        raise UsageError("give a prompt, messages or prompt ids")
    check_decoding(gamma, max_new_tokens, temperature, top_k, top_p, stop)
    method = method or ("sd" if pair.draft is not None else "ar")
    if method != "ar" and pair.draft is None:
        raise UsageError(f"method {method!r} needs a draft model: load the pair with a draft")
    if policy is None:
        policy = make_policy(pair, method, classifier=classifier, sigma=sigma, p_floor=p_floor, budget=budget)
    ids = prompt_ids or encode(pair.target, prompt, messages, chat, chat_template_kwargs)
    return Request(ids, policy=policy if decode_method(method) == "pad" else None,
                   cfg=SamplingConfig(temperature, top_k, top_p), gamma=gamma, max_new_tokens=max_new_tokens,
                   eos_ids=eos_ids(pair.target), stop_strings=list(stop or []), seed=seed,
                   speculate=decode_method(method) in ("sd", "pad"), on_step=on_step, method=method)


def check_request(pair: Pair, request: Request) -> None:
    """A UsageError if the row cannot decode on this pair (an empty prompt; prompt + max_new_tokens past a model's
    positions), before it joins a batch."""
    check_fits(request.prompt_ids, request.max_new_tokens, pair.target, pair.draft)


def generate(pair: Pair, prompt: str | None = None, **settings: Any) -> Generation:
    """Decode one prompt (text, chat ``messages``, or token ``prompt_ids``). ``method``: ar, draft, sd, pad or a
    baseline spec (default: sd with a draft, else ar); ``policy`` (from ``make_policy``, or any acceptance
    policy) saves building it per call; ``classifier``, ``sigma`` (or ``budget``) and ``p_floor`` build
    PAD's. Also ``gamma``, ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``,
    ``chat`` and ``chat_template_kwargs`` (see ``make_request``). Returns text, token ids, stats (tau = tokens
    per target forward, eta, forwards, timings) and the per-token trace (token id, source). ``on_step(pairs)`` sees each
    step's new (token id, source) pairs as they come; returning False stops the decode."""
    r = make_request(pair, prompt, **settings)
    return decode(decode_method(r.method), pair.target, pair.draft, r.prompt_ids, r.policy, cfg=r.cfg,
                  gamma=r.gamma, max_new_tokens=r.max_new_tokens, eos_ids=r.eos_ids, stop_strings=r.stop_strings,
                  seed=r.seed, on_step=r.on_step)


def new_batch(pair: Pair, draft_only: bool = False, prefix_caching: bool = True) -> Batch:
    """An empty batch over the pair (over the draft alone with ``draft_only``, for method ``draft``): rows from
    ``make_request`` join with ``add`` and advance together with ``step`` (see ``pivotspec.decoding.batch``).
    ``prefix_caching``: a joining row may take the keys of a start it shares with another (``Batch.add``)."""
    if draft_only and pair.draft is None:
        raise UsageError("method 'draft' needs a draft model: load the pair with a draft")
    return (Batch(pair.draft, None, prefix_caching=prefix_caching) if draft_only
            else Batch(pair.target, pair.draft, prefix_caching=prefix_caching))


def generate_many(pair: Pair, prompts: list[Any], *, batch_size: int = 8, **settings: Any) -> list[Generation]:
    """Decode many prompts together, at most ``batch_size`` rows at a time (a finished row's place goes to the
    next prompt at once). Each prompt is a text, a chat message list or a list of token ids; ``settings`` are
    ``generate``'s and apply to every row, except ``seed``: prompt i samples with ``derive_seed(seed, i)``, so
    sampled rows draw independent numbers (two equal prompts get two samples, as in vLLM) and row i equals
    ``generate(..., seed=derive_seed(seed, i))``. Greedy rows equal their ``generate`` output token for token."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    requests = []
    seed = settings.pop("seed", 0)
    for i, p in enumerate(prompts):
        key = "prompt" if isinstance(p, str) else "prompt_ids" if p and isinstance(p[0], int) else "messages"
        requests.append(make_request(pair, **{key: p}, seed=derive_seed(seed, i), **settings))
    draft_only = requests[0].method == "draft" if requests else False
    batch = new_batch(pair, draft_only)
    return decode_many(batch.target, requests, draft=batch.draft, max_batch=batch_size)


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """A JSONL file of prompts, one ``{"prompt": ...}`` or ``{"messages": [...]}`` per line."""
    path = Path(path)
    prompts = read_user_jsonl(path, "prompts file")
    for n, obj in enumerate(prompts, 1):
        if not ({"prompt", "messages"} & obj.keys()):
            raise UsageError(f'{path}: record {n} needs a "prompt" or "messages" key')
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            raise UsageError(f'{path}: record {n}: "prompt" must be a string')
    return prompts
