"""Labeling spread over a local Ray cluster: shards as Ray tasks, a killed worker retried, one merged file."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pivotspec import store
from pivotspec.cli import main
from pivotspec.labels.cluster import count_done, shard_path

pytestmark = pytest.mark.slow  # starts Ray clusters

if not os.environ.get("PIVOTSPEC_REQUIRE_RAY"):  # CI requires Ray: a missing one fails at import there
    pytest.importorskip("ray")

PIVOTSPEC = str(Path(sys.executable).with_name("pivotspec"))


def key(rows):
    return sorted((r["type"], r["problem_id"], r.get("step"), r.get("label"), r.get("u_acc"), r.get("u_rej"))
                  for r in rows)


def test_ray_run_with_two_workers_equals_the_single_process_run(tiny_dir, tmp_path, capsys):
    t, d = str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"])
    base = ["label", "--target", t, "--draft", d, "--task", "arith", "--n-problems", "6", "--rollouts", "2",
            "--max-rollout-tokens", "3", "--max-walk-tokens", "5", "--min-target-rate", "-1"]
    assert main([*base, "--out", str(tmp_path / "one.jsonl")]) == 0
    out = tmp_path / "ray.jsonl"
    assert main([*base, "--ray", "--workers", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "ray: 2 workers | problems 6/6" in err  # one progress line for the whole run
    assert key(store.read_records(out)) == key(store.read_records(tmp_path / "one.jsonl"))
    owners = [{r["problem_id"] for r in store.read_records(shard_path(out, i, 2)) if r["type"] == "problem"}
              for i in range(2)]
    assert owners[0] and owners[1] and not owners[0] & owners[1]  # both workers had work, none shared
    # A shard's own bad input (its file holds another config) comes back as one line, not a Ray traceback.
    assert main([*base, "--alpha", "0.3", "--ray", "--workers", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "different config" in err[-1] and "Traceback" not in "\n".join(err)
    # Labels kept compressed under the output's name (as the repository keeps them) are merged in, not dropped.
    kept = tmp_path / "kept.jsonl"
    store.compressed(kept).write_bytes(gzip.compress((tmp_path / "one.jsonl").read_bytes()))
    fewer = [a if a != "6" else "3" for a in base]
    assert main([*fewer, "--ray", "--workers", "2", "--out", str(kept)]) == 0
    assert key(store.read_records(kept)) == key(store.read_records(tmp_path / "one.jsonl"))


def test_ray_argument_errors_come_before_ray_starts(tiny_dir, tmp_path, capsys):
    t, d = str(tiny_dir["llama_target"]), str(tiny_dir["llama_draft"])
    assert main(["label", "--target", t, "--draft", d, "--ray", "--shard", "0/2", "--out", str(tmp_path / "x")]) == 2
    assert "drop --shard" in capsys.readouterr().err
    assert main(["label", "--target", t, "--draft", d, "--ray", "--workers", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    assert main(["label", "--pair", "nope", "--ray", "--out", str(tmp_path / "x")]) == 2
    assert "invalid choice" in capsys.readouterr().err


def shard_workers() -> list[int]:
    """Pids of Ray worker processes running a shard (Ray titles them ray::_label_shard)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"ray::_label_shard" in cmd:
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow(seconds=50)
def test_a_killed_worker_is_retried_and_resumes_its_shard(tmp_path):
    """SIGKILL one worker in the middle of its shard: Ray retries the task, the new worker resumes from the
    shard file, and the merged labels equal those of an uninterrupted single-process run."""
    base = [PIVOTSPEC, "label", "--pair", "testbed", "--n-problems", "2", "--rollouts", "2", "--max-rollout-tokens",
            "16", "--max-walk-tokens", "24", "--min-target-rate", "-1", "--threads", "1"]
    out = tmp_path / "ray.jsonl"
    run = subprocess.Popen([*base, "--ray", "--workers", "2", "--out", str(out)], stderr=subprocess.PIPE, text=True)
    killed = None
    deadline = time.time() + 600
    while killed is None and run.poll() is None and time.time() < deadline:
        for i in range(2):
            problems, candidates = count_done(shard_path(out, i, 2))
            shard_total = 1  # 2 problems dealt to 2 shards; kill only while the shard still has work
            if candidates >= 1 and problems < shard_total:
                pids = shard_workers()
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed = pids[0]
                    break
        time.sleep(0.2)
    _, err = run.communicate(timeout=900)
    assert killed is not None, f"no worker was caught mid-shard: {err[-2000:]}"
    assert run.returncode == 0, err[-2000:]
    assert subprocess.run([*base, "--out", str(tmp_path / "one.jsonl")], capture_output=True).returncode == 0
    merged = store.read_records(out)
    steps = [(r["problem_id"], r["step"]) for r in merged if r["type"] == "candidate"]
    assert len(steps) == len(set(steps))
    assert key(merged) == key(store.read_records(tmp_path / "one.jsonl"))
