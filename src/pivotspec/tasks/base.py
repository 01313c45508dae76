"""What a task is: problems with a utility checker (re-exported by ``pivotspec.tasks``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


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
