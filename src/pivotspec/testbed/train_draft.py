"""Train the testbed draft: a 4-block Llama with SmolLM2's tokenizer and a reduced vocabulary.

    python -m pivotspec.testbed.train_draft --out runs/draft --steps 3000 --seed 0

The draft reads and writes only the token ids that occur in the ``arith`` train split (a few hundred of
SmolLM2's 49,152): its embedding rows are those ids plus one row for any other id, and its output rows
map back to the same ids (``pivotspec_vocab_map.json``), so it proposes real SmolLM2 tokens and SD stays
exact. The full-vocabulary output layer would otherwise dominate its cost.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from pivotspec.decoding.models import VOCAB_MAP_FILE, quiet_transformers, smollm2_dir
from pivotspec.tasks import encode_problem, get_task
from pivotspec.testbed.train_target import STYLES, TASKS, batches, build_examples, warmup_cosine


def task_vocabulary(examples) -> list[int]:
    return sorted({t for p, a in examples for t in p + a})


def remap(examples, token_ids: list[int]):
    row = {t: i for i, t in enumerate(token_ids)}
    unk = len(token_ids)
    return [([row.get(t, unk) for t in p], [row.get(t, unk) for t in a]) for p, a in examples]


def make_config(n_rows: int, layers: int, hidden: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=n_rows, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=1024,
                       tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       rope_theta=10000.0)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, token_ids: list[int], n: int, max_new_tokens: int = 160,
                    task_name: str = "arith") -> float:
    """Greedy accuracy on validation problems, decoding in the draft's own row space."""
    from pivotspec.decoding.loop import generate
    from pivotspec.decoding.models import reduced_vocab_lm

    task = get_task(task_name)
    lm = reduced_vocab_lm("draft", model, tokenizer, token_ids, len(tokenizer))
    model.eval()
    correct = 0.0
    for p in task.problems("validation", n, seed=0):
        gen = generate(lm, encode_problem(tokenizer, p), max_new_tokens=max_new_tokens, eos_ids={2})
        correct += task.score(p, gen.text)
    model.train()
    return correct / n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=320)
    ap.add_argument("--n-train", type=int, default=60000)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-n", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", choices=TASKS, default="arith")
    ap.add_argument("--style", choices=STYLES, default="target",
                    help="wording of the solutions (arith-hard: 'draft' gives the draft its own style)")
    ap.add_argument("--init-from", type=Path, help="continue from a saved draft directory (same task and vocabulary)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    from pivotspec.testbed.train_target import answer_loss

    quiet_transformers()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    examples = build_examples(tokenizer, args.n_train, args.seed, args.task, args.style)
    token_ids = task_vocabulary(examples)
    rows = remap(examples, token_ids)
    model = LlamaForCausalLM(make_config(len(token_ids) + 1, args.layers, args.hidden))
    if args.init_from:
        from safetensors.torch import load

        from pivotspec.testbed.artifacts import weights_bytes

        saved = json.loads((args.init_from / VOCAB_MAP_FILE).read_text())["token_ids"]
        if saved != token_ids:
            raise SystemExit(f"{args.init_from} was trained on another vocabulary: use the same --task and --n-train")
        state = {k: v.float() for k, v in load(weights_bytes(args.init_from / "model.safetensors")).items()}
        result = model.load_state_dict(state, strict=False)  # lm_head.weight is tied to the embedding, not saved
        if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
            raise SystemExit(f"{args.init_from} does not match --layers/--hidden: {result}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 30)

    pad_row = len(token_ids)
    stream = batches(rows, args.batch_size, random.Random(args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "train_log.jsonl").open("a")
    t0 = time.time()
    model.train()
    for step in range(args.steps):
        ids, mask, labels = next(stream)
        ids = ids.masked_fill(mask == 0, pad_row)
        for g in opt.param_groups:
            g["lr"] = warmup_cosine(step, args.steps, args.lr, warmup, floor=0.05)
        loss = answer_loss(model, ids, mask, labels)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rec = {"step": step + 1, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - t0, 1)}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            rec["val_acc"] = greedy_accuracy(model, tokenizer, token_ids, args.eval_n, task_name=args.task)
            model.config.save_pretrained(args.out)
            state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
                     if k != "lm_head.weight"}  # tied to the embedding
            save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
            (args.out / VOCAB_MAP_FILE).write_text(json.dumps(
                {"token_ids": token_ids, "full_vocab_size": len(tokenizer), "unk_row": pad_row}))
        if (step + 1) % 50 == 0 or "val_acc" in rec:
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
