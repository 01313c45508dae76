"""``arith``: generated GSM-style multi-step word problems with an exact checker.

Each problem starts a person with a count of objects and applies 2 to 5 operations (add, subtract,
multiply by 2 or 3, divide exactly by 2 or 3). The solution restates every step as an equation and ends
with ``The answer is N.``. Numbers stay small (start <= 20, operands <= 15, every value <= 60, never
negative, never fractional) because the point of the task is that a wrong digit or a wrongly copied
number ruins the answer while a different wording does not.

Splits are disjoint by construction: a problem's *skeleton* (its start value and its list of
(operation, operand) pairs) is hashed, and the hash alone decides the split (80% train, 10% validation,
10% test). The generator draws candidates from ``random.Random((split, seed, index))`` and skips the ones
whose skeleton belongs to another split, so the same arithmetic chain can never appear in two splits,
whatever the names, objects or wording.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from pivotspec.errors import UsageError
from pivotspec.tasks.base import Problem

NAMES = (
    "Mia Liam Emma Noah Olivia Ethan Ava Lucas Sophia Mason Isabella Logan Amelia James Harper Elijah "
    "Evelyn Oliver Abigail Jacob Emily Aiden Ella Carter Chloe Daniel Grace Henry Lily Jack Zoe Owen "
    "Nora Leo Ruby Sam"
).split()
OBJECTS = (
    "apples pencils marbles stickers books cookies coins stamps shells cards balloons candies "
    "buttons crayons feathers rocks toys cupcakes oranges eggs beads flowers ribbons keys socks "
    "candles bottles erasers magnets puzzles lemons plums"
).split()

SPLITS = {"train": (0, 80), "validation": (80, 90), "test": (90, 100)}
MAX_VALUE = 60
STEP_WEIGHTS = {2: 0.3, 3: 0.3, 4: 0.25, 5: 0.15}
SYSTEM = "Solve the problem step by step. End with 'The answer is N.'"

START_Q = ("{n} has {a} {o}.", "{n} starts with {a} {o}.", "At first, {n} owns {a} {o}.")
START_S = ("{n} starts with {a} {o}.", "At first {n} has {a} {o}.", "{n} begins with {a} {o}.")
QUESTION = {
    "add": ("Then {n} buys {b} more {o}.", "{n} finds {b} more {o}.", "A friend gives {n} {b} more {o}."),
    "sub": ("Then {n} gives away {b} {o}.", "{n} loses {b} of the {o}.", "{n} sells {b} {o}."),
    "mul2": ("Then the number of {o} doubles.", "{n} ends up with twice as many {o}.",
             "{n} gets enough {o} to have two times as many."),
    "mul3": ("Then the number of {o} triples.", "{n} ends up with three times as many {o}.",
             "{n} gets enough {o} to have three times as many."),
    "div2": ("Then {n} gives away half of the {o}.", "{n} keeps only half of the {o}.",
             "{n} splits the {o} into 2 equal groups and keeps one group."),
    "div3": ("Then {n} keeps only a third of the {o}.", "{n} splits the {o} into 3 equal groups and keeps one.",
             "{n} gives away all but one third of the {o}."),
}
SYMBOL = {"add": "+", "sub": "-", "mul2": "*", "mul3": "*", "div2": "/", "div3": "/"}
SOLUTION = (
    "{x} {s} {b} = {y}, so {n} has {y} {o}.",
    "Now {n} has {x} {s} {b} = {y} {o}.",
    "That makes {x} {s} {b} = {y} {o}.",
)
FINAL_Q = ("How many {o} does {n} have now?", "How many {o} does {n} have at the end?",
           "How many {o} are left with {n}?")


def _skeleton_split(start: int, ops: list[tuple[str, int]]) -> str:
    key = f"{start}|" + ",".join(f"{op}{b}" for op, b in ops)
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
    return next(name for name, (lo, hi) in SPLITS.items() if lo <= bucket < hi)


def _apply(op: str, x: int, b: int) -> int:
    return {"add": x + b, "sub": x - b, "mul2": x * 2, "mul3": x * 3, "div2": x // 2, "div3": x // 3}[op]


def _possible_ops(x: int) -> list[str]:
    ops = []
    if x < MAX_VALUE:
        ops.append("add")
    if x >= 2:
        ops.append("sub")
    if 2 * x <= MAX_VALUE:
        ops.append("mul2")
    if 3 * x <= MAX_VALUE:
        ops.append("mul3")
    if x % 2 == 0 and x >= 2:
        ops.append("div2")
    if x % 3 == 0 and x >= 3:
        ops.append("div3")
    return ops


def _draw_chain(rng: random.Random) -> tuple[int, list[tuple[str, int]]]:
    n_ops = rng.choices(list(STEP_WEIGHTS), weights=list(STEP_WEIGHTS.values()))[0]
    start = rng.randint(2, 20)
    x, ops = start, []
    for _ in range(n_ops):
        # Group the kinds first so that add/sub/mul/div are equally likely whatever the factor.
        kinds = {op[:3]: [] for op in _possible_ops(x)}
        for op in _possible_ops(x):
            kinds[op[:3]].append(op)
        op = rng.choice(kinds[rng.choice(sorted(kinds))])
        if op == "add":
            b = rng.randint(1, min(15, MAX_VALUE - x))
        elif op == "sub":
            b = rng.randint(1, min(15, x - 1))
        else:
            b = int(op[-1])
        ops.append((op, b))
        x = _apply(op, x, b)
    return start, ops


def draw_in_split(task: str, split: str, seed: int, index: int, draw: Any,
                  skeleton_split: Any) -> tuple[random.Random, int, list[tuple[str, int]]]:
    """The generator of problem ``index`` and the first chain it draws whose skeleton belongs to ``split``."""
    if split not in SPLITS:
        raise UsageError(f"unknown split {split!r} for task {task}: choose one of {', '.join(SPLITS)}")
    rng = random.Random(f"{task}/{split}/{seed}/{index}")
    while True:
        start, ops = draw(rng)
        if skeleton_split(start, ops) == split:
            return rng, start, ops


def word_problem(task: str, split: str, seed: int, index: int, text: str, answer: int, meta: dict) -> Problem:
    return Problem(id=f"{task}-{split}-{seed}-{index}", prompt=f"{SYSTEM}\nQuestion: {text}\nAnswer:",
                   messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                   answer=answer, meta=meta)


def make_problem(split: str, seed: int, index: int) -> Problem:
    """The ``index``-th problem of ``split`` for ``seed`` (deterministic)."""
    rng, start, ops = draw_in_split("arith", split, seed, index, _draw_chain, _skeleton_split)
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    question = [rng.choice(START_Q).format(n=name, a=start, o=obj)]
    solution = [rng.choice(START_S).format(n=name, a=start, o=obj)]
    x = start
    for op, b in ops:
        y = _apply(op, x, b)
        question.append(rng.choice(QUESTION[op]).format(n=name, b=b, o=obj))
        solution.append(rng.choice(SOLUTION).format(x=x, s=SYMBOL[op], b=b, y=y, n=name, o=obj))
        x = y
    question.append(rng.choice(FINAL_Q).format(n=name, o=obj))
    solution.append(f"The answer is {x}.")
    return word_problem("arith", split, seed, index, " ".join(question), x,
                        {"solution": " ".join(solution), "steps": len(ops), "start": start,
                         "ops": [op for op, _ in ops]})


_ANSWER = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)
_INTEGER = re.compile(r"-?\d+")


def extract_answer(completion: str) -> int | None:
    """The final integer of a completion: the last 'answer is N', else the last integer, else None."""
    if not isinstance(completion, str):
        return None
    found = _ANSWER.findall(completion) or _INTEGER.findall(completion)
    return int(found[-1]) if found else None


class ArithTask:
    name = "arith"

    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        return [make_problem(split, seed, i) for i in range(n)]

    def score(self, problem: Problem, completion: str) -> float:
        return float(extract_answer(completion) == problem.answer)
