"""The shipped testbed models, materialised once into the pivotspec cache.

Two pairs: ``testbed`` (task ``arith``, files in ``data/``) and ``testbed-hard`` (task ``arith-hard``,
files in ``data/hard/``), each made of
- a target: SmolLM2-135M-Instruct with the shipped LoRA adapters (``target_lora.*``) merged into its
  float32 weights. The merged directory is keyed by a hash of the adapter files, so a new adapter never
  reuses an old merge;
- a draft: a small reduced-vocabulary Llama (``draft/``) plus SmolLM2's tokenizer files (copied, not
  committed twice), so the loader's tokenizer check sees the very same tokenizer;
- optionally the pivot classifier trained on the pair's labels (``classifier/``).

The two weight files of a pair (``target_lora.safetensors``, ``draft/model.safetensors``) are kept as
``.safetensors.xz`` (``xz -9``, 29% smaller: the tracked tree must leave room in the 64 MiB a device call
carries) and unpacked into the cache when the pair is built; a plain file beside them wins (a freshly
trained one, before it is packed).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from pivotspec.errors import UsageError

DATA = Path(__file__).parent / "data"
HARD = DATA / "hard"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def stored(path: Path) -> Path:
    """Where a shipped file is kept: ``path`` itself, else its ``.xz`` copy (a missing one is a UsageError)."""
    for candidate in (path, path.with_name(path.name + ".xz")):
        if candidate.is_file():
            return candidate
    raise UsageError(f"testbed artifact {path.name} is missing from {path.parent}: reinstall pivotspec")


def weights_bytes(path: Path) -> bytes:
    """The plain bytes of a shipped safetensors file, unpacked from its ``.xz`` copy if that is how it is kept."""
    kept = stored(path)
    return lzma.decompress(kept.read_bytes()) if kept.suffix == ".xz" else kept.read_bytes()


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(stored(f).read_bytes())
    return h.hexdigest()[:12]


def _build_atomically(out: Path, build: Callable[[Path], None]) -> Path:
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        build(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _copy_tokenizer(dst: Path) -> None:
    from pivotspec.decoding.models import smollm2_dir

    src = smollm2_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def target_dir(data: Path = DATA, name: str = "testbed-target") -> Path:
    from pivotspec.decoding.models import cache_dir

    files = [data / "target_lora.safetensors", data / "target_lora.json"]

    def build(tmp: Path) -> None:
        import torch
        from safetensors.torch import load
        from transformers import AutoModelForCausalLM

        from pivotspec.decoding.models import quiet_transformers, smollm2_dir
        from pivotspec.testbed.lora import merge_adapters

        quiet_transformers()
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
        config = json.loads(files[1].read_text())
        merge_adapters(model, load(weights_bytes(files[0])), config["scale"])
        model.save_pretrained(tmp)
        _copy_tokenizer(tmp)

    return _build_atomically(cache_dir() / f"{name}-{_fingerprint(files)}", build)


def draft_dir(data: Path = DATA, name: str = "testbed-draft") -> Path:
    from pivotspec.decoding.models import VOCAB_MAP_FILE, cache_dir

    files = [data / "draft" / "config.json", data / "draft" / "model.safetensors", data / "draft" / VOCAB_MAP_FILE]

    def build(tmp: Path) -> None:
        for f in files:
            (tmp / f.name).write_bytes(weights_bytes(f))
        _copy_tokenizer(tmp)

    return _build_atomically(cache_dir() / f"{name}-{_fingerprint(files)}", build)


def shipped_classifier(data: Path = DATA) -> Path | None:
    """The pivot classifier trained on a testbed pair's labels, if this version ships one."""
    path = data / "classifier"
    return path if (path / "classifier.json").is_file() else None


def register() -> None:
    """Make the testbed models and pairs known to ``pivotspec.models`` (done on ``import pivotspec``)."""
    from pivotspec.decoding.models import RegisteredPair, register_model, register_pair

    register_model("testbed-target", target_dir)
    register_model("testbed-draft", draft_dir)
    register_pair("testbed", RegisteredPair("testbed-target", "testbed-draft", shipped_classifier, "arith"))
    if (HARD / "target_lora.json").is_file():  # the second pair ships once it is trained
        register_model("testbed-hard-target", lambda: target_dir(HARD, "testbed-hard-target"))
        register_model("testbed-hard-draft", lambda: draft_dir(HARD, "testbed-hard-draft"))
        register_pair("testbed-hard", RegisteredPair("testbed-hard-target", "testbed-hard-draft",
                                                     lambda: shipped_classifier(HARD), "arith-hard"))
