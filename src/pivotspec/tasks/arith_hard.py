"""``arith-hard``: multi-digit word problems whose solutions are written in many equivalent ways.

Made for PAD's regime (issue 16): the arithmetic is hard enough that the target is sometimes unsure of a
digit (start 12-99, two-digit additions and subtractions, multiplications and exact divisions by 2-5, every
value in 0..999, 3 or 4 steps), while every solution step can be phrased in dozens of equivalent ways
(connectors, equation forms, restatements), so no single wording has a high probability. Two *styles* draw
from the same phrasings with different weights, plus a few of their own: the target is trained on
``TARGET_STYLE`` and a draft on ``DRAFT_STYLE``, so the draft writes harmless wordings the target finds
unlikely, as a real small model does. The checker is exact (the final integer, as in ``arith``).

Splits are disjoint by construction as in ``arith``: the hash of a problem's skeleton (start value and
(operation, operand) list) decides its split; the namespace differs, so ``arith-hard`` shares no draws with
``arith``.
"""

from __future__ import annotations

import hashlib
import random

from pivotspec.tasks.arith import FINAL_Q, NAMES, OBJECTS, SPLITS, START_Q, draw_in_split, extract_answer, word_problem
from pivotspec.tasks.base import Problem

MAX_VALUE = 999
SYSTEM = "Solve the problem step by step. End with 'The answer is N.'"
FACTORS = (2, 3, 4, 5)

QUESTION = {
    "add": ("Then {n} buys {b} more {o}.", "{n} finds {b} more {o}.", "A friend gives {n} {b} more {o}."),
    "sub": ("Then {n} gives away {b} {o}.", "{n} loses {b} of the {o}.", "{n} sells {b} {o}."),
    "mul": ("Then the number of {o} becomes {b} times as large.", "{n} ends up with {b} times as many {o}."),
    "div": ("Then {n} splits the {o} into {b} equal groups and keeps one.", "{n} keeps only 1 out of every {b} {o}."),
}
SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
WORD = {"add": "plus", "sub": "minus", "mul": "times", "div": "divided by"}
VERB = {"add": "adding {b} to {x}", "sub": "taking {b} from {x}", "mul": "multiplying {x} by {b}",
        "div": "dividing {x} by {b}"}

# Phrasings of one step: (connector, equation, tail). A style is a weight per option; 0 = never used.
CONNECTORS = ("", "Then ", "Next, ", "After that, ", "Now ", "So ", "This time ", "In this step, ")
EQUATIONS = ("{x} {s} {b} = {y}", "{x} {w} {b} is {y}", "{x} {s} {b} gives {y}", "we get {x} {s} {b} = {y}",
             "{v} gives {y}", "the count is {x} {s} {b} = {y}", "{x} {s} {b} makes {y}", "{v} leaves {y}")
TAILS = (".", " {o}.", ", so {n} has {y} {o}.", ". {n} now has {y} {o}.", " {o} in total.",
         ", which means {y} {o}.", " {o} for {n}.", ". That is {y} {o}.")
STARTS = ("{n} starts with {a} {o}.", "At first {n} has {a} {o}.", "{n} begins with {a} {o}.",
          "In the beginning there are {a} {o}.", "We start from {a} {o}.", "Initially {n} owns {a} {o}.")

# The target has seen every phrasing (weight >= 1), the draft's favourites rarely: a real target has read
# most wordings a small draft writes and finds them unlikely but not strange. (The first design gave the
# draft's favourites weight 0; the target then lost its way after them, so many wording tokens were pivots.)
TARGET_STYLE = {"connectors": (4, 3, 2, 1, 2, 1, 1, 1), "equations": (4, 2, 2, 1, 1, 1, 1, 1),
                "tails": (2, 3, 3, 2, 1, 1, 1, 1), "starts": (3, 2, 2, 1, 1, 1)}
DRAFT_STYLE = {"connectors": (1, 1, 1, 2, 1, 2, 3, 3), "equations": (1, 1, 1, 3, 3, 1, 2, 3),
               "tails": (1, 1, 1, 1, 2, 3, 3, 3), "starts": (1, 1, 1, 3, 3, 1)}
STYLES = {"target": TARGET_STYLE, "draft": DRAFT_STYLE}


def _skeleton_split(start: int, ops: list[tuple[str, int]]) -> str:
    key = "hard|" + f"{start}|" + ",".join(f"{op}{b}" for op, b in ops)
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
    return next(name for name, (lo, hi) in SPLITS.items() if lo <= bucket < hi)


def _apply(op: str, x: int, b: int) -> int:
    return {"add": x + b, "sub": x - b, "mul": x * b, "div": x // b}[op]


def _draw_chain(rng: random.Random) -> tuple[int, list[tuple[str, int]]]:
    start = rng.randint(12, 99)
    x, ops = start, []
    for _ in range(rng.choice((3, 3, 4))):
        options = []
        if x + 11 <= MAX_VALUE:
            options.append(("add", rng.randint(11, min(99, MAX_VALUE - x))))
        if x >= 22:
            options.append(("sub", rng.randint(11, min(99, x - 11))))
        mul = [f for f in FACTORS if x * f <= MAX_VALUE]
        if mul and x <= 200:
            options.append(("mul", rng.choice(mul)))
        div = [f for f in FACTORS if x % f == 0 and x // f >= 5]
        if div:
            options.append(("div", rng.choice(div)))
        op, b = rng.choice(options)
        ops.append((op, b))
        x = _apply(op, x, b)
    return start, ops


def _pick(rng: random.Random, options: tuple[str, ...], weights: tuple[int, ...]) -> str:
    return rng.choices(options, weights=weights)[0]


def solution_text(start: int, ops: list[tuple[str, int]], name: str, obj: str, rng: random.Random,
                  style: str = "target") -> str:
    """A worked solution in ``style`` ("target" or "draft"), ending with 'The answer is N.'."""
    weights = STYLES[style]
    parts = [_pick(rng, STARTS, weights["starts"]).format(n=name, a=start, o=obj)]
    x = start
    for op, b in ops:
        y = _apply(op, x, b)
        fields = dict(x=x, b=b, y=y, s=SYMBOL[op], w=WORD[op], v=VERB[op].format(x=x, b=b), n=name, o=obj)
        connector = _pick(rng, CONNECTORS, weights["connectors"])
        equation = _pick(rng, EQUATIONS, weights["equations"]).format(**fields)
        if not connector:
            equation = equation[0].upper() + equation[1:]
        parts.append(connector + equation + _pick(rng, TAILS, weights["tails"]).format(**fields))
        x = y
    parts.append(f"The answer is {x}.")
    return " ".join(parts)


def styled_solution(problem: Problem, style: str) -> str:
    """``problem``'s worked solution in ``style``: the stored one for "target", otherwise a rendering of
    the same skeleton whose wording draws depend only on the problem's id (deterministic per problem)."""
    if style == "target":
        return problem.meta["solution"]
    m = problem.meta
    rng = random.Random(f"{problem.id}|{style}")
    return solution_text(m["start"], [tuple(op) for op in m["ops"]], m["name"], m["object"], rng, style)


def make_problem(split: str, seed: int, index: int) -> Problem:
    """The ``index``-th problem of ``split`` for ``seed`` (deterministic); ``meta`` keeps the skeleton so
    a solution can be rendered in either style."""
    rng, start, ops = draw_in_split("arith-hard", split, seed, index, _draw_chain, _skeleton_split)
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    question = [rng.choice(START_Q).format(n=name, a=start, o=obj)]
    question += [rng.choice(QUESTION[op]).format(n=name, b=b, o=obj) for op, b in ops]
    question.append(rng.choice(FINAL_Q).format(n=name, o=obj))
    answer = start
    for op, b in ops:
        answer = _apply(op, answer, b)
    return word_problem("arith-hard", split, seed, index, " ".join(question), answer,
                        {"solution": solution_text(start, ops, name, obj, rng), "start": start, "ops": ops,
                         "name": name, "object": obj, "steps": len(ops)})


class ArithHardTask:
    name = "arith-hard"

    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        return [make_problem(split, seed, i) for i in range(n)]

    def score(self, problem: Problem, completion: str) -> float:
        return float(extract_answer(completion) == problem.answer)
