"""The shipped testbed pair loads offline and reproduces recorded greedy completions.

tests/data/testbed_expected.json was recorded with the shipped artifacts by:
    python -c "from tests.test_testbed import record; record()"
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pivotspec.classifier import features
from pivotspec.cli import main
from pivotspec.decoding.loop import decode
from pivotspec.decoding.models import check_same_tokenizer, eos_ids, load_lm
from pivotspec.tasks import encode_problem, get_task

pytestmark = pytest.mark.slow  # loads the embedded pairs (real weights)

EXPECTED = Path(__file__).parent / "data" / "testbed_expected.json"
LABELS = Path(__file__).parent.parent / "labels" / "testbed_arith_train.jsonl"
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
def pair(testbed_pair):
    return testbed_pair.target, testbed_pair.draft


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
    from pivotspec.classifier.model import load_for_target
    from pivotspec.testbed.artifacts import shipped_classifier

    target, draft = pair
    path = shipped_classifier()
    assert path is not None, "the testbed classifier must ship in src/pivotspec/testbed/data/classifier"
    _, config = load_for_target(path, target)
    assert 0 < config["sigma"] < 1 and config["layer"] == target.num_layers - 7 and config["layer_arg"] == -8
    assert config["metrics"]["report"]["auroc"] > 0.9  # held-out problems that chose nothing
    assert config["metrics"]["selection_at_sigma"]["recall"] >= config["target_recall"]
    assert config["labels"]["sha256_16"] == features.file_hash(LABELS)  # trained on the committed labels
    problem = get_task("arith").problems("test", 1, seed=0)[0]
    assert main(["generate", "--pair", "testbed", "--method", "pad", "--chat", "--json", "--max-new-tokens", "40",
                 "--prompt", problem.prompt]) == 0  # no --classifier: the shipped one is used
    rec = json.loads(capsys.readouterr().out)
    assert rec["stats"]["new_tokens"] > 0 and rec["stats"]["drafted"] > 0


def test_classifier_learns_a_label_that_only_the_draft_token_decides(pair):
    """Relabel real candidates so that d is a pivot iff its token id is odd: nothing about the prefix or the
    target's distribution tells, only d itself. A classifier reading d's own row learns it on held-out
    problems; one reading the row that predicts d (which has not seen d) cannot."""
    from pivotspec.classifier import metrics
    from pivotspec.classifier.model import pivot_scores
    from pivotspec.classifier.training import fit_with_sweep, inputs
    from pivotspec.store import read_records

    target, _ = pair
    records = [r for r in read_records(LABELS, repair=False) if r["type"] == "candidate"][:300]
    records = [{**r, "label": r["d"] % 2, "u_rej": 1.0} for r in records]
    feats = features.extract(target, records, -8)
    split = features.split_by_problem(feats["group"])
    net, _ = fit_with_sweep("extended_v2", feats, split, epochs=400, seed=0, lrs=(1e-3,), weight_decays=(0.0,))
    rep = split == 2
    assert metrics.auroc(pivot_scores(net, *inputs("extended_v2", feats, rep)), feats["labels"][rep]) > 0.9


def test_demo_runs(tmp_path, capsys):
    assert main(["demo", "--n", "2", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "| ar |" in out and "| sd |" in out and "| pad@" in out and "report:" in out
    assert (tmp_path / "demo" / "report.html").is_file()


def test_hard_pair_is_registered_lossless_and_writes_in_two_styles():
    from pivotspec.decoding.models import PAIRS

    assert PAIRS["testbed-hard"].task == "arith-hard"
    target, draft = load_lm("testbed-hard-target"), load_lm("testbed-hard-draft")
    check_same_tokenizer(target, draft)
    assert draft.num_layers <= 4 and draft.vocab_map is not None
    assert sum(p.numel() for p in draft.model.parameters()) < 8_000_000
    openings = {"target": set(), "draft": set()}
    for p in get_task("arith-hard").problems("test", 2, seed=0):
        ids = encode_problem(target.tokenizer, p)
        ar = decode("ar", target, draft, ids, gamma=5, max_new_tokens=120, eos_ids=eos_ids(target))
        sd = decode("sd", target, draft, ids, gamma=5, max_new_tokens=120, eos_ids=eos_ids(target))
        assert sd.token_ids == ar.token_ids, p.id  # lossless on the shipped pair
        own = decode("draft", target, draft, ids, gamma=5, max_new_tokens=120, eos_ids=eos_ids(target))
        openings["target"].add(target.tokenizer.decode(ar.token_ids).split()[0])
        openings["draft"].add(target.tokenizer.decode(own.token_ids).split()[0])
    # The two models learned different wordings: their solutions open with different words.
    assert openings["target"].isdisjoint(openings["draft"])
