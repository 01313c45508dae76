"""The testbed report: target and draft accuracy, per-token cost, lossless SD tau/eta/speedup.

    python benchmarks/testbed.py --n-acc 300 --n-speed 50 --gammas 3,5,8

Writes benchmarks/results/testbed.json and benchmarks/testbed.md. Accuracy is greedy decoding on the first
``--n-acc`` test problems (seed 0): the target with HF ``generate`` batched 25 at a time (left padding; one
problem at a time would take ~35 minutes here), the draft with pivotspec's own loop. The speed rows run ar
and sd (each gamma) interleaved per problem on the first ``--n-speed`` problems, one at a time, and also
give the unbatched ar accuracy on those problems.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pivotspec.decoding.loop import decode
from pivotspec.decoding.models import check_same_tokenizer, eos_ids, load_lm
from pivotspec.evaluation.summary import wilson_ci
from pivotspec.tasks import encode_problem, get_task
from pivotspec.testbed.train_target import batched_greedy


def per_token_ms(lm, prompt: list[int], repeats: int = 30) -> float:
    """Median wall time of one single-token forward with the prompt in the cache."""
    times = []
    for _ in range(repeats):
        lm.reset()
        lm.forward(prompt[:-1], keep_logits=0)
        t = time.perf_counter()
        lm.forward(prompt[-1:], keep_logits=1)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def accuracy(outputs: list[list[int]], tokenizer, task, problems) -> dict:
    correct = sum(task.score(p, tokenizer.decode(o, skip_special_tokens=True)) for p, o in zip(problems, outputs,
                  strict=True))
    lo, hi = wilson_ci(correct, len(problems))
    return {"accuracy": correct / len(problems), "ci95": [lo, hi], "n": len(problems)}


def speed(target, draft, task, problems, prompts, gammas: list[int], max_new: int) -> dict:
    walls = {"ar": [], **{f"sd-g{g}": [] for g in gammas}}
    agg = {m: {"tokens": 0, "fwd": 0, "drafted": 0, "kept": 0, "identical": 0, "correct": 0.0} for m in walls}
    for problem, ids in zip(problems, prompts, strict=True):
        ref = None
        for m in walls:  # interleaved per problem
            gamma = int(m.split("-g")[1]) if m != "ar" else 1
            g = decode("ar" if m == "ar" else "sd", target, draft, ids, gamma=gamma, max_new_tokens=max_new,
                       eos_ids=eos_ids(target))
            ref = g.token_ids if m == "ar" else ref
            s, a = g.stats, agg[m]
            walls[m].append(s["wall_s"])
            a["tokens"] += s["new_tokens"]
            a["fwd"] += s["target_forwards"]
            a["drafted"] += s["drafted"]
            a["kept"] += s["accepted"]
            a["identical"] += g.token_ids == ref
            a["correct"] += task.score(problem, g.text)
    out = {}
    for m, a in agg.items():
        ratios = [ar / w for ar, w in zip(walls["ar"], walls[m], strict=True)]
        out[m] = {"tau": a["tokens"] / a["fwd"], "eta": a["kept"] / a["drafted"] if a["drafted"] else None,
                  "ms_per_token": 1000 * sum(walls[m]) / a["tokens"],
                  "speedup_total": sum(walls["ar"]) / sum(walls[m]),
                  "speedup_median_per_problem": statistics.median(ratios),
                  "identical_to_ar": a["identical"], "accuracy": a["correct"] / len(prompts), "n": len(prompts)}
    return out


def markdown(r: dict, cmd: str) -> str:
    t, d = r["accuracy"]["target"], r["accuracy"]["draft"]
    lines = ["# Testbed report", "", f"Made by `{cmd}`.", "",
             "| model | greedy accuracy | 95% CI | n | ms per token (1-token forward) |", "|---|---|---|---|---|"]
    for name, a, ms in (("testbed-target", t, r["cost_ms"]["target"]), ("testbed-draft", d, r["cost_ms"]["draft"])):
        lo, hi = a["ci95"]
        lines.append(f"| {name} | {a['accuracy']:.3f} | [{lo:.3f}, {hi:.3f}] | {a['n']} | {ms:.2f} |")
    lines += ["", f"Draft cost / target cost: {r['cost_ms']['draft'] / r['cost_ms']['target']:.3f}. "
              f"Teacher-forced agreement of the draft with the target's greedy tokens: {r['agreement']:.3f}.", "",
              f"Lossless SD vs ar on {r['speed']['ar']['n']} test problems (greedy, interleaved per problem):", "",
              "| method | tau | eta | ms/token | speedup (total) | speedup (median per problem) | identical to ar "
              "| accuracy |", "|---|---|---|---|---|---|---|---|"]
    for m, s in r["speed"].items():
        eta = "-" if s["eta"] is None else f"{s['eta']:.3f}"
        lines.append(f"| {m} | {s['tau']:.2f} | {eta} | {s['ms_per_token']:.1f} | {s['speedup_total']:.2f}x | "
                     f"{s['speedup_median_per_problem']:.2f}x | {s['identical_to_ar']}/{s['n']} | "
                     f"{s['accuracy']:.3f} |")
    return "\n".join(lines) + "\n"


def agreement(draft, prompts, outputs) -> float:
    """Share of the target's greedy tokens that the draft's argmax reproduces under teacher forcing."""
    hits = total = 0
    for ids, out in zip(prompts, outputs, strict=True):
        draft.reset()
        logits, _ = draft.forward(ids + out[:-1], keep_logits=len(out))
        hits += int((logits.argmax(-1) == torch.tensor(out)).sum())
        total += len(out)
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-acc", type=int, default=300)
    ap.add_argument("--n-speed", type=int, default=50)
    ap.add_argument("--gammas", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5, 8])
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/testbed.json"))
    ap.add_argument("--md", type=Path, default=Path("benchmarks/testbed.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = load_lm("testbed-target"), load_lm("testbed-draft")
    check_same_tokenizer(target, draft)
    task = get_task("arith")
    problems = task.problems("test", max(args.n_acc, args.n_speed), seed=0)
    prompts = [encode_problem(target.tokenizer, p) for p in problems]
    acc_problems = problems[: args.n_acc]
    target_out = batched_greedy(target.model, target.tokenizer, acc_problems, max_new_tokens=args.max_new_tokens)
    draft_out = [decode("draft", None, draft, ids, max_new_tokens=args.max_new_tokens, eos_ids=eos_ids(draft)).token_ids
                 for ids in prompts[: args.n_acc]]
    acc_t = accuracy(target_out, target.tokenizer, task, acc_problems)
    acc_d = accuracy(draft_out, target.tokenizer, task, acc_problems)
    result = {
        "accuracy": {"target": acc_t, "draft": acc_d},
        "cost_ms": {"target": per_token_ms(target, prompts[0]), "draft": per_token_ms(draft, prompts[0])},
        "agreement": agreement(draft, prompts[: args.n_acc], target_out),
        "speed": speed(target, draft, task, problems[: args.n_speed], prompts[: args.n_speed], args.gammas,
                       args.max_new_tokens),
        "config": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    cmd = (f"python benchmarks/testbed.py --n-acc {args.n_acc} --n-speed {args.n_speed} "
           f"--gammas {','.join(map(str, args.gammas))}")
    args.md.write_text(markdown(result, cmd))
    print(markdown(result, cmd))


if __name__ == "__main__":
    main()
