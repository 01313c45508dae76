"""The shipped testbed pair loads offline and reproduces recorded greedy completions.

tests/data/testbed_expected.json was recorded with the shipped artifacts by:
    python -c "from tests.test_testbed import record; record()"
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pivotspec.cli import main
from pivotspec.decoding import decode
from pivotspec.models import check_same_tokenizer, eos_ids, load_lm
from pivotspec.tasks import encode_problem, get_task

EXPECTED = Path(__file__).parent / "data" / "testbed_expected.json"
PROBLEMS = [0, 1, 2]


def completions(method: str) -> dict[str, list[int]]:
    target, draft = load_lm("testbed-target"), load_lm("testbed-draft")
    out = {}
    for p in get_task("arith").problems("test", max(PROBLEMS) + 1, seed=0):
        ids = encode_problem(target.tokenizer, p)
        g = decode(method, target, draft, ids, gamma=5, max_new_tokens=160, eos_ids=eos_ids(target))
        out[p.id] = g.token_ids
    return out


def record() -> None:
    EXPECTED.write_text(json.dumps({"target": completions("ar"), "draft": completions("draft")}, indent=1))


@pytest.fixture(scope="module")
def pair():
    target, draft = load_lm("testbed-target"), load_lm("testbed-draft")
    check_same_tokenizer(target, draft)
    return target, draft


def test_shipped_models_reproduce_recorded_completions(pair):
    target, draft = pair
    expected = json.loads(EXPECTED.read_text())
    for p in get_task("arith").problems("test", max(PROBLEMS) + 1, seed=0):
        ids = encode_problem(target.tokenizer, p)
        for method, key in (("ar", "target"), ("draft", "draft"), ("sd", "target")):
            g = decode(method, target, draft, ids, gamma=5, max_new_tokens=160, eos_ids=eos_ids(target))
            assert g.token_ids == expected[key][p.id], (method, p.id)


def test_shipped_draft_is_small_and_reduced_vocab(pair):
    _, draft = pair
    assert draft.num_layers <= 4 and draft.vocab_map is not None
    assert sum(p.numel() for p in draft.model.parameters()) < 8_000_000


def test_shipped_classifier_fits_the_target_and_drives_pad(pair, capsys):
    from pivotspec.classifier_cli import load_for_target
    from pivotspec.testbed.artifacts import shipped_classifier

    target, draft = pair
    path = shipped_classifier()
    assert path is not None, "the testbed classifier must ship in src/pivotspec/testbed/data/classifier"
    _, config = load_for_target(path, target)
    assert 0 < config["sigma"] < 1 and config["layer"] == target.num_layers - 8
    assert config["metrics"]["val"]["auroc"] > 0.6  # far above chance on held-out problems
    assert config["val_recall_at_sigma"] >= config["target_recall"]
    problem = get_task("arith").problems("test", 1, seed=0)[0]
    assert main(["generate", "--pair", "testbed", "--method", "pad", "--chat", "--json", "--max-new-tokens", "40",
                 "--prompt", problem.prompt]) == 0  # no --classifier: the shipped one is used
    rec = json.loads(capsys.readouterr().out)
    assert rec["stats"]["new_tokens"] > 0 and rec["stats"]["drafted"] > 0


def test_demo_runs(tmp_path, capsys):
    assert main(["demo", "--n", "2", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "| ar |" in out and "| sd |" in out and "| pad@" in out and "report:" in out
    assert (tmp_path / "demo" / "report.html").is_file()
