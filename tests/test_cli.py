"""The CLI: JSON output and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
        for key in ("new_tokens", "target_forwards", "draft_forwards", "drafted", "accepted", "overridden",
                    "tau", "eta", "wall_s"):
            assert key in obj["stats"]
        assert len(obj["trace"]) == len(obj["token_ids"]) == obj["stats"]["new_tokens"] <= 9
        assert {e["source"] for e in obj["trace"]} <= {"accepted", "override", "corrected", "bonus", "target"}


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
    }


def test_bad_input_gives_one_line_and_exit_2(tiny_dir, other_tokenizer_model, tmp_path, capsys):
    for name, (argv, expected) in error_cases(tiny_dir, other_tokenizer_model, tmp_path).items():
        code, out, err = run_cli(capsys, *argv)
        assert code == 2, name
        assert len(err.strip().splitlines()) == 1, (name, err)
        assert expected in err, (name, err)
        assert "Traceback" not in err
