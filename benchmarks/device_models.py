"""SmolLM2-shaped random weights for a machine without SmolLM2 (the lent GPU: no network, 64 MiB carried per
call, SmolLM2's GGUF is 98 MB). `device_check.sh prepare` carries SmolLM2's config and tokenizer (no
weights) in `.device/smollm2/`; this script builds a checkpoint of that shape with random weights where
pivotspec looks for its SmolLM2 conversion, so `smollm2-135m-instruct` and the testbed pairs (SmolLM2 plus
their LoRA adapters) load. Random weights decode at the same speed as the real ones; what they decode, and so
SD's and PAD's acceptance, means nothing: speed only.

    python benchmarks/device_models.py [--source .device/smollm2]
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
from pathlib import Path

FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=Path(".device/smollm2"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cache = Path(os.environ.get("PIVOTSPEC_CACHE", Path.home() / ".cache" / "pivotspec"))
    out = cache / "smollm2-135m-instruct"
    if (out / "config.json").is_file():
        print(f"{out} exists: kept")
        return
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in FILES:
        if (args.source / name).is_file():
            shutil.copy(args.source / name, tmp / name)
    with gzip.open(args.source / "tokenizer.json.gz", "rb") as src, open(tmp / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=torch.float32)
    model.save_pretrained(tmp)
    tmp.replace(out)
    print(f"{out}: SmolLM2-shaped random weights ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters)")


if __name__ == "__main__":
    main()
