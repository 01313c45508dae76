"""pivotspec `sd` against transformers' own assisted generation on the same pair: same tokens, and speed.

    python benchmarks/hf_parity.py --target testbed-target --draft testbed-draft-full --draft-dtype float32
    python benchmarks/hf_parity.py --target smollm2-135m-instruct --draft smollm2-135m-instruct --draft-dtype bfloat16
    python benchmarks/hf_parity.py --target testbed-draft-full --draft testbed-draft-full --draft-dtype float32 \\
        --out benchmarks/results/hf_parity-cheap-forwards.json  # a pair whose forwards are cheap

``testbed-draft-full`` is the testbed draft exported to the full vocabulary (transformers' assisted generation
cannot use a reduced output layer): its rows for the ids it knows, the unknown-id row for the other input
ids, and zero output rows for them (logit 0, below the argmax logit of every step here: checked by the
identical outputs).

Greedy, the same constant number of draft tokens per step in both (transformers: num_assistant_tokens with
the "constant" schedule and no confidence early-exit), the same prompts (arith test problems with the chat
template) and the same budget. Runs are interleaved per prompt, the order alternating between repeats;
ms/token are medians over repeats of total wall / total new tokens, split into the time inside the models'
forwards (hooks on both models, the same for both implementations) and the rest. Writes
benchmarks/results/hf_parity.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pivotspec import api


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_assisted(target, draft, ids: list[int], gamma: int, max_new_tokens: int) -> tuple[list[int], float]:
    gen_cfg = draft.model.generation_config
    gen_cfg.num_assistant_tokens, gen_cfg.num_assistant_tokens_schedule = gamma, "constant"
    gen_cfg.assistant_confidence_threshold = 0.0
    start = time.perf_counter()
    out = target.model.generate(torch.tensor([ids], device=target.device), assistant_model=draft.model,
                                do_sample=False, max_new_tokens=max_new_tokens,
                                eos_token_id=sorted(api.stop_ids(target)),
                                pad_token_id=target.tokenizer.pad_token_id or 0)
    wall = time.perf_counter() - start
    return out[0, len(ids):].tolist(), wall


class ForwardClock:
    """Wall seconds spent inside the forwards of some models (hooks on their top modules), so that each
    implementation's time splits into the model forwards both run and the loop around them."""

    def __init__(self, models: list, device: torch.device):
        self.seconds, self.device, self._start = 0.0, device, 0.0
        self._depth = 0  # nested forwards (a model calling another hooked one) are counted once
        self.handles = [h for m in models for h in (m.register_forward_pre_hook(self._enter),
                                                    m.register_forward_hook(self._leave))]

    def _enter(self, *_: object) -> None:
        if self._depth == 0:
            synchronize(self.device)
            self._start = time.perf_counter()
        self._depth += 1

    def _leave(self, *_: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            synchronize(self.device)
            self.seconds += time.perf_counter() - self._start

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def load_side(name: str, dtype: str, device: str):
    """Load one model of the pair; ``testbed-draft-full`` is the testbed draft's full-vocabulary export
    (``api.full_vocab_checkpoint``, cached). Returns the model and, for that export, the reduced-vocabulary draft
    it came from (else None)."""
    if name != "testbed-draft-full":
        return api.load_model(name, dtype, device=device), None
    reduced = api.load_model("testbed-draft", dtype, device=device)
    lm = api.load_model(str(api.full_vocab_checkpoint("testbed-draft")), dtype, device=device)
    lm.name = name
    return lm, reduced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=8, help="arith test problems used as prompts")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hf_parity.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_side(args.target, args.dtype, args.device)
    draft, reduced = load_side(args.draft, args.draft_dtype, args.device)
    pair = api.make_pair(target, draft)
    prompts = [api.encode(target, p.prompt, p.messages or None) for p in api.get_task("arith").problems("test", args.n)]

    def pivotspec_sd(ids: list[int]) -> tuple[list[int], float]:
        g = api.generate(pair, prompt_ids=ids, method="sd", gamma=args.gamma, max_new_tokens=args.max_new_tokens)
        return g.token_ids, g.stats["wall_s"]

    runners = {"pivotspec sd": pivotspec_sd,
               "transformers assisted": lambda ids: hf_assisted(target, draft, ids, args.gamma, args.max_new_tokens)}
    if reduced is not None:  # what transformers cannot run: the same draft with its own small output layer
        def reduced_sd(ids: list[int]) -> tuple[list[int], float]:
            g = api.generate(api.make_pair(target, reduced), prompt_ids=ids, method="sd", gamma=args.gamma,
                             max_new_tokens=args.max_new_tokens)
            return g.token_ids, g.stats["wall_s"]

        runners["pivotspec sd, reduced-vocab draft (not in transformers)"] = reduced_sd
    for run in runners.values():  # untimed warm-up
        run(prompts[0])
    walls = {m: [] for m in runners}
    forward_walls = {m: [] for m in runners}
    tokens = {m: 0 for m in runners}
    outputs = {m: [] for m in runners}
    clock = ForwardClock([lm.model for lm in (target, draft, reduced) if lm is not None], target.device)
    for r in range(args.repeats):
        totals, forward_totals = dict.fromkeys(runners, 0.0), dict.fromkeys(runners, 0.0)
        for ids in prompts:
            for m in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
                before = clock.seconds
                out, wall = runners[m](ids)
                totals[m] += wall
                forward_totals[m] += clock.seconds - before
                if r == 0:
                    outputs[m].append(out)
                    tokens[m] += len(out)
        for m in runners:
            walls[m].append(totals[m])
            forward_walls[m].append(forward_totals[m])
    clock.close()
    identical = sum(a == b for a, b in zip(outputs["pivotspec sd"], outputs["transformers assisted"], strict=True))
    same_as_reduced = {m: sum(a == b for a, b in zip(o, outputs["pivotspec sd"], strict=True))
                       for m, o in outputs.items()}
    rows = {m: {"ms_per_token": statistics.median(1000 * w / tokens[m] for w in walls[m]),
                "forward_ms_per_token": statistics.median(1000 * w / tokens[m] for w in forward_walls[m]),
                "new_tokens": tokens[m], "identical_to_pivotspec_sd": same_as_reduced[m]} for m in runners}
    for row in rows.values():
        row["outside_forwards_share"] = 1 - row["forward_ms_per_token"] / row["ms_per_token"]
    # A loop with no cost of its own around transformers' forwards would be this much faster than transformers.
    hf = rows["transformers assisted"]
    zero_overhead_ceiling = hf["ms_per_token"] / hf["forward_ms_per_token"]
    ratio = statistics.median(h / p for h, p in zip(walls["transformers assisted"], walls["pivotspec sd"], strict=True))
    result = {"config": {k: str(v) for k, v in vars(args).items()}, "n_prompts": len(prompts),
              "identical_outputs": identical, "methods": rows, "pivotspec_speedup_over_transformers": ratio,
              "zero_overhead_ceiling_over_transformers": zero_overhead_ceiling}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{len(prompts)} prompts, greedy, gamma {args.gamma}, {args.max_new_tokens} new tokens at most; "
          f"token ids identical on {identical}/{len(prompts)}")
    print("| implementation | ms/token | in model forwards | outside forwards | new tokens | same tokens as "
          "pivotspec sd |\n|---|---|---|---|---|---|")
    for m, row in rows.items():
        same = f"{row['identical_to_pivotspec_sd']}/{len(prompts)}"
        print(f"| {m} | {row['ms_per_token']:.1f} | {row['forward_ms_per_token']:.1f} | "
              f"{100 * row['outside_forwards_share']:.1f}% | {row['new_tokens']} | {same} |")
    print(f"pivotspec sd is {ratio:.2f}x as fast as transformers' assisted generation (median of {args.repeats} "
          f"interleaved repeats); a loop costing nothing around transformers' forwards would be "
          f"{zero_overhead_ceiling:.2f}x")


if __name__ == "__main__":
    main()
