"""What a compiled graph buys a CPU forward (issue 29): the testbed target's forward at 1 and 6 new tokens over a
100-token KV cache, pivotspec's eager path (the ``LM`` wrapper with its growing cache, as every decode runs it)
against ``torch.compile`` of the bare model over transformers' ``StaticCache`` (optionally with Inductor's
freezing), next to the time to read the weights once at this machine's read bandwidth.

    python benchmarks/compiled_forward.py --dtype float32 --freezing --out benchmarks/results/compiled_forward.json

Medians of ``--repeats`` interleaved rounds of ``--n`` forwards each; the compile time of each shape is reported.
The compiled forward is not wired into pivotspec's loop (it would need hidden states returned instead of hooked
and a static cache that rolls back): this measures the ceiling such a change could reach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pivotspec import api

PREFIX = 100


def read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes per second that summing a buffer larger than the caches reaches (one read of every byte)."""
    buf = torch.ones(nbytes // 4)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(repeats))
    return nbytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--freezing", action="store_true", help="Inductor's freezing (weights as constants)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled_forward.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import StaticCache

    lm = api.load_pair(pair="testbed", dtype=args.dtype).target
    model = lm.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt = torch.randint(0, 1000, (1, PREFIX))
    gen = torch.Generator().manual_seed(0)

    def eager(width: int) -> float:
        lm.reset()
        lm.forward(prompt[0].tolist(), keep_logits=0)
        times = []
        for _ in range(args.n):
            ids = torch.randint(0, 1000, (width,), generator=gen).tolist()
            times.append(_timed(lambda ids=ids: lm.forward(ids)))
            lm.rollback(width)
        return statistics.median(times)

    cache = StaticCache(config=model.config, max_cache_len=512)
    with torch.inference_mode():
        model(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(PREFIX))
    if args.freezing:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
    compiled_forward = torch.compile(model.forward, dynamic=False)

    def compiled(width: int, n: int) -> float:
        times = []
        with torch.inference_mode():
            for _ in range(n):  # always the same positions: the static cache's slots are overwritten
                ids = torch.randint(0, 1000, (1, width), generator=gen)
                times.append(_timed(lambda ids=ids: compiled_forward(
                    input_ids=ids, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(PREFIX, PREFIX + width), logits_to_keep=1)))
        return statistics.median(times)

    compile_s = {w: _timed(lambda w=w: compiled(w, 1)) for w in (1, 6)}
    rounds: dict[str, list[float]] = {f"{kind} {w}": [] for kind in ("eager", "compiled") for w in (1, 6)}
    for _ in range(args.repeats):
        for w in (1, 6):
            rounds[f"eager {w}"].append(eager(w))
            rounds[f"compiled {w}"].append(compiled(w, args.n))
    ms = {k: statistics.median(v) * 1e3 for k, v in rounds.items()}
    bandwidth = read_bandwidth()
    read_ms = weight_bytes / bandwidth * 1e3
    print(f"testbed target, {args.dtype}, {weight_bytes / 1e6:.0f} MB; read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"read time {read_ms:.1f} ms; freezing {args.freezing}; compile {compile_s[1]:.0f} s (1 token), "
          f"{compile_s[6]:.0f} s (6 tokens)")
    print("| path | 1 token | 6 tokens | 6 / 1 | 1 token / read time |")
    print("|---|---|---|---|---|")
    for kind in ("eager", "compiled"):
        one, six = ms[f"{kind} 1"], ms[f"{kind} 6"]
        print(f"| {kind} | {one:.1f} ms | {six:.1f} ms | {six / one:.2f} | {one / read_ms:.2f}x |")
    result = {"dtype": args.dtype, "freezing": args.freezing, "weight_bytes": weight_bytes,
              "read_bandwidth": bandwidth, "read_ms": read_ms, "compile_s": compile_s, "ms": ms,
              "rounds_s": rounds, "machine": api.cpu_capabilities(), "threads": args.threads}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
