"""PAD against SD inside vLLM (pivotspec's vLLM plugin), the same table as pivotspec's own loop gives.

    python benchmarks/vllm_pad.py --n 200                  # testbed (arith), vLLM's CPU build from .venv-vllm

One `pivotspec eval --engine vllm` run: ar, sd (vLLM's own lossless draft_model speculative decoding) and pad at
the shipped classifier's calibrated sigma, greedy, one problem at a time so each row has its own counts and wall
time, methods interleaved per problem (one untimed warm-up problem first). Each method is its own vLLM engine
(started once); vLLM runs with its default compilation unless $PIVOTSPEC_VLLM_ARGS says otherwise. Prints the
table (accuracy with McNemar against ar and sd, eta, tokens per target forward, speedup over ar) and writes
benchmarks/results/vllm_pad.json and the run's files under benchmarks/results/vllm_pad/ (rerun to resume).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from pivotspec import api


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="testbed")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_pad"))
    args = ap.parse_args()
    pair = api.load_pair(pair=args.pair, dtype="float32")
    settings = api.EvalSettings(task=api.pair_task(args.pair), n=args.n, max_new_tokens=200, out=args.out,
                                engine="vllm")
    summary = api.evaluate(pair, settings, methods="ar,sd,pad")
    table = api.format_table(summary)
    print(table)
    record = {"pair": args.pair, "n": args.n, "engine": "vllm", "vllm_args": os.environ.get("PIVOTSPEC_VLLM_ARGS"),
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "summary": summary,
              "table": table}
    out = args.out.with_suffix(".json")
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
