"""The API's pairs and models: load, name, encode; the tasks by name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivotspec import policies
from pivotspec.decoding.models import LM, PAIRS, check_same_tokenizer, eos_ids, load_lm, resolve
from pivotspec.errors import UsageError
from pivotspec.tasks import Task, encode_prompt
from pivotspec.tasks import get_task as find_task


@dataclass
class Pair:
    """A target, optionally a draft sharing its tokenizer, and the registered pair name they came from."""
    target: LM
    draft: LM | None = None
    name: str | None = None  # e.g. "testbed": lets PAD find the pair's shipped classifier


# --- pairs and models ---------------------------------------------------------------------------------------

def pair_names() -> list[str]:
    """The registered pairs (``testbed``, ``testbed-hard``, ...)."""
    return sorted(PAIRS)


def pair_task(pair: str | None) -> str | None:
    """The task a registered pair was trained for (None for pairs without one, or no pair)."""
    registered = PAIRS.get(pair or "")
    return registered.task if registered else None


def task_for(task: str | None, pair: str | None) -> str:
    """``task``, else the task the pair was trained for, else arith."""
    return task or pair_task(pair) or "arith"


def default_classifier(pair: str | None) -> str | None:
    """The pivot classifier shipped with a registered pair, if any."""
    return policies.default_classifier(pair)


def resolve_names(target: str | None, draft: str | None, pair: str | None,
                  needs_draft: bool = False) -> tuple[str, str | None]:
    """Model specs from explicit names and/or a registered pair name (explicit names win)."""
    if pair is not None:
        if pair not in PAIRS:
            raise UsageError(f"unknown pair {pair!r}: choose one of {', '.join(sorted(PAIRS))}")
        target, draft = target or PAIRS[pair].target, draft or PAIRS[pair].draft
    if not target:
        raise UsageError("no target model: pass --target MODEL or --pair testbed")
    if needs_draft and not draft:
        raise UsageError("this method needs a draft model: pass --draft MODEL or --pair testbed")
    return target, draft


def model_dir(name: str) -> Path | str:
    """Where a model spec's Hugging Face files are (a registered name is built or converted on first use), for
    tools that read them directly, such as a load generator's tokenizer."""
    return resolve(name)[0]


def load_pair(target: str | None = None, draft: str | None = None, *, pair: str | None = None,
              dtype: str | None = None, device: str | None = None, threads: int | None = None,
              needs_draft: bool = False, draft_dtype: str | None = None, serving: bool = False) -> Pair:
    """Load a target (and draft) once onto ``device`` (default auto: CUDA when available, else CPU); ``dtype``
    defaults to bfloat16 on CUDA and ``auto`` on a CPU (see ``load_lm``; ``draft_dtype``: the draft's, default
    ``dtype``). ``serving``: auto chooses the CPU path for a batching server, timing its full batch's forward
    too (``fastpath.SERVING_WIDTHS``). A draft must share the target's tokenizer (checked)."""
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    target_name, draft_name = resolve_names(target, draft, pair, needs_draft)
    from pivotspec.decoding.fastpath import SERVING_WIDTHS  # lazily, as load_lm: it builds the CPU kernels

    widths = SERVING_WIDTHS if serving else None
    t = load_lm(target_name, dtype, threads, device, widths)
    d = load_lm(draft_name, draft_dtype or dtype, threads, device, widths) if draft_name else None
    return make_pair(t, d, pair)


def make_pair(target: LM, draft: LM | None = None, name: str | None = None) -> Pair:
    """A pair of models loaded elsewhere (``load_model``); the draft must share the target's tokenizer."""
    if draft is not None:
        check_same_tokenizer(target, draft)
    return Pair(target, draft, name)


def load_model(name: str, dtype: str | None = None, device: str | None = None) -> LM:
    """One model alone: a registered name, HF directory, .gguf file or cached hub id."""
    return load_lm(name, dtype, device=device)


def encode(lm: LM, prompt: str | None = None, messages: list[dict[str, str]] | None = None, chat: bool = True,
               chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The token ids ``generate`` decodes from: the chat template (with the assistant header) when ``chat``
    and the tokenizer has one, else the plain text."""
    return encode_prompt(lm.tokenizer, prompt, messages, chat, chat_template_kwargs)


def stop_ids(lm: LM) -> set[int]:
    """The token ids that end a completion (the tokenizer's and the generation config's EOS)."""
    return eos_ids(lm)

def get_task(name: str, data: str | None = None) -> Task:
    """The task called ``name`` (arith, arith-hard, humaneval, gsm8k, mbpp, jsonl; ``data``: a local file)."""
    return find_task(name, data)
