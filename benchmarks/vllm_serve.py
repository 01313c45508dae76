"""Batched throughput of PAD served by vLLM (`pivotspec serve --engine vllm`) against `pivotspec serve`.

    python benchmarks/vllm_serve.py --requests 32 --repeats 2

Starts both servers for the testbed pair with method pad (each in its own process, on loopback), then for each
repeat and each concurrency (1, 8, 16) sends the same `--requests` greedy chat completions (arith test
problems, non-streaming) to one server and then the other, the order alternating, so drift hits both alike.
Per server and concurrency: output tokens per second (medians over repeats of total tokens / wall), median
request latency, and the PAD override and spec-decode counters read from each server's /metrics. Writes
benchmarks/results/vllm_serve.json and prints a table. pivotspec's server decodes at most --max-batch rows at
once (set to 16 here); vLLM schedules what it is given, eager (--enforce-eager: no torch.compile, as in the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pivotspec import api

CONCURRENCY = (1, 8, 16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, limit_s: float = 900) -> None:
    start = time.time()
    while time.time() - start < limit_s:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: see its log")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"{url} not ready after {limit_s} s")


def complete(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as resp:
        answer = json.loads(resp.read())
    return time.perf_counter() - start, int(answer["usage"]["completion_tokens"])


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("pivotspec:pad_overrides", "vllm:spec_decode_num_", "pivotspec:spec_decode_num_")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: complete(url, model, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    tokens = sum(n for _, n in results)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "median_latency_s": statistics.median(t for t, _ in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_serve.json"))
    args = ap.parse_args()
    task = api.get_task("arith")
    prompts = [p.prompt for p in task.problems("test", args.requests, 0)]
    servers, procs = {}, []
    logs = Path("benchmarks/results/vllm_serve_logs")
    logs.mkdir(parents=True, exist_ok=True)
    for engine in ("torch", "vllm"):
        port = free_port()
        cmd = [sys.executable, "-m", "pivotspec.cli", "serve", "--pair", "testbed", "--method", "pad", "--engine",
               engine, "--port", str(port), "--model-name", "testbed"]
        cmd += ["--max-batch", "16", "--max-queue", "64"] if engine == "torch" else ["--", "--enforce-eager"]
        log = open(logs / f"{engine}.log", "w")  # noqa: SIM115 (open for the server's lifetime)
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()))
        servers[engine] = f"http://127.0.0.1:{port}"
    try:
        for engine, url in servers.items():
            wait_ready(url, procs[list(servers).index(engine)])
            load(url, "testbed", prompts[:2], 2, args.max_tokens)  # warm-up, unrecorded
        runs: dict[str, dict[int, list[dict]]] = {e: {c: [] for c in CONCURRENCY} for e in servers}
        for rep in range(args.repeats):
            for conc in CONCURRENCY:
                order = list(servers) if (rep + conc) % 2 == 0 else list(servers)[::-1]
                for engine in order:
                    runs[engine][conc].append(load(servers[engine], "testbed", prompts, conc, args.max_tokens))
                    print(engine, conc, rep, runs[engine][conc][-1], flush=True)
        counts = {e: metrics(u) for e, u in servers.items()}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    table = ["| concurrency | pivotspec serve tok/s | vLLM + plugin tok/s | ratio | pivotspec median latency s | "
             "vLLM median latency s |", "|---|---|---|---|---|---|"]
    summary = {}
    for conc in CONCURRENCY:
        med = {e: statistics.median(r["tokens_per_s"] for r in runs[e][conc]) for e in servers}
        lat = {e: statistics.median(r["median_latency_s"] for r in runs[e][conc]) for e in servers}
        summary[conc] = {"tokens_per_s": med, "median_latency_s": lat,
                         "vllm_over_pivotspec": med["vllm"] / med["torch"]}
        table.append(f"| {conc} | {med['torch']:.1f} | {med['vllm']:.1f} | {med['vllm'] / med['torch']:.2f}x | "
                     f"{lat['torch']:.2f} | {lat['vllm']:.2f} |")
    print("\n".join(table))
    print(json.dumps(counts, indent=1))
    args.out.write_text(json.dumps({"requests": args.requests, "repeats": args.repeats, "max_tokens": args.max_tokens,
                                    "vllm_args": os.environ.get("PIVOTSPEC_VLLM_ARGS"), "summary": summary,
                                    "runs": runs, "metrics": counts, "table": "\n".join(table)}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
