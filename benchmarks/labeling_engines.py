"""Labeling engines and workers side by side: the same candidates labeled by `torch`, `vllm`, and Ray runs.

    python benchmarks/labeling_engines.py --n-problems 6 --rollouts 10 --repeats 1

Each configuration is one `pivotspec label` process (fresh output file) on the testbed pair with the walk
following the target (`--follow target`), so every configuration meets the very same candidates and only
the rollouts differ. Configurations run interleaved, `--repeats` times. Per run: wall time of the whole
command (model loading and engine start included), engine time (the summed `rollout_s` of the candidates),
rollouts/s and rollout tokens/s over engine time, wall per candidate, and the peak resident memory of the
whole process tree (sampled every 0.2 s). Prints a table (medians) and writes JSON to --out. With walks
batched (--concurrency) a candidate's rollout_s is its whole batch's time, so engine time counts a batch once
per candidate in it: compare that row by wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {
    "torch": [],
    "torch 4 walks": ["--concurrency", "4"],
    "vllm": ["--engine", "vllm"],
    "ray x1 (torch)": ["--ray", "--workers", "1"],
    "ray x2 (torch)": ["--ray", "--workers", "2"],
}


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (Ray's and vLLM's processes included)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            pages = int((entry / "statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        rss[int(entry.name)] = pages * 4096
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack.extend(children.get(p, []))
    return total


def run_one(name: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [str(Path(sys.executable).with_name("pivotspec")), "label", "--pair", "testbed", "--task", "arith",
           "--n-problems", str(args.n_problems), "--rollouts", str(args.rollouts), "--max-rollout-tokens",
           str(args.max_rollout_tokens), "--follow", "target", "--min-target-rate", "-1", "--seed", "0",
           "--out", str(out), *CONFIGS[name]]
    if not name.startswith("ray"):
        cmd += ["--threads", "2"]
    started, peak = time.perf_counter(), 0
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.2)
    wall = time.perf_counter() - started
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{err[-3000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cands = [r for r in rows if r["type"] == "candidate"]
    engine_s = sum(r["rollout_s"] for r in cands)
    rollouts = sum(r["n_rollouts"] for r in cands)
    tokens = sum(r["rollout_tokens"] for r in cands)
    return {"config": name, "candidates": len(cands), "rollouts": rollouts, "rollout_tokens": tokens,
            "wall_s": wall, "engine_s": engine_s, "rollouts_per_s": rollouts / engine_s,
            "tokens_per_s": tokens / engine_s, "wall_per_candidate_s": wall / len(cands),
            "peak_rss_gb": peak / 2**30,
            "u_acc_mean": statistics.mean(r["u_acc"] for r in cands),
            "u_rej_mean": statistics.mean(r["u_rej"] for r in cands)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-problems", type=int, default=6)
    ap.add_argument("--rollouts", type=int, default=10)
    ap.add_argument("--max-rollout-tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/labeling_engines.json"))
    args = ap.parse_args()
    names = args.configs.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                r = run_one(name, args, Path(tmp) / f"{rep}-{name.replace(' ', '_')}.jsonl")
                results.append({**r, "repeat": rep})
                print(f"{name}: {r['candidates']} candidates, wall {r['wall_s']:.0f} s", file=sys.stderr)
    keys = ["rollouts_per_s", "tokens_per_s", "wall_s", "engine_s", "wall_per_candidate_s", "peak_rss_gb",
            "u_acc_mean", "u_rej_mean"]
    table = []
    for name in names:
        mine = [r for r in results if r["config"] == name]
        table.append({"config": name, "candidates": mine[0]["candidates"],
                      **{k: statistics.median(r[k] for r in mine) for k in keys}})
    base = next(t for t in table if t["config"] == names[0])
    print("| config | candidates | rollouts/s | rollout tokens/s | engine s | wall s | wall/candidate s | "
          f"wall vs {names[0]} | peak RSS GB | mean U_acc | mean U_rej |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['config']} | {t['candidates']} | {t['rollouts_per_s']:.1f} | {t['tokens_per_s']:.0f} | "
              f"{t['engine_s']:.0f} | {t['wall_s']:.0f} | {t['wall_per_candidate_s']:.1f} | "
              f"{base['wall_s'] / t['wall_s']:.2f}x | {t['peak_rss_gb']:.1f} | {t['u_acc_mean']:.3f} | "
              f"{t['u_rej_mean']:.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results,
                                    "table": table}, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
