"""The Python API: the README's example runs as written, and chat-template variables reach the template."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pivotspec.tasks import encode_prompt
from tests.conftest import make_tokenizer

README = Path(__file__).parent.parent / "README.md"


@pytest.mark.slow  # loads the testbed pair
def test_readme_python_example_runs(capsys):
    """The README's example, run as written; its results are checked, not its printed words."""
    section = README.read_text().split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    out, summary, pair = scope["out"], scope["summary"], scope["pair"]
    assert out.token_ids and out.text == pair.target.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.stats["tau"] >= 1 and out.stats["drafted"] > 0 and len(out.trace) == len(out.token_ids)
    assert list(summary)[:2] == ["ar", "sd"] and summary["sd"]["accuracy"] == summary["ar"]["accuracy"]
    assert len(summary) == 3 and list(summary)[2].startswith("pad@") and all(s["n"] == 2 for s in summary.values())
    assert str(out.stats["tau"]) in capsys.readouterr().out


def test_chat_template_kwargs_reach_the_template():
    tok = make_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}w9{% else %}w8{% endif %}")
    plain = encode_prompt(tok, "w1 w2", chat=True)
    off = encode_prompt(tok, "w1 w2", chat=True, chat_template_kwargs={"enable_thinking": False})
    assert tok.convert_ids_to_tokens(plain[-1]) == "w8" and tok.convert_ids_to_tokens(off[-1]) == "w9"
    assert plain[:-1] == off[:-1]


def test_api_generate_equals_the_cli(tiny_dir, capsys):
    import json

    import pivotspec
    from pivotspec.cli import main

    t, d = str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"])
    pair = pivotspec.load_pair(t, d)
    gen = pivotspec.generate(pair, "w1 w2 w3", method="sd", gamma=3, max_new_tokens=9, chat=False)
    assert main(["generate", "--target", t, "--draft", d, "--method", "sd", "--gamma", "3", "--max-new-tokens", "9",
                 "--prompt", "w1 w2 w3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == gen.token_ids
    ar = pivotspec.generate(pair, "w1 w2 w3", method="ar", max_new_tokens=9, chat=False)
    assert ar.token_ids == gen.token_ids and gen.stats["drafted"] > 0  # lossless SD: the target's own output
