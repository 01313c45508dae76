"""Tasks: problems with a utility checker.

A task has ``problems(split, n, seed) -> list[Problem]`` and ``score(problem, completion) -> float``
in [0, 1]. ``score`` never raises: a malformed completion scores 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pivotspec.errors import UsageError
from pivotspec.tasks.base import Problem, Task

__all__ = ["Problem", "Task", "TASKS", "encode_problem", "encode_prompt", "get_task"]


def _arith(data: str | None) -> Task:
    from pivotspec.tasks.arith import ArithTask

    return ArithTask()


def _arith_hard(data: str | None) -> Task:
    from pivotspec.tasks.arith_hard import ArithHardTask

    return ArithHardTask()


def _dataset(cls_name: str) -> Callable[[str | None], Task]:
    def make(data: str | None) -> Task:
        from pivotspec.tasks import datasets

        return getattr(datasets, cls_name)(data)

    return make


TASKS: dict[str, Callable[[str | None], Task]] = {
    "arith": _arith, "arith-hard": _arith_hard, "humaneval": _dataset("HumanEval"), "gsm8k": _dataset("GSM8K"),
    "mbpp": _dataset("MBPP"), "jsonl": _dataset("JSONLTask"),
}


def get_task(name: str, data: str | None = None) -> Task:
    """Return the task called ``name`` (``data``: local file for file-backed tasks); unknown names give a
    one-line UsageError."""
    if name not in TASKS:
        raise UsageError(f"unknown task {name!r}: choose one of {', '.join(sorted(TASKS))}")
    return TASKS[name](data)


def _check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{what} holds characters that are not valid Unicode ({exc.reason} at position "
                         f"{exc.start}): fix its encoding (UTF-8)") from None


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise UsageError('messages must be a non-empty list of {"role": str, "content": str} objects')
    for m in messages:
        _check_text(m["content"], "a message")


def encode_prompt(tokenizer: Any, text: str | None = None, messages: list[dict[str, str]] | None = None,
                  chat: bool = True, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a prompt: the chat template (with the assistant header) when asked and available,
    else the plain text. ``chat_template_kwargs`` reach the template (e.g. ``enable_thinking`` for Qwen3)."""
    if messages is not None:
        _check_messages(messages)
    if text is not None:
        _check_text(text, "the prompt")
    if chat and getattr(tokenizer, "chat_template", None):
        msgs = messages or [{"role": "user", "content": text or ""}]
        rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                 **(chat_template_kwargs or {}))
        ids = list(tokenizer(rendered, add_special_tokens=False).input_ids)
    else:
        if text is None:
            text = "\n".join(m["content"] for m in messages or [])
        ids = list(tokenizer(text).input_ids)
    if not ids:
        raise UsageError("the prompt is empty (no tokens): give a non-empty prompt, or use --chat")
    return ids


def encode_problem(tokenizer: Any, problem: Problem, chat: bool = True,
                   chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    return encode_prompt(tokenizer, problem.prompt, problem.messages or None, chat, chat_template_kwargs)
