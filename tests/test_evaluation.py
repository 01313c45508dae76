"""pivotspec eval: rows, summaries that equal the aggregate of the rows, reports, resume."""

from __future__ import annotations

import json
import os
from html.parser import HTMLParser

import pytest

from pivotspec.cli import main
from pivotspec.decoding import rowwise
from pivotspec.evaluation.runs import method_specs
from pivotspec.evaluation.summary import summarize, wilson_ci
from pivotspec.store import read_records

PROMPTS = [{"prompt": f"w{i} w{i + 1} w{i + 2}", "regex": "w1"} for i in range(2, 7)]


@pytest.fixture
def data(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return f


def eval_args(tiny_dir, data, out, *extra):
    return ["eval", "--target", str(tiny_dir["llama_target"]), "--draft", str(tiny_dir["llama_draft"]),
            "--task", "jsonl", "--data", str(data), "--n", "4", "--methods", "ar,sd,pad", "--classifier", "const:0.3",
            "--sigmas", "0,0.5", "--baselines", "typical,topk", "--max-new-tokens", "10", "--gamma", "3",
            "--out", str(out), *extra]


class SpanCounter(HTMLParser):
    def __init__(self):
        super().__init__()
        self.in_text, self.counts, self.depth = False, [], 0

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class", "")
        if tag == "div" and cls == "text":
            self.in_text = True
            self.counts.append(0)
        elif tag == "span" and self.in_text and cls.startswith("tok "):
            self.counts[-1] += 1

    def handle_endtag(self, tag):
        if tag == "div" and self.in_text:
            self.in_text = False


def test_eval_writes_rows_summaries_and_reports(tiny_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(eval_args(tiny_dir, data, out, "--json")) == 0
    summary = json.loads(capsys.readouterr().out)["methods"]
    assert list(summary) == ["ar", "sd", "pad@0", "pad@0.5", "typical(epsilon=0.09,delta=0.3)",
                             "topk(k=5,ratio=0.3)"]
    rows = read_records(out / "results.jsonl")
    assert len(rows) == 4 * 6
    # a method's summary equals the aggregate of its rows
    assert summarize(rows) == summary
    for label, s in summary.items():
        mine = [r for r in rows if r["method"] == label]
        correct = sum(r["score"] for r in mine)
        assert s["accuracy"] == correct / 4 and s["ci95"] == list(wilson_ci(correct, 4))
        assert s["new_tokens"] == sum(r["stats"]["new_tokens"] for r in mine)
    assert summary["ar"]["speedup"] == pytest.approx(1.0)
    # pad with sigma = 0 is SD exactly (greedy)
    by = {(r["problem_id"], r["method"]): r for r in rows}
    for pid in {r["problem_id"] for r in rows}:
        assert by[(pid, "pad@0")]["completion"] == by[(pid, "sd")]["completion"] == by[(pid, "ar")]["completion"]
    assert json.loads((out / "summary.json").read_text())["methods"] == summary
    assert "| pad@0.5 |" in (out / "summary.md").read_text()
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    parser = SpanCounter()
    parser.feed((out / "report.html").read_text())
    assert parser.counts == [r["stats"]["new_tokens"] for r in rows]


def test_eval_resumes_and_refuses_other_configs(tiny_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(eval_args(tiny_dir, data, out)) == 0
    full = read_records(out / "results.jsonl")
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text("".join(lines[:-5]) + lines[-5][:20])  # killed mid-write
    assert main(eval_args(tiny_dir, data, out)) == 0
    resumed = read_records(out / "results.jsonl")
    key = lambda r: (r["problem_id"], r["method"])  # noqa: E731
    assert sorted(map(key, resumed)) == sorted(map(key, full))
    assert main(eval_args(tiny_dir, data, out)) == 0
    assert len(read_records(out / "results.jsonl")) == len(full)  # nothing re-run
    capsys.readouterr()
    assert main([*eval_args(tiny_dir, data, out), "--temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "different seeding, temperature" in err and len(err.strip().splitlines()) == 1
    assert main([*eval_args(tiny_dir, data, out), "--temperature", "0.5", "--overwrite"]) == 0
    assert len(read_records(out / "results.jsonl")) == len(full)


def test_pad_labels_carry_a_non_default_tau_so_runs_at_two_taus_never_share_rows(tiny_dir, data, tmp_path, capsys):
    labels = lambda **kw: [s.label for s in method_specs("sd,pad", sigmas=[0.1, 0.3], classifier="const:0.2", **kw)]  # noqa: E731
    assert labels() == labels(p_floor=1e-4) == ["sd", "pad@0.1", "pad@0.3"]  # earlier runs keep their labels
    assert labels(p_floor=0.01) == ["sd", "pad@0.1 tau=0.01", "pad@0.3 tau=0.01"]
    out = tmp_path / "run"
    assert main(eval_args(tiny_dir, data, out)) == 0
    capsys.readouterr()
    assert main([*eval_args(tiny_dir, data, out), "--tau", "0.01"]) == 2  # would otherwise resume tau 1e-4's rows
    assert "different methods" in capsys.readouterr().err


def test_a_run_moved_to_another_dtype_does_not_resume_from_the_first_ones_rows(tiny_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*eval_args(tiny_dir, data, out), "--dtype", "float32"]) == 0
    on_cpu = os.environ["PIVOTSPEC_DEVICE"] == "cpu"
    assert ("placement" in json.loads((out / "run.json").read_text())) != on_cpu  # CPU float32: as before
    capsys.readouterr()
    assert main([*eval_args(tiny_dir, data, out), "--dtype", "bfloat16"]) == 2
    assert "different placement" in capsys.readouterr().err
    assert main([*eval_args(tiny_dir, data, tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    placement = json.loads((tmp_path / "bf16" / "run.json").read_text())["placement"]
    assert [w.split()[1] for w in placement] == ["bfloat16", "bfloat16"]


@pytest.mark.skipif(not rowwise.available(), reason="no C compiler for the row-wise kernel")
def test_int8_runs_record_their_kernel_and_do_not_resume_on_the_other(tiny_dir, data, tmp_path, capsys,
                                                                       monkeypatch):
    """The two int8 kernels hold the same weights but compute other numbers (float32 inputs against bfloat16
    ones), so a run records which one made it and refuses to resume on the other."""
    out = tmp_path / "run"
    args = ["eval", "--target", str(tiny_dir["llama_target"]), "--task", "jsonl", "--data", str(data), "--n", "2",
            "--methods", "ar", "--max-new-tokens", "4", "--out", str(out), "--dtype", "int8"]
    monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", "rowwise")
    assert main(args) == 0
    assert json.loads((out / "run.json").read_text())["placement"] == ["cpu int8 rowwise"]
    capsys.readouterr()
    monkeypatch.setenv("PIVOTSPEC_CPU_KERNELS", "packed")  # PyTorch's int8 kernel
    assert main(args) == 2
    assert "different placement" in capsys.readouterr().err


def test_a_method_can_run_at_its_own_gamma(tiny_dir, load, data):
    """Benchmarks put several gammas in one interleaved run; each spec's gamma must reach the decoder."""
    from pivotspec.decoding.acceptance import Lossless
    from pivotspec.evaluation.runs import MethodSpec, run_eval
    from pivotspec.tasks import get_task

    target = load(tiny_dir["llama_target"])
    task = get_task("jsonl", str(data))
    specs = [MethodSpec("sd g=1", "sd", Lossless(), 1), MethodSpec("sd g=4", "sd", Lossless(), 4)]
    rows = run_eval(task, task.problems("test", 3, 0), specs, target, target, chat=False, gamma=2,
                    max_new_tokens=12)
    for gamma in (1, 4):
        for r in (r for r in rows if r["method"] == f"sd g={gamma}"):
            s = r["stats"]
            assert s["drafted"] <= gamma * s["target_forwards"]
            assert s["drafted"] > (gamma - 1) * s["target_forwards"] - gamma  # draft = target: full steps


def test_resuming_refuses_a_retrained_classifier(tmp_path):
    from pivotspec.decoding.acceptance import PAD, constant_classifier
    from pivotspec.evaluation.runs import MethodSpec, classifier_fingerprint

    clf = tmp_path / "clf"
    clf.mkdir()
    (clf / "classifier.safetensors").write_bytes(b"weights v1")
    (clf / "classifier.json").write_text("{}")
    args = str(clf)
    specs = [MethodSpec("pad@0.5", "pad", PAD(constant_classifier(0.0), 0.5))]
    before = classifier_fingerprint(args, specs)
    (clf / "eval-plots").mkdir()  # a subdirectory (and plots) beside the classifier change nothing
    (clf / "eval-plots" / "roc.png").write_bytes(b"png")
    assert classifier_fingerprint(args, specs) == before
    (clf / "classifier.safetensors").write_bytes(b"weights v2")
    assert classifier_fingerprint(args, specs) != before
    assert classifier_fingerprint(args, [MethodSpec("sd", "sd")]) is None


def test_a_second_eval_on_a_busy_out_dir_leaves_the_file_alone(tiny_dir, data, tmp_path, capsys):
    """While one run holds results.jsonl, a second one must stop before reading it: reading repairs a
    cut-off last line, which here is the first run's line being written."""
    import fcntl

    out = tmp_path / "run"
    assert main(eval_args(tiny_dir, data, out)) == 0
    results = out / "results.jsonl"
    half = results.read_text() + '{"problem_id": "p9", "meth'  # the first run, mid-write
    results.write_text(half)
    with results.open("a") as busy:
        fcntl.flock(busy.fileno(), fcntl.LOCK_EX)
        capsys.readouterr()
        assert main(eval_args(tiny_dir, data, out)) == 2
        assert "another pivotspec process" in capsys.readouterr().err
        assert results.read_text() == half


def test_batched_eval_rows_equal_batch1_and_report_throughput(tiny_dir, data, tmp_path, capsys):
    """--batch-size 3 (draft-only rows too): every row's completion, score and token sources equal the batch-1
    run's; the summary gives tokens/s and no per-problem speedup; the batch size is part of the run's identity."""
    one, three = tmp_path / "one", tmp_path / "three"
    args = ["--methods", "ar,draft,sd,pad", "--n", "5"]
    assert main(eval_args(tiny_dir, data, one, *args)) == 0
    assert main(eval_args(tiny_dir, data, three, *args, "--batch-size", "3", "--json")) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])["methods"]
    key = lambda r: (r["problem_id"], r["method"])  # noqa: E731
    rows1 = sorted(read_records(one / "results.jsonl"), key=key)
    rows3 = sorted(read_records(three / "results.jsonl"), key=key)
    assert len(rows3) == 5 * 7  # ar, draft, sd, pad at two sigmas, two baselines
    for a, b in zip(rows1, rows3, strict=True):
        assert (a["completion"], a["score"], a["trace"]) == (b["completion"], b["score"], b["trace"]), key(a)
        assert b["stats"]["batch_size"] == 3 and b["stats"]["draft_forwards"] == a["stats"]["draft_forwards"]
    for s in summary.values():
        assert s["speedup"] is None and s["tokens_per_s"] > 0 and s["batch_size"] == 3
    assert "tokens/s" in (three / "summary.md").read_text()
    assert main(eval_args(tiny_dir, data, three, *args)) == 2  # batch 1 must not resume batch 3's rows
    assert "batch_size" in capsys.readouterr().err


def test_sampled_eval_seeds_each_problem_on_its_own(tiny_dir, tmp_path, capsys):
    """At temperature > 0 every problem draws its own numbers (one seed shared by all problems correlated their
    accept/reject decisions): four copies of one prompt get different samples, and a problem's answer does not
    depend on the batch it decoded in."""
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps({"prompt": "w1 w2", "regex": "w1"}) + "\n" for _ in range(4)))
    runs = {}
    for b in ("1", "4"):
        out = tmp_path / f"b{b}"
        assert main(["eval", "--target", str(tiny_dir["llama_target"]), "--draft", str(tiny_dir["llama_draft"]),
                     "--task", "jsonl", "--data", str(same), "--n", "4", "--methods", "ar,sd", "--temperature", "2.0",
                     "--max-new-tokens", "16", "--gamma", "3", "--batch-size", b, "--out", str(out)]) == 0
        runs[b] = {(r["problem_id"], r["method"]): r["completion"] for r in read_records(out / "results.jsonl")}
    assert runs["1"] == runs["4"]
    assert len({c for (_, m), c in runs["1"].items() if m == "ar"}) > 1


def test_a_compressed_run_is_read_and_resumed(tiny_dir, data, tmp_path, capsys):
    """Finished rows kept as results.jsonl.gz (gzip -9n, as the repository keeps them): read as they are, and
    rerunning the command restores the plain file and decodes nothing again."""
    import gzip

    from pivotspec import api

    out = tmp_path / "run"
    assert main(eval_args(tiny_dir, data, out)) == 0
    plain = out / "results.jsonl"
    rows = read_records(plain)
    (out / "results.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    assert api.read_results(plain) == rows
    assert main(eval_args(tiny_dir, data, out)) == 0
    assert read_records(plain) == rows and not (out / "results.jsonl.gz").exists()


def test_the_gz_name_reads_the_same_file_as_the_plain_name(tmp_path):
    """A user may pass the committed ``labels.jsonl.gz`` itself: the same records, the same content hash."""
    import gzip

    from pivotspec import store

    plain = tmp_path / "l.jsonl"
    plain.write_text('{"a": 1}\n{"a": 2}\n')
    digest = store.content_digest(plain)
    gz = tmp_path / "l.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    assert store.exists(gz) and store.read_records(gz) == [{"a": 1}, {"a": 2}]
    assert store.content_digest(gz) == store.content_digest(plain) == digest
