"""`pivotspec demo` and `pivotspec label` end to end, per CPU path, interleaved in one run.

    python benchmarks/end_to_end.py --repeats 2 --out benchmarks/results/end_to_end.json

Each command runs as a new process (model loading and conversion included, the fast-path verdict already
cached by an untimed warm-up) under these settings: float32 with plain linears (every pivotspec number before
the fast path: ``PIVOTSPEC_DTYPE=float32 PIVOTSPEC_CPU_KERNELS=plain``), the CPU default (``--dtype auto``),
float32 on the row-wise kernel (float32's tokens, fastest where auto leaves float32), the same with PyTorch's
ops around the row-wise linears instead of the fused layers (``PIVOTSPEC_LAYERS=torch``), ``--dtype bfloat16``
and ``--dtype int8`` (``--settings`` picks some). Repeats interleave the settings, order
alternating; the table gives median wall seconds and the ratio to float32 plain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "float32 plain": {"PIVOTSPEC_DTYPE": "float32", "PIVOTSPEC_CPU_KERNELS": "plain"},
    "auto": {"PIVOTSPEC_DTYPE": "auto"},
    "float32 rowwise": {"PIVOTSPEC_DTYPE": "float32", "PIVOTSPEC_CPU_KERNELS": "rowwise"},  # float32's fastest tokens
    "auto (PyTorch's layer ops)": {"PIVOTSPEC_DTYPE": "auto", "PIVOTSPEC_LAYERS": "torch"},  # no fused layers
    "bfloat16": {"PIVOTSPEC_DTYPE": "bfloat16"},
    "int8": {"PIVOTSPEC_DTYPE": "int8"},
}


def commands(n_demo: int, n_label: int, rollouts: int, work: Path) -> dict[str, list[str]]:
    exe = str(Path(sys.executable).with_name("pivotspec"))
    return {
        "demo": [exe, "demo", "--n", str(n_demo), "--threads", "2", "--out", str(work / "demo"), "--overwrite"],
        "label": [exe, "label", "--pair", "testbed", "--split", "validation", "--n-problems", str(n_label),
                  "--rollouts", str(rollouts), "--threads", "2", "--out", str(work / "labels.jsonl"), "--overwrite"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--demo-n", type=int, default=20, help="test problems for the demo (its default: 20)")
    ap.add_argument("--label-n", type=int, default=4, help="validation problems to label")
    ap.add_argument("--rollouts", type=int, default=6)
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated, from {', '.join(SETTINGS)} (float32 plain, the baseline, is always run)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/end_to_end.json"))
    args = ap.parse_args()
    asked = {s.strip() for s in args.settings.split(",")}
    if asked - set(SETTINGS):
        ap.error(f"unknown setting {sorted(asked - set(SETTINGS))[0]!r}: choose from {', '.join(SETTINGS)}")
    settings = [s for s in SETTINGS if s in asked or s == "float32 plain"]
    walls: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cmds = commands(args.demo_n, args.label_n, args.rollouts, Path(tmp))
        # Untimed: each setting's fast-path verdicts measured and cached (a new verdict is timed once per machine
        # and model, tens of seconds that the first timed run would otherwise carry).
        warm = commands(1, 1, 1, Path(tmp))["demo"]
        for setting in settings:
            subprocess.run(warm, env={**os.environ, **SETTINGS[setting]}, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        for r in range(args.repeats):
            order = settings if r % 2 == 0 else settings[::-1]
            for job, cmd in cmds.items():
                for setting in order:
                    env = {**os.environ, **SETTINGS[setting]}
                    start = time.perf_counter()
                    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    walls.setdefault((job, setting), []).append(time.perf_counter() - start)
                    print(f"repeat {r}: {job} {setting}: {walls[job, setting][-1]:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for job in cmds:
        base = statistics.median(walls[job, "float32 plain"])
        for setting in settings:
            med = statistics.median(walls[job, setting])
            rows.append({"job": job, "setting": setting, "wall_s": med, "runs": walls[job, setting],
                         "speedup_vs_float32_plain": base / med})
    print(f"{'job':6} {'setting':14} {'wall s':>8} {'vs float32 plain':>17}")
    for row in rows:
        print(f"{row['job']:6} {row['setting']:14} {row['wall_s']:8.1f} {row['speedup_vs_float32_plain']:16.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from pivotspec import api

    args.out.write_text(json.dumps({"commands": {k: " ".join(v[1:]) for k, v in cmds.items()},
                                    "machine": api.cpu_capabilities(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
