"""The arith task: deterministic, checkable, splits disjoint by construction."""

from __future__ import annotations

import re

import pytest

from pivotspec.errors import UsageError
from pivotspec.tasks import get_task
from pivotspec.tasks.arith import MAX_VALUE, NAMES, OBJECTS, extract_answer, make_problem


def skeleton(p) -> tuple:
    return tuple(re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", p.meta["solution"]))


def test_generator_is_deterministic():
    task = get_task("arith")
    assert task.problems("train", 50, seed=3) == task.problems("train", 50, seed=3)
    assert task.problems("train", 50, seed=3) != task.problems("train", 50, seed=4)


def test_checker_agrees_with_generator_on_10000_problems():
    task = get_task("arith")
    kinds, steps = set(), set()
    for i in range(10_000):
        p = make_problem("train", 7, i)
        assert task.score(p, p.meta["solution"]) == 1.0
        wrong = p.meta["solution"].replace(f"The answer is {p.answer}.", f"The answer is {p.answer + 1}.")
        assert task.score(p, wrong) == 0.0
        kinds.update(op[:3] for op in p.meta["ops"])
        steps.add(p.meta["steps"])
        for a, op, b, c in skeleton(p):  # every intermediate value is a non-negative integer in range
            a, b, c = int(a), int(b), int(c)
            assert 0 <= c <= MAX_VALUE
            assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
            assert op != "/" or a % b == 0
    assert kinds == {"add", "sub", "mul", "div"}
    assert steps == {2, 3, 4, 5}
    assert len(set(NAMES)) >= 30 and len(set(OBJECTS)) >= 30


def test_splits_are_disjoint():
    task = get_task("arith")
    seen = {}
    for split, n in (("train", 4000), ("validation", 1000), ("test", 1000)):
        for p in task.problems(split, n, seed=0):
            key = (p.meta["start"], skeleton(p))  # start value + chain of (a op b = c)
            assert seen.setdefault(key, split) == split, f"{p.id} shares its arithmetic with a {seen[key]} problem"


@pytest.mark.parametrize("completion", ["", "no numbers here", None, "The answer is", "x" * 10000, 12])
def test_malformed_completions_score_zero(completion):
    task = get_task("arith")
    p = task.problems("test", 1)[0]
    assert task.score(p, completion) == 0.0


def test_extract_answer_prefers_the_last_answer_phrase():
    assert extract_answer("3 + 4 = 7. The answer is 7. Then 99") == 7
    assert extract_answer("3 + 4 = 7") == 7
    assert extract_answer("nothing") is None


def test_unknown_task_and_split_are_one_line_errors():
    with pytest.raises(UsageError, match="unknown task"):
        get_task("nope")
    with pytest.raises(UsageError, match="unknown split"):
        get_task("arith").problems("dev", 1)
