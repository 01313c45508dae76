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


def test_arith_hard_splits_checker_and_two_wording_styles():
    import random
    from collections import Counter

    from pivotspec.tasks import get_task
    from pivotspec.tasks.arith_hard import _skeleton_split, solution_text

    task = get_task("arith-hard")
    seen = {}
    for split in ("train", "validation", "test"):
        for p in task.problems(split, 60):
            key = (p.meta["start"], tuple(map(tuple, p.meta["ops"])))
            assert _skeleton_split(*key[:1], list(key[1])) == split and seen.setdefault(key, split) == split
            assert 0 <= p.answer <= 999 and p.meta["steps"] in (3, 4)
            assert task.score(p, p.meta["solution"]) == 1.0 and task.score(p, "The answer is -1.") == 0.0
    problem = task.problems("train", 1)[0]
    rng = random.Random(0)
    by_style = {style: [solution_text(problem.meta["start"], problem.meta["ops"], problem.meta["name"],
                                      problem.meta["object"], rng, style) for _ in range(400)]
                for style in ("target", "draft")}
    for texts in by_style.values():
        assert all(task.score(problem, t) == 1.0 for t in texts)  # every wording states the right answer
    first_steps = {style: Counter(t.split(". ")[1] for t in texts) for style, texts in by_style.items()}
    assert len(first_steps["target"]) >= 30  # many equivalent wordings of one step
    assert max(first_steps["target"].values()) / 400 < 0.15  # none of them likely
    total = sum(abs(first_steps["target"][k] - first_steps["draft"][k]) for k in
                set(first_steps["target"]) | set(first_steps["draft"])) / 800
    assert total > 0.4  # the draft's style is a different distribution over the same kind of sentences
    from pivotspec.tasks.arith_hard import DRAFT_STYLE, TARGET_STYLE

    for part, weights in TARGET_STYLE.items():  # the target has seen every wording the draft writes...
        assert all(w > 0 for w, d in zip(weights, DRAFT_STYLE[part], strict=True) if d > 0), part
        rare = [w for w, d in zip(weights, DRAFT_STYLE[part], strict=True) if d == max(DRAFT_STYLE[part])]
        assert max(rare) / sum(weights) <= 0.1, part  # ...and finds the draft's favourites unlikely
