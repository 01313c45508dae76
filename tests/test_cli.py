"""The CLI: JSON output and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pivotspec.cli import main
from tests.conftest import make_tiny_model, make_tokenizer


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_has_documented_keys(tiny_dir, capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3"}\n{"prompt": "w4 w5"}\n')
    t, d = str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"])
    code, out, _ = run_cli(capsys, "generate", "--target", t, "--draft", d, "--method", "sd", "--prompts-file",
                           str(prompts), "--max-new-tokens", "9", "--gamma", "3", "--json")
    assert code == 0
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == 2
    for obj in lines:
        assert set(obj) == {"text", "token_ids", "stats", "trace"}
        for key in ("new_tokens", "target_forwards", "draft_forwards", "drafted", "accepted", "override",
                    "tau", "eta", "wall_s"):
            assert key in obj["stats"]
        assert len(obj["trace"]) == len(obj["token_ids"]) == obj["stats"]["new_tokens"] <= 9
        assert {e["source"] for e in obj["trace"]} <= {"accepted", "override", "corrected", "bonus", "target"}


def test_sampled_prompts_file_rows_draw_their_own_numbers(tiny_dir, capsys, tmp_path):
    """Four copies of one prompt at temperature 2 are four samples (one shared seed made them one)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2"}\n' * 4)
    code, out, _ = run_cli(capsys, "generate", "--target", str(tiny_dir["llama_target"]), "--prompts-file",
                           str(prompts), "--max-new-tokens", "16", "--temperature", "2.0", "--json")
    assert code == 0 and len({json.loads(x)["text"] for x in out.splitlines()}) > 1


def test_console_script_runs(tiny_dir):
    out = subprocess.run([sys.executable, "-m", "pivotspec.cli", "generate", "--target", str(tiny_dir["qwen3_target"]),
                          "--prompt", "w1 w2", "--max-new-tokens", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "[ar] 4 tokens" in out.stderr


@pytest.fixture(scope="module")
def other_tokenizer_model(tmp_path_factory):
    words = ["<unk>", "</s>"] + [f"x{i}" for i in range(30)]
    return make_tiny_model(tmp_path_factory.mktemp("other") / "m", tokenizer=make_tokenizer(words))


def error_cases(tiny_dir, other, tmp_path):
    t, d = str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"])
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "w1"}\nthis is not json\n')
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    bad_messages = tmp_path / "messages.jsonl"
    bad_messages.write_text('{"messages": [{"role": "user"}]}\n')
    empty_gguf = tmp_path / "empty.gguf"
    empty_gguf.write_bytes(b"")
    garbage_gguf = tmp_path / "garbage.gguf"
    garbage_gguf.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    base = ["generate", "--target", t, "--prompt", "w1"]
    return {
        "missing model path": (["generate", "--target", str(tmp_path / "nope"), "--prompt", "x"], "not found"),
        "missing gguf": (["generate", "--target", str(tmp_path / "m.gguf"), "--prompt", "x"], "does not exist"),
        "different tokenizer": ([*base, "--draft", str(other), "--method", "sd"], "different tokenizer"),
        "gamma < 1": ([*base, "--draft", d, "--gamma", "0"], "--gamma must be >= 1"),
        "temperature < 0": ([*base, "--temperature", "-0.5"], "temperature must be >= 0"),
        "top-p 0": ([*base, "--top-p", "0"], "top-p must be in (0, 1]"),
        "top-p > 1": ([*base, "--top-p", "1.5"], "top-p must be in (0, 1]"),
        "pad without classifier": ([*base, "--draft", d, "--method", "pad"], "needs a pivot classifier"),
        "sd without draft": ([*base, "--method", "sd"], "needs a draft model"),
        "prompts not jsonl": (["generate", "--target", t, "--prompts-file", str(bad_jsonl)], "bad.jsonl:2"),
        "prompts file missing": (["generate", "--target", t, "--prompts-file", str(tmp_path / "x.jsonl")],
                                 "does not exist"),
        "unknown flag": ([*base, "--gamm", "3"], "unrecognized arguments"),
        "sigma out of range": ([*base, "--draft", d, "--method", "pad", "--classifier", "const:0.1", "--sigma", "2"],
                               "sigma must be in [0, 1]"),
        "negative budget": ([*base, "--draft", d, "--method", "pad", "--classifier", "const:0.1", "--budget", "-1"],
                            "budget must be >= 0"),
        "budget with sigma out of range": ([*base, "--draft", d, "--method", "pad", "--classifier", "const:0.1",
                                            "--budget", "1", "--sigma", "2"], "sigma must be in [0, 1]"),
        "budgets not numbers": (["eval", "--target", t, "--draft", d, "--methods", "pad", "--classifier", "const:0.1",
                                 "--budgets", "x"], "--budgets must be comma-separated numbers"),
        # found by the hardening probe (issue 15)
        "empty stop string": ([*base, "--stop", ""], "--stop needs a non-empty string"),
        "temperature nan": ([*base, "--temperature", "nan"], "must be finite"),
        "temperature inf": ([*base, "--temperature", "inf"], "must be finite"),
        "empty prompt": (["generate", "--target", t, "--prompt", ""], "the prompt is empty"),
        "lone surrogate": (["generate", "--target", t, "--prompt", "w1 \ud800"], "not valid Unicode"),
        "undecodable bytes": (["generate", "--target", t, "--prompt", "w1 \udcff"], "not valid Unicode"),
        "prompt beyond positions": ([*base, "--max-new-tokens", "600"], "exceeds the 512 positions"),
        "prompts not utf-8": (["generate", "--target", t, "--prompts-file", str(latin1)], "not UTF-8"),
        "prompts file is a directory": (["generate", "--target", t, "--prompts-file", str(tmp_path)], "is a directory"),
        "messages wrong shape": (["generate", "--target", t, "--prompts-file", str(bad_messages)],
                                 "messages must be a non-empty list"),
        "threads -1": ([*base, "--threads", "-1"], "--threads must be >= 1"),
        "sigmas not numbers": (["eval", "--target", t, "--draft", d, "--methods", "pad", "--classifier", "const:0.1",
                                "--sigmas", "0.3,abc"], "--sigmas must be comma-separated numbers"),
        "eval out is a file": (["eval", "--target", t, "--out", str(bad_jsonl)], "is a file"),
        "eval out not creatable": (["eval", "--target", t, "--out", "/proc/pivotspec-out"], "cannot create"),
        "bad chat template kwargs": ([*base, "--chat-template-kwargs", "[1]"], "must be a JSON object"),
        "empty gguf": (["generate", "--target", str(empty_gguf), "--prompt", "x"], "not a readable GGUF"),
        "garbage gguf": (["generate", "--target", str(garbage_gguf), "--prompt", "x"], "not a readable GGUF"),
        "labels alone": (["labels"], "stats"),
        "unknown device": ([*base, "--device", "tpu7"], "device"),
        **({} if torch.cuda.is_available() else {"no cuda here": ([*base, "--device", "cuda"], "not available")}),
    }


def test_bad_input_gives_one_line_and_exit_2(tiny_dir, other_tokenizer_model, tmp_path, capsys):
    for name, (argv, expected) in error_cases(tiny_dir, other_tokenizer_model, tmp_path).items():
        code, out, err = run_cli(capsys, *argv)
        assert code == 2, name
        assert len(err.strip().splitlines()) == 1, (name, err)
        assert expected in err, (name, err)
        assert "Traceback" not in err


def test_help_shows_defaults_splits_and_version(capsys):
    for argv, expected in ((["generate", "--help"], ["(default: 128)", "(default: 5)"]),
                           (["eval", "--help"], ["(default: 200)", "train, validation or test", "humaneval"]),
                           (["demo", "--help"], ["earlier demo", "--overwrite"]),
                           (["label", "--help"], ["(default: 20)", "train, validation or test"])):
        with pytest.raises(SystemExit):
            main(argv)
        out = " ".join(capsys.readouterr().out.split())
        for text in expected:
            assert text in out, (argv, text)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("pivotspec ")


def test_task_defaults_to_the_pairs_task():
    from pivotspec.cli import build_parser
    from pivotspec.cli.common import task_name

    assert task_name(build_parser().parse_args(["eval", "--pair", "testbed-hard"])) == "arith-hard"
    assert task_name(build_parser().parse_args(["label", "--pair", "testbed", "--out", "x"])) == "arith"
    assert task_name(build_parser().parse_args(["eval", "--pair", "testbed-hard", "--task", "arith"])) == "arith"
    assert task_name(build_parser().parse_args(["eval", "--target", "t"])) == "arith"
