"""The architectures people use, as tiny random checkpoints loaded by path like a user's: greedy SD and PAD at
sigma 0 equal target-only decoding, rollback works past a sliding window, the batched loop decodes what batch 1
decodes (rows past the window among them), and the hidden state can be read at a negative (HF-style) layer index."""

from __future__ import annotations

import pytest
import torch

from pivotspec.decoding.acceptance import PAD, constant_classifier
from pivotspec.decoding.loop import decode
from tests.conftest import make_tokenizer

WINDOW = 8  # sliding window smaller than the test's sequences


def config_for(arch: str, layers: int, vocab: int):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1,
                  bos_token_id=None, pad_token_id=1, tie_word_embeddings=False, initializer_range=0.5)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=8, **common)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=WINDOW, **common)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8,
                                   layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                   + ["sliding_attention"] * (layers % 2), **common)
    if arch == "phi3":
        return tf.Phi3Config(**common)
    raise ValueError(arch)


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from pivotspec.decoding.models import load_lm

    root = tmp_path_factory.mktemp(request.param)
    tok = make_tokenizer()
    paths = []
    for name, layers, seed in (("target", 3, 1), ("draft", 1, 2)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config_for(request.param, layers, len(tok)))
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths.append(root / name)
    return request.param, load_lm(str(paths[0])), load_lm(str(paths[1]))


def test_sd_and_pad_sigma0_equal_target_only(arch_pair):
    _, target, draft = arch_pair
    pad = PAD(constant_classifier(0.0), sigma=0.0, p_floor=0.0)
    for prompt in ([3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]):  # the second starts past the window
        ar = decode("ar", target, None, prompt, max_new_tokens=24, eos_ids=set())
        for method, policy in (("sd", None), ("pad", pad)):
            for gamma in (2, 5):
                out = decode(method, target, draft, prompt, policy, gamma=gamma, max_new_tokens=24, eos_ids=set())
                assert out.token_ids == ar.token_ids, (method, gamma)


def test_rollback_past_the_sliding_window(arch_pair):
    _, target, _ = arch_pair
    a, b = list(range(3, 3 + 2 * WINDOW)), [20, 21, 22]
    target.reset()
    target.forward(a, keep_logits=0)
    target.forward([25, 26, 27, 28], keep_logits=1)  # rejected drafts, beyond the window
    target.rollback(4)
    after, _ = target.forward(b, keep_logits=len(b))
    target.reset()
    target.forward(a, keep_logits=0)
    clean, _ = target.forward(b, keep_logits=len(b))
    torch.testing.assert_close(after, clean, atol=1e-4, rtol=1e-4)
    # and both equal transformers' own one-pass forward, which applies the sliding window itself
    reference = target.model(input_ids=torch.tensor([a + b])).logits[0, -len(b):].float()
    torch.testing.assert_close(after, reference, atol=1e-4, rtol=1e-4)


def test_hidden_state_at_a_negative_layer(arch_pair):
    _, target, _ = arch_pair
    ids = [3, 4, 5, 6, 7]
    target.reset()
    _, hidden = target.forward(ids, keep_logits=2, hidden_layer=-2)
    out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(hidden, out.hidden_states[-2][0, -2:], atol=1e-4, rtol=1e-4)


def test_batched_rows_equal_batch1(arch_pair):
    from pivotspec.decoding.batch import Request, decode_many

    _, target, draft = arch_pair
    pad = PAD(constant_classifier(0.0), sigma=0.0, p_floor=0.0)
    rows = [[3, 4, 5], list(range(7, 18)), [9], list(range(5, 22))]  # two start past the window
    for method, policy in (("ar", None), ("sd", None), ("pad", pad)):
        requests = [Request(p, policy=policy, gamma=3, max_new_tokens=24 - 4 * i, speculate=method != "ar")
                    for i, p in enumerate(rows)]
        outs = decode_many(target, requests, draft=draft, max_batch=3)  # the fourth row joins late
        for r, out in zip(requests, outs, strict=True):
            ref = decode(method, target, draft, r.prompt_ids, policy, gamma=3, max_new_tokens=r.max_new_tokens,
                         eos_ids=set())
            assert out.token_ids == ref.token_ids, (method, r.prompt_ids)
