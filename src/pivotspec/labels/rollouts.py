"""Rollout engines: who samples the target's continuations for pivot labeling.

Labeling walks a trajectory with target and draft on torch (``labeling.py``) and, at each candidate, asks
an engine for N continuations after d and N after t. Engines take and return token ids, never text, so no
re-tokenisation can change a prefix:

- ``torch`` (default): pivotspec's own batched loop over the target already loaded in this process; the
  shared prefix is run once and its KV cache repeated across the batch. Seeded per candidate, so a
  resumed run reproduces the same rollouts.
- ``vllm``: vLLM's offline ``LLM`` in a separate process (continuous batching, prefix caching), one request
  per side with ``n`` = rollouts. The process may live in another virtual environment (vLLM pins its own
  transformers / numpy / fastapi): ``$PIVOTSPEC_VLLM_PYTHON`` names its interpreter, else this one. vLLM's
  sampling is seeded once per engine (the CPU build refuses per-request seeds), so its rollouts are
  reproducible for one run's order of requests, not per candidate. ``$PIVOTSPEC_VLLM_ARGS`` (a JSON object)
  adds arguments to ``vllm.LLM``; by default vLLM takes half of a GPU's memory (the torch copy of the target
  that walks the trajectories needs the rest) or a fifth of the RAM on the CPU build.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from pivotspec.decoding.forward import model_forward
from pivotspec.decoding.models import LM
from pivotspec.decoding.sampling import SamplingConfig, argmax, logits_to_probs, sample
from pivotspec.errors import UsageError

ENGINES = ("torch", "vllm")
ROLLOUT_GAMMA = 5  # draft tokens per step of rollouts under a policy (PAD's default gamma)
WORKER = Path(__file__).with_name("vllm_worker.py")


@dataclass
class RolloutRequest:
    """Continuations wanted after ``prefix``: one per entry of ``first_tokens`` (each starts with it), at
    most ``max_tokens`` tokens each, ending at the first stop id. ``generator`` draws this request's samples
    alone, so what a request gets does not depend on what it is batched with (up to float rounding).
    ``cache``, if given, is a KV cache holding exactly ``prefix`` (a walk's own; read, never changed).
    ``sources`` (the walk's answer so far, per token "override" or not) and ``draft_token`` (a first token
    equal to it is an override) give a policy's context-aware classifier the whole answer."""

    prefix: list[int]
    first_tokens: list[int]
    generator: torch.Generator
    max_tokens: int
    cache: Any = None
    sources: list[str] = field(default_factory=list)
    draft_token: int | None = None


class RolloutEngine(Protocol):
    name: str

    def rollouts(self, prefix: list[int], first_tokens: list[int], cfg: SamplingConfig, max_tokens: int,
                 stop_ids: set[int], generator: torch.Generator) -> list[list[int]]:
        """One continuation per entry of ``first_tokens`` (each starts with it), all after ``prefix``;
        at most ``max_tokens`` tokens each, ending at the first stop id."""
        ...

    def rollouts_many(self, requests: list[RolloutRequest], cfg: SamplingConfig,
                      stop_ids: set[int]) -> list[list[list[int]]]:
        """The continuations of several requests (each as ``rollouts`` would return them), in their order."""
        ...

    def close(self) -> None: ...


def _prefix_cache(lm: LM, request: RolloutRequest, private: bool = True) -> Any:
    """A KV cache holding the request's prefix: the walk's own (copied when ``private``, as the caller will
    change it) or one run now (taken from ``lm``, which starts a fresh cache next time)."""
    if request.cache is not None:
        return copy.deepcopy(request.cache) if private else request.cache
    if lm.cached_ids != request.prefix:
        lm.advance(request.prefix, keep_logits=1)
    if private:
        return copy.deepcopy(lm.cache)  # the model keeps its cache: the next request may share the prefix
    cache, lm.cache, lm.cached_ids = lm.cache, None, []
    return cache


@torch.inference_mode()
def batched_rollouts(lm: LM, prefix: list[int], first_tokens: list[int], cfg: SamplingConfig, max_tokens: int,
                     stop_ids: set[int], generator: torch.Generator, cache: Any = None) -> list[list[int]]:
    """The torch engine's sampler for one prefix: the prefix is run once (or its cache reused), the cache is
    copied and repeated across the batch, and finished rows leave the batch so they cost nothing more."""
    request = RolloutRequest(prefix, first_tokens, generator, max_tokens, cache)
    rows = _prefix_cache(lm, request)
    rows.batch_repeat_interleave(len(first_tokens))
    return _decode_rows(lm, [request], rows, None, cfg, stop_ids)[0]


@torch.inference_mode()
def padded_rollouts(lm: LM, requests: list[RolloutRequest], cfg: SamplingConfig,
                    stop_ids: set[int]) -> list[list[list[int]]]:
    """Several prefixes' rollouts in one batch: each prefix's keys and values are left-padded to the longest
    and masked, and each row is fed its own position. On a CPU a batch of 80 rows samples ~1.8x the tokens
    per second of a batch of 20 (one candidate's), which is what running walks side by side buys."""
    from pivotspec.decoding.kvcache import growing_cache

    caches = [_prefix_cache(lm, r, private=False) for r in requests]  # only read: stacked into new tensors
    lengths = [len(r.prefix) for r in requests]
    longest = max(lengths)
    cache = growing_cache(lm.model.config)

    def stacked(layer: int, part: str) -> torch.Tensor:  # every request's rows of one layer, left-padded
        return torch.cat([torch.nn.functional.pad(getattr(c.layers[layer], part), (0, 0, longest - n, 0))
                          .expand(len(r.first_tokens), -1, -1, -1)
                          for c, r, n in zip(caches, requests, lengths, strict=True)])

    for i, layer in enumerate(cache.layers):
        layer.update(stacked(i, "keys"), stacked(i, "values"))
    mask = torch.cat([torch.cat([torch.zeros(len(r.first_tokens), longest - n, dtype=torch.long),
                                 torch.ones(len(r.first_tokens), n, dtype=torch.long)], dim=1)
                      for r, n in zip(requests, lengths, strict=True)]).to(lm.device)
    return _decode_rows(lm, requests, cache, mask, cfg, stop_ids)


def can_pad(lm: LM) -> bool:
    """Left padding is exact for full attention; a sliding window or a model without position ids in its
    forward would need more than a mask, so such models roll out one prefix at a time."""
    config = lm.model.config
    types = getattr(config, "layer_types", None)
    sliding = any(t != "full_attention" for t in types) if types else bool(getattr(config, "sliding_window", None))
    return not sliding and "position_ids" in inspect.signature(lm.model.forward).parameters


def _decode_rows(lm: LM, requests: list[RolloutRequest], cache: Any, mask: torch.Tensor | None,
                 cfg: SamplingConfig, stop_ids: set[int]) -> list[list[list[int]]]:
    """Sample every request's rows from ``cache`` (their prefixes, row by row) until each row stops.
    ``mask`` (rows x cached positions) marks left padding; None means one unpadded prefix.

    A finished row leaves the batch only once a quarter of the batch has finished: dropping rows copies the
    whole cache (and the next step copies it again into a new buffer), which at 80 rows cost more than
    carrying a few finished rows along. Their outputs are ignored and they draw no random numbers."""
    owner = [k for k, r in enumerate(requests) for _ in r.first_tokens]
    outs = [[t] for r in requests for t in r.first_tokens]
    position = torch.tensor([len(requests[k].prefix) for k in owner], device=lm.device)
    batch = list(range(len(outs)))  # the rows the cache holds, in order
    live = {i for i, out in enumerate(outs) if out[0] not in stop_ids and requests[owner[i]].max_tokens > 1}
    while live:
        if len(live) <= 0.75 * len(batch):
            keep = [j for j, i in enumerate(batch) if i in live]
            batch = [batch[j] for j in keep]
            index = torch.tensor(keep, device=lm.device)
            cache.batch_select_indices(index)
            mask, position = (mask[index] if mask is not None else None), position[index]
        inputs = torch.tensor([[outs[i][-1]] for i in batch], device=lm.device)
        if mask is not None:
            mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype, device=mask.device)], dim=1)
        model_inputs = inputs if lm.input_map is None else lm.input_map[inputs]
        logits = model_forward(lm.model, model_inputs, cache, attention_mask=mask,
                               position_ids=position[:, None] if mask is not None else None)[0][:, -1]
        position = position + 1
        for k, request in enumerate(requests):  # each request samples its own live rows with its own generator
            rows = [j for j, i in enumerate(batch) if i in live and owner[i] == k]
            if not rows:
                continue
            row_logits = lm.full_vocab(logits[rows].float())
            # Greedy (temperature 0) takes the argmax: logits_to_probs then gives the plain softmax (T = 1),
            # which sampling would draw from.
            tokens = (argmax(row_logits) if cfg.greedy else sample(logits_to_probs(row_logits, cfg),
                                                                     request.generator)).tolist()
            for j, tok in zip(rows, tokens, strict=True):
                i = batch[j]
                outs[i].append(tok)
                if tok in stop_ids or len(outs[i]) >= request.max_tokens:
                    live.discard(i)
    per_request: list[list[list[int]]] = [[] for _ in requests]
    for i, out in enumerate(outs):
        per_request[owner[i]].append(out)
    return per_request


class TorchEngine:
    name = "torch"

    def __init__(self, lm: LM):
        self.lm = lm

    def rollouts(self, prefix: list[int], first_tokens: list[int], cfg: SamplingConfig, max_tokens: int,
                 stop_ids: set[int], generator: torch.Generator) -> list[list[int]]:
        return batched_rollouts(self.lm, prefix, first_tokens, cfg, max_tokens, stop_ids, generator)

    def rollouts_many(self, requests: list[RolloutRequest], cfg: SamplingConfig,
                      stop_ids: set[int]) -> list[list[list[int]]]:
        if len(requests) > 1 and can_pad(self.lm):
            return padded_rollouts(self.lm, requests, cfg, stop_ids)
        return [batched_rollouts(self.lm, r.prefix, r.first_tokens, cfg, r.max_tokens, stop_ids, r.generator,
                                 r.cache) for r in requests]

    def close(self) -> None:
        pass


class PolicyEngine:
    """Rollouts that continue under a decoding policy instead of the target alone: draft + target + acceptance
    policy (PAD at its sigma, or lossless SD, which samples the target's own distribution) at the labeling
    temperature, every continuation of every request a row of one batch (``decoding.batch``). Each row is
    seeded from its request's generator, so a request's rollouts do not depend on what it is batched with."""

    name = "policy"

    def __init__(self, target: LM, draft: LM, policy: Any, gamma: int = ROLLOUT_GAMMA):
        self.target, self.draft, self.policy, self.gamma = target, draft, policy, gamma

    def rollouts(self, prefix: list[int], first_tokens: list[int], cfg: SamplingConfig, max_tokens: int,
                 stop_ids: set[int], generator: torch.Generator) -> list[list[int]]:
        return self.rollouts_many([RolloutRequest(prefix, first_tokens, generator, max_tokens)], cfg, stop_ids)[0]

    def rollouts_many(self, requests: list[RolloutRequest], cfg: SamplingConfig,
                      stop_ids: set[int]) -> list[list[list[int]]]:
        from pivotspec.decoding.batch import Request, decode_many

        rows, where = [], []
        for k, r in enumerate(requests):
            seeds = torch.randint(0, 2**62, (len(r.first_tokens),), generator=r.generator).tolist()
            for j, (t, seed) in enumerate(zip(r.first_tokens, seeds, strict=True)):
                if t in stop_ids or r.max_tokens <= 1:
                    continue
                first = "override" if t == r.draft_token else "target"
                rows.append(Request(r.prefix + [t], policy=self.policy, cfg=cfg, gamma=self.gamma,
                                    max_new_tokens=r.max_tokens - 1, eos_ids=stop_ids, seed=seed, method="pad",
                                    sources=r.sources + [first]))
                where.append((k, j))
        outs = [[[t] for t in r.first_tokens] for r in requests]
        # Rows of one request are added together and share its prefix's prefill (computed once, alone, not
        # once per row inside the step).
        gens = decode_many(self.target, rows, draft=self.draft, max_batch=max(1, len(rows)), in_step=False)
        for (k, j), gen in zip(where, gens, strict=True):
            outs[k][j] += gen.token_ids
        return outs

    def close(self) -> None:
        pass


def group_requests(first_tokens: list[int]) -> list[tuple[int, int]]:
    """(first token, how many) in order of first appearance: one engine request with n = count each."""
    counts: dict[int, int] = {}
    for t in first_tokens:
        counts[t] = counts.get(t, 0) + 1
    return list(counts.items())


def vllm_python() -> str:
    """The interpreter that runs the vLLM worker: ``$PIVOTSPEC_VLLM_PYTHON``; else this one when it has vLLM
    (the official ``vllm`` on GPUs); else ``.venv-vllm`` beside this environment (``install.sh --with-vllm``
    makes it for the CPU build, whose pins clash with pivotspec's)."""
    import importlib.util

    if os.environ.get("PIVOTSPEC_VLLM_PYTHON"):
        return os.environ["PIVOTSPEC_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    beside = Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"
    return str(beside) if beside.is_file() else sys.executable


class VllmEngine:
    """vLLM's offline engine in a child process, spoken to by JSON lines over pipes."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, seed: int = 0, dtype: str = "float32", max_model_len: int = 2048,
                 python: str | None = None, extra: dict[str, Any] | None = None, env: dict[str, str] | None = None):
        python = python or vllm_python()
        if not Path(python).is_file():
            raise UsageError(f"the vLLM interpreter {python!r} does not exist: run ./install.sh --with-vllm or set "
                             "PIVOTSPEC_VLLM_PYTHON to a Python that has vllm")
        options = {"model": str(model_dir), "seed": seed, "dtype": dtype, "max_model_len": max_model_len,
                   **(extra or {})}
        # The worker's own stdout carries only protocol lines; vLLM's logs go to our stderr.
        self.proc = subprocess.Popen([python, str(WORKER), json.dumps(options)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env=None if env is None else {**os.environ, **env})
        hello = self._read()
        self.version = hello.get("vllm")

    def _read(self) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            code = self.proc.wait()
            raise UsageError(f"the vLLM worker exited (code {code}) before answering: see its log above; is vllm "
                             f"installed for {vllm_python()}? (./install.sh --with-vllm)")
        msg = json.loads(line)
        if "error" in msg:
            raise UsageError(f"the vLLM worker failed: {msg['error']}")
        return msg

    def complete(self, prompts: list[list[int]], n: list[int], cfg: SamplingConfig, max_tokens: int,
                 stop_ids: set[int], extra_args: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
        """One batch through the engine: ``n[i]`` completions of ``prompts[i]``; returns the worker's answer
        (``outputs``: token ids per prompt per completion; ``spec``: vLLM's spec-decode counters so far)."""
        request = {"prompts": prompts, "n": n, "temperature": cfg.temperature, "top_p": cfg.top_p,
                   "top_k": cfg.top_k, "max_tokens": max_tokens, "stop_token_ids": sorted(stop_ids),
                   "extra_args": extra_args}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def rollouts(self, prefix: list[int], first_tokens: list[int], cfg: SamplingConfig, max_tokens: int,
                 stop_ids: set[int], generator: torch.Generator) -> list[list[int]]:
        return self.rollouts_many([RolloutRequest(prefix, first_tokens, generator, max_tokens)], cfg, stop_ids)[0]

    def rollouts_many(self, requests: list[RolloutRequest], cfg: SamplingConfig,
                      stop_ids: set[int]) -> list[list[list[int]]]:
        # Every request's sides in one engine call (one per length cap): vLLM's steps then carry the rows of
        # all walks running side by side. One call per request left each step with a single candidate's
        # 2 x N rows, and on a CPU vLLM's time went into steps, not rows.
        continuations: list[dict[int, list[list[int]]]] = []
        asks: dict[int, list[tuple[int, int, int]]] = {}  # length cap -> (request, first token, count)
        for i, r in enumerate(requests):
            groups = group_requests(r.first_tokens)
            continuations.append({t: [[t] for _ in range(k)] for t, k in groups})
            if r.max_tokens > 1:
                asks.setdefault(r.max_tokens, []).extend((i, t, k) for t, k in groups if t not in stop_ids)
        for cap, items in asks.items():
            answer = self.complete([requests[i].prefix + [t] for i, t, _ in items], [k for *_, k in items], cfg,
                                   cap - 1, stop_ids)
            for (i, t, _), outs in zip(items, answer["outputs"], strict=True):
                continuations[i][t] = [[t] + o for o in outs]
        # Back in each caller's order: the i-th occurrence of token t gets t's i-th continuation.
        out = []
        for r, conts in zip(requests, continuations, strict=True):
            unused = {t: iter(c) for t, c in conts.items()}
            out.append([next(unused[t]) for t in r.first_tokens])
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def make_engine(name: str, target: LM, seed: int = 0, python: str | None = None) -> RolloutEngine:
    """The rollout engine ``name`` for ``target`` (the vLLM engine loads the target's directory again)."""
    if name == "torch":
        return TorchEngine(target)
    if name != "vllm":
        raise UsageError(f"unknown rollout engine {name!r}: choose {' or '.join(ENGINES)}")
    if target.source is None or not (Path(target.source) / "config.json").is_file():
        raise UsageError(f"the vLLM engine needs the target as a Hugging Face directory; {target.name!r} has none")
    if target.vocab_map is not None:
        raise UsageError("the vLLM engine cannot run a reduced-vocabulary model as the target")
    dtype = target.weights_dtype
    if dtype == "int8":
        raise UsageError("the vLLM engine has no weight-only int8 path: give the target --dtype bfloat16 or float32")
    # vLLM reserves this fraction of the device's memory (of RAM on the CPU build) for weights and KV cache;
    # its default, 0.9, leaves nothing for the torch copy of the target that walks the trajectories.
    extra: dict[str, Any] = {"gpu_memory_utilization": 0.5 if target.device.type == "cuda" else 0.2}
    try:  # any other LLM(...) argument, e.g. {"tensor_parallel_size": 2} or {"enforce_eager": true}
        extra.update(json.loads(os.environ.get("PIVOTSPEC_VLLM_ARGS") or "{}"))
    except (json.JSONDecodeError, TypeError, ValueError):
        raise UsageError("PIVOTSPEC_VLLM_ARGS must be a JSON object of vllm.LLM arguments") from None
    # vLLM refuses a max_model_len above the model's own (a small model built for 1,024 positions).
    max_model_len = min(2048, target.max_positions or 2048)
    return VllmEngine(target.source, seed=seed, dtype=dtype, max_model_len=max_model_len, python=python, extra=extra)
