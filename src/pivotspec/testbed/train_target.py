"""Fine-tune SmolLM2-135M-Instruct on the ``arith`` train split with LoRA (the testbed target).

    python -m pivotspec.testbed.train_target --out runs/target --steps 600 --seed 0

Choices, each for the CPU budget (about 90 minutes on 2 cores):
- LoRA adapters on every linear layer of the top blocks; the base stays frozen, so blocks below the first
  adapter run without autograd and store no activations, and the exported adapters are a few MB.
- Loss on the answer tokens only, and the LM head is applied only at those positions (it is a fifth of
  the forward cost with a 49k vocabulary).
- Batches are drawn from length-sorted pools, so padding stays a few percent without packing
  unrelated problems into one attention window.
- Validation accuracy (greedy, batched) is measured every ``--eval-every`` steps and logged as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pivotspec.decoding.models import quiet_transformers, smollm2_dir
from pivotspec.tasks import encode_problem, get_task
from pivotspec.testbed import lora


def warmup_cosine(step: int, steps: int, peak: float, warmup: int, floor: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay from ``peak`` to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


TASKS = ("arith", "arith-hard")
STYLES = ("target", "draft")


def solution_for(task: str, problem, style: str) -> str:
    """The worked solution a model is trained on: ``arith`` has one style; ``arith-hard`` renders the same
    skeleton in the target's or the draft's wording distribution."""
    if task == "arith-hard":
        from pivotspec.tasks.arith_hard import styled_solution

        return styled_solution(problem, style)
    if style != "target":
        raise SystemExit(f"task {task} has only the 'target' style; use --task arith-hard for --style {style}")
    return problem.meta["solution"]


def build_examples(tokenizer, n: int, seed: int, task: str = "arith",
                   style: str = "target") -> list[tuple[list[int], list[int]]]:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for p in get_task(task).problems("train", n, seed):
        answer = tokenizer(solution_for(task, p, style), add_special_tokens=False).input_ids + [eos]
        out.append((encode_problem(tokenizer, p), answer))
    return out


def batches(examples, batch_size: int, rng: random.Random, pool: int = 50):
    """Yield padded (input_ids, attention_mask, labels) batches, length-sorted within pools of batches."""
    order = list(range(len(examples)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order), batch_size * pool):
            chunk = sorted(order[start:start + batch_size * pool], key=lambda i: sum(map(len, examples[i])))
            groups = [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
            rng.shuffle(groups)
            for g in groups:
                yield collate([examples[i] for i in g])


def collate(items, pad_id: int = 2):
    width = max(len(p) + len(a) for p, a in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    for row, (p, a) in enumerate(items):
        seq = p + a
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
        labels[row, len(p):len(seq)] = torch.tensor(a)
    return ids, mask, labels


def answer_loss(model, ids, mask, labels) -> torch.Tensor:
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])


@torch.no_grad()
def batched_greedy(model, tokenizer, problems, batch_size: int = 25, max_new_tokens: int = 160) -> list[list[int]]:
    """Greedy completions (token ids up to and including EOS) with HF generate, batched with left padding."""
    was_training = model.training
    model.eval()
    outputs = []
    for start in range(0, len(problems), batch_size):
        prompts = [encode_problem(tokenizer, p) for p in problems[start:start + batch_size]]
        width = max(map(len, prompts))
        ids = torch.tensor([[2] * (width - len(q)) + q for q in prompts])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=2, eos_token_id=2)
        for row in out[:, width:].tolist():
            outputs.append(row[: row.index(2) + 1] if 2 in row else row)
    model.train(was_training)
    return outputs


def greedy_accuracy(model, tokenizer, split: str, n: int, task_name: str = "arith") -> float:
    task = get_task(task_name)
    problems = task.problems(split, n, seed=0)
    outputs = batched_greedy(model, tokenizer, problems)
    return sum(task.score(p, tokenizer.decode(o, skip_special_tokens=True)) for p, o in zip(problems, outputs,
               strict=True)) / n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--top-layers", type=int, default=30)
    ap.add_argument("--n-train", type=int, default=20000)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--eval-n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", choices=TASKS, default="arith")
    ap.add_argument("--style", choices=STYLES, default="target", help="wording of the solutions (arith-hard)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init-from", type=Path, help="continue from saved adapters (target_lora.safetensors)")
    ap.add_argument("--data-offset", type=int, default=0,
                    help="skip this many train problems (continue on problems not seen in the first run)")
    ap.add_argument("--probe", action="store_true", help="time 3 steps and exit")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    base = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    names = lora.adapter_names(model.config.num_hidden_layers, args.top_layers)
    adapters = lora.add_adapters(model, names, args.rank, args.alpha)
    if args.init_from:
        from safetensors.torch import load

        from pivotspec.testbed.artifacts import weights_bytes

        saved = load(weights_bytes(args.init_from))  # the shipped adapters are kept as .xz
        for name, mod in zip(names, adapters, strict=True):
            mod.lora_a.data.copy_(saved[f"{name}.lora_a"].float())
            mod.lora_b.data.copy_(saved[f"{name}.lora_b"].float())
    params = [p for a in adapters for p in (a.lora_a, a.lora_b)]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.steps // 20)

    examples = build_examples(tokenizer, args.n_train + args.data_offset, args.seed, args.task, args.style)
    examples = examples[args.data_offset:]
    stream = batches(examples, args.batch_size, random.Random(args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "train_log.jsonl").open("a")
    config = {"base": "smollm2-135m-instruct", "task": args.task, "style": args.style, "rank": args.rank,
              "alpha": args.alpha,
              "scale": args.alpha / args.rank, "top_layers": args.top_layers, "modules": list(lora.MODULES),
              "args": {k: str(v) for k, v in vars(args).items()}}
    model.train()
    t0, tokens = time.time(), 0
    for step in range(args.steps):
        ids, mask, labels = next(stream)
        for g in opt.param_groups:
            g["lr"] = warmup_cosine(step, args.steps, args.lr, warmup, floor=0.1)
        loss = answer_loss(model, ids, mask, labels)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += int(mask.sum())
        elapsed = time.time() - t0
        rec = {"step": step + 1, "loss": round(loss.item(), 4), "elapsed_s": round(elapsed, 1),
               "tokens_per_s": round(tokens / elapsed, 1), "pad_frac": round(1 - mask.float().mean().item(), 3)}
        if args.probe and step == 2:
            print(json.dumps(rec))
            return
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            rec["val_acc"] = greedy_accuracy(model, tokenizer, "validation", args.eval_n, args.task)
            save_file(lora.export_adapters(model, names), str(args.out / "target_lora.safetensors"))
            # every evaluated checkpoint is kept, so the one with the wanted accuracy can be shipped
            save_file(lora.export_adapters(model, names), str(args.out / f"target_lora.step{step + 1}.safetensors"))
            (args.out / "target_lora.json").write_text(json.dumps(config, indent=1))
        if (step + 1) % 10 == 0 or "val_acc" in rec:
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
