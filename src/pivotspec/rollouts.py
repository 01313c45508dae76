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
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

import torch

from pivotspec.errors import UsageError
from pivotspec.models import LM
from pivotspec.sampling import SamplingConfig, logits_to_probs, sample

ENGINES = ("torch", "vllm")
WORKER = Path(__file__).with_name("vllm_worker.py")


class RolloutEngine(Protocol):
    name: str

    def rollouts(self, prefix: list[int], first_tokens: list[int], cfg: SamplingConfig, max_tokens: int,
                 stop_ids: set[int], generator: torch.Generator) -> list[list[int]]:
        """One continuation per entry of ``first_tokens`` (each starts with it), all after ``prefix``;
        at most ``max_tokens`` tokens each, ending at the first stop id."""
        ...

    def close(self) -> None: ...


@torch.inference_mode()
def batched_rollouts(lm: LM, prefix: list[int], first_tokens: list[int], cfg: SamplingConfig, max_tokens: int,
                     stop_ids: set[int], generator: torch.Generator) -> list[list[int]]:
    """The torch engine's sampler: the prefix is run once (or reused from ``lm``'s cache), its KV cache is
    copied and repeated across the batch, and finished rows leave the batch so they cost nothing more."""
    if lm.cached_ids != prefix:  # after a walk step the cache already holds exactly the prefix
        lm.advance(prefix, keep_logits=1)
    cache = copy.deepcopy(lm.cache)
    cache.batch_repeat_interleave(len(first_tokens))
    outs = [[t] for t in first_tokens]
    active = [i for i, t in enumerate(first_tokens) if t not in stop_ids]
    if active != list(range(len(first_tokens))):
        cache.batch_select_indices(torch.tensor(active, device=lm.device))
    inputs = torch.tensor([[first_tokens[i]] for i in active], device=lm.device)
    for _ in range(max_tokens - 1):
        if not active:
            break
        model_inputs = inputs if lm.input_map is None else lm.input_map[inputs]
        logits = lm.model(input_ids=model_inputs, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        tokens = sample(logits_to_probs(lm.full_vocab(logits.float()), cfg), generator).tolist()
        keep = []
        for row, (i, tok) in enumerate(zip(active, tokens, strict=True)):
            outs[i].append(tok)
            if tok not in stop_ids:
                keep.append(row)
        if len(keep) < len(active):
            active = [active[r] for r in keep]
            if keep:
                cache.batch_select_indices(torch.tensor(keep, device=lm.device))
            tokens = [tokens[r] for r in keep]
        inputs = torch.tensor([[t] for t in tokens], device=lm.device)
    return outs


class TorchEngine:
    name = "torch"

    def __init__(self, lm: LM):
        self.lm = lm

    def rollouts(self, prefix: list[int], first_tokens: list[int], cfg: SamplingConfig, max_tokens: int,
                 stop_ids: set[int], generator: torch.Generator) -> list[list[int]]:
        return batched_rollouts(self.lm, prefix, first_tokens, cfg, max_tokens, stop_ids, generator)

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
                 python: str | None = None, extra: dict[str, Any] | None = None):
        python = python or vllm_python()
        if not Path(python).is_file():
            raise UsageError(f"the vLLM interpreter {python!r} does not exist: run ./install.sh --with-vllm or set "
                             "PIVOTSPEC_VLLM_PYTHON to a Python that has vllm")
        options = {"model": str(model_dir), "seed": seed, "dtype": dtype, "max_model_len": max_model_len,
                   **(extra or {})}
        # The worker's own stdout carries only protocol lines; vLLM's logs go to our stderr.
        self.proc = subprocess.Popen([python, str(WORKER), json.dumps(options)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
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

    def rollouts(self, prefix: list[int], first_tokens: list[int], cfg: SamplingConfig, max_tokens: int,
                 stop_ids: set[int], generator: torch.Generator) -> list[list[int]]:
        groups = group_requests(first_tokens)
        continuations = {t: [[t] for _ in range(k)] for t, k in groups}
        live = [(t, k) for t, k in groups if t not in stop_ids]
        if live and max_tokens > 1:
            request = {"prompts": [prefix + [t] for t, _ in live], "n": [k for _, k in live],
                       "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                       "max_tokens": max_tokens - 1, "stop_token_ids": sorted(stop_ids)}
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            for (t, _), outs in zip(live, self._read()["outputs"], strict=True):
                continuations[t] = [[t] + o for o in outs]
        # Back in the caller's order: the i-th occurrence of token t gets t's i-th continuation.
        unused = {t: iter(c) for t, c in continuations.items()}
        return [next(unused[t]) for t in first_tokens]

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
    dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    # vLLM reserves this fraction of the device's memory (of RAM on the CPU build) for weights and KV cache;
    # its default, 0.9, leaves nothing for the torch copy of the target that walks the trajectories.
    extra: dict[str, Any] = {"gpu_memory_utilization": 0.5 if target.device.type == "cuda" else 0.2}
    try:  # any other LLM(...) argument, e.g. {"tensor_parallel_size": 2} or {"enforce_eager": true}
        extra.update(json.loads(os.environ.get("PIVOTSPEC_VLLM_ARGS") or "{}"))
    except (json.JSONDecodeError, TypeError, ValueError):
        raise UsageError("PIVOTSPEC_VLLM_ARGS must be a JSON object of vllm.LLM arguments") from None
    return VllmEngine(target.source, seed=seed, dtype=dtype, python=python, extra=extra)
