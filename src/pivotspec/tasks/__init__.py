"""Tasks: problems with a utility checker.

A task has ``problems(split, n, seed) -> list[Problem]`` and ``score(problem, completion) -> float``
in [0, 1]. ``score`` never raises: a malformed completion scores 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pivotspec.errors import UsageError


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str  # plain-text prompt (used when the model has no chat template or --chat is off)
    messages: list[dict[str, str]] = field(default_factory=list)  # chat form of the same prompt
    answer: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    name: str

    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]: ...

    def score(self, problem: Problem, completion: str) -> float: ...


def _arith(data: str | None) -> Task:
    from pivotspec.tasks.arith import ArithTask

    return ArithTask()


def _dataset(cls_name: str) -> Callable[[str | None], Task]:
    def make(data: str | None) -> Task:
        from pivotspec.tasks import datasets

        return getattr(datasets, cls_name)(data)

    return make


TASKS: dict[str, Callable[[str | None], Task]] = {
    "arith": _arith, "humaneval": _dataset("HumanEval"), "gsm8k": _dataset("GSM8K"), "mbpp": _dataset("MBPP"),
    "jsonl": _dataset("JSONLTask"),
}


def get_task(name: str, data: str | None = None) -> Task:
    """Return the task called ``name`` (``data``: local file for file-backed tasks); unknown names give a
    one-line UsageError."""
    if name not in TASKS:
        raise UsageError(f"unknown task {name!r}: choose one of {', '.join(sorted(TASKS))}")
    return TASKS[name](data)


def encode_prompt(tokenizer: Any, text: str | None = None, messages: list[dict[str, str]] | None = None,
                  chat: bool = True) -> list[int]:
    """Token ids of a prompt: the chat template (with the assistant header) when asked and available,
    else the plain text."""
    if chat and getattr(tokenizer, "chat_template", None):
        msgs = messages or [{"role": "user", "content": text or ""}]
        rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    if text is None:
        text = "\n".join(m["content"] for m in messages or [])
    return list(tokenizer(text).input_ids)


def encode_problem(tokenizer: Any, problem: Problem, chat: bool = True) -> list[int]:
    return encode_prompt(tokenizer, problem.prompt, problem.messages, chat)
