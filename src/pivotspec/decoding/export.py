"""A reduced-output-vocabulary draft saved as an ordinary full-vocabulary Hugging Face checkpoint.

Engines that load checkpoints themselves (transformers' assisted generation, vLLM's ``draft_model``) know
nothing of ``pivotspec_vocab_map.json``. The export gives every token id the embedding row it reads in
pivotspec (the shared unknown-id row for ids the draft lacks) and an output row: the trained row for the ids
it knows, zeros for the others. Those others therefore get logit 0 instead of pivotspec's -inf: greedy
decoding is unchanged wherever the best known logit is above 0 (checked by the parity tests), and under
sampling they take a little probability mass, so a sampled comparison between engines uses this export on
both sides.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from pivotspec.decoding.models import VOCAB_MAP_FILE, cache_dir, file_digest, resolve
from pivotspec.errors import UsageError


def full_vocab_checkpoint(spec: str) -> Path:
    """The directory of ``spec`` (a registered name or HF directory) with a full output vocabulary: the
    model's own directory when it has one already, else an export made once and cached by content."""
    source, _ = resolve(spec)
    source = Path(source)
    map_file = source / VOCAB_MAP_FILE
    if not map_file.is_file():
        return source
    weights = sorted(source.glob("*.safetensors"))
    if not weights:
        raise UsageError(f"{source} has no safetensors weights to export: give a Hugging Face directory")
    key = "-".join(file_digest(f)[:8] for f in [map_file, source / "config.json", *weights])
    out = cache_dir() / "full-vocab" / f"{source.name}-{key}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        _export(source, json.loads(map_file.read_text()), tmp)
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").is_file():  # another process may have finished the same export first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _export(source: Path, vocab: dict, out: Path) -> None:
    """Written tensor by tensor (not through transformers' resize, which would keep a tied output layer tied
    to the new embedding rows)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    config = json.loads((source / "config.json").read_text())
    emb_key = next((k for k in tensors if k.endswith("embed_tokens.weight")), None)
    if emb_key is None:
        raise UsageError(f"{source} has no embed_tokens weight: only Llama-style drafts can be exported")
    emb = tensors[emb_key]
    head = tensors.get("lm_head.weight", emb)  # tied: the output rows are the embedding rows
    known = torch.tensor(vocab["token_ids"], dtype=torch.long)
    n = int(vocab["full_vocab_size"])
    input_rows = torch.full((n,), len(known), dtype=torch.long)  # every other id reads the shared unknown row
    input_rows[known] = torch.arange(len(known))
    new_head = torch.zeros(n, head.shape[1], dtype=head.dtype)
    new_head[known] = head[: len(known)]
    tensors[emb_key] = emb[input_rows].contiguous()
    tensors["lm_head.weight"] = new_head
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.update(vocab_size=n, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(out)
