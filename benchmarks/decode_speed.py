"""ar vs lossless sd: ms/token, tau, eta, speedup, and the loop's own overhead.

    python benchmarks/decode_speed.py --target smollm2-135m-instruct --draft smollm2-135m-instruct \
        --draft-dtype bfloat16 --n 8 --repeats 3 --gammas 3,5

Runs are interleaved (each repeat, each prompt: every method in turn, order alternating between repeats)
and the reported numbers are medians over repeats. Overhead is the loop's wall time outside model forwards
and outside the prefill, per target forward, as a share of one single-token target forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from pivotspec import api


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    pair = api.load_pair(args.target, args.draft, dtype=args.dtype, draft_dtype=args.draft_dtype, device=args.device)
    prompts = api.get_task("arith").problems("test", args.n, seed=args.seed)
    methods = ["ar"] + [f"sd-g{g}" for g in args.gammas]
    per_repeat = {m: [] for m in methods}  # list of per-repeat aggregates
    outputs: dict[str, list[list[int]]] = {m: [] for m in methods}
    for m in ("ar", "sd"):  # warm-up: first calls pay one-off allocation costs
        api.generate(pair, prompts[0].prompt, messages=prompts[0].messages or None, method=m, max_new_tokens=8)
    for r in range(args.repeats):
        agg = {m: {"wall": 0.0, "tokens": 0, "fwd": 0, "drafted": 0, "kept": 0, "overhead": 0.0, "fwd_s": 0.0}
               for m in methods}
        order = methods if r % 2 == 0 else methods[::-1]
        for p in prompts:
            for m in order:
                gamma = int(m.split("-g")[1]) if m != "ar" else 1
                g = api.generate(pair, p.prompt, messages=p.messages or None, method="ar" if m == "ar" else "sd",
                                 gamma=gamma, max_new_tokens=args.max_new_tokens)
                s, a = g.stats, agg[m]
                a["wall"] += s["wall_s"]
                a["tokens"] += s["new_tokens"]
                a["fwd"] += s["target_forwards"]
                a["drafted"] += s["drafted"]
                a["kept"] += s["accepted"] + s["override"]
                a["overhead"] += s["overhead_s"]
                a["fwd_s"] += s["forward_s"]
                if r == 0:
                    outputs[m].append(g.token_ids)
        for m in methods:
            per_repeat[m].append(agg[m])
    one_forward = statistics.median(a["fwd_s"] / a["fwd"] for a in per_repeat["ar"])  # single-token target forward
    rows = {}
    for m in methods:
        reps = per_repeat[m]
        rows[m] = {
            "ms_per_token": statistics.median(1000 * a["wall"] / a["tokens"] for a in reps),
            "tau": reps[0]["tokens"] / reps[0]["fwd"],
            "eta": reps[0]["kept"] / reps[0]["drafted"] if reps[0]["drafted"] else None,
            "speedup": statistics.median(ar["wall"] / a["wall"] for ar, a in zip(per_repeat["ar"], reps, strict=True)),
            "overhead_pct_of_target_forward": statistics.median(
                100 * a["overhead"] / a["fwd"] / one_forward for a in reps),
            "identical_to_ar": sum(o == ref for o, ref in zip(outputs[m], outputs["ar"], strict=True)),
        }
    return {"config": {k: v for k, v in vars(args).items() if k != "out"}, "n_prompts": len(prompts),
            "single_token_target_forward_ms": 1000 * one_forward, "methods": rows}


def table(result: dict) -> str:
    lines = ["| method | ms/token | tau | eta | speedup vs ar | loop overhead (% of 1 target fwd) | identical to ar |",
             "|---|---|---|---|---|---|---|"]
    n = result["n_prompts"]
    for m, r in result["methods"].items():
        eta = "-" if r["eta"] is None else f"{r['eta']:.3f}"
        lines.append(f"| {m} | {r['ms_per_token']:.1f} | {r['tau']:.2f} | {eta} | {r['speedup']:.2f}x | "
                     f"{r['overhead_pct_of_target_forward']:.1f}% | {r['identical_to_ar']}/{n} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=8, help="arith test problems used as prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--gammas", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_speed.json"))
    args = ap.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"single-token target forward: {result['single_token_target_forward_ms']:.1f} ms; wrote {args.out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
