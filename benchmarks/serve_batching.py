"""`pivotspec serve` under load from guidellm (vLLM's serving benchmark tool): continuous batching against one
decode at a time, in the same run.

    python benchmarks/serve_batching.py --concurrency 1,4,8,16 --method pad

Starts two servers as a user would (`pivotspec serve --pair testbed --max-batch 1` and `--max-batch 8`, one
process each, one loaded at a time under load), then for each concurrency level runs guidellm's
`concurrent` profile against each (which one goes first alternates by level) on arith test problems sent
as chat messages (streaming, greedy). Reports output tokens/s (all output tokens over the level's wall
time), time to first token and request latency (p50, p95) and errors, and checks that every greedy
response of the batching server equals the same prompt's response from the one-at-a-time server.
guidellm runs from its own environment (`--guidellm`, default .venv-bench/bin/guidellm: install the CPU
torch there first, then `pip install guidellm==0.8.1`). Where guidellm cannot be installed (the lent GPU
machine: no network, and its wheels do not fit beside the repository in what a call carries), `--client
builtin` sends the same requests from client threads (streaming, the same measurements) instead.
Writes benchmarks/results/serve_batching.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from pivotspec.api import cpu_capabilities

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(pair: str, method: str, max_batch: int, threads: int, log: Path,
                 placement: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pivotspec.cli", "serve", "--pair", pair, "--method", method, "--port", str(port),
           "--max-batch", str(max_batch), "--max-queue", "256", "--threads", str(threads), *placement]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: see {log}") from None
            time.sleep(0.1)
    raise SystemExit(f"the server did not start: see {log}")


def model_name(url: str) -> str:
    return json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]["id"]


def warm_up(url: str, messages: list[dict]) -> None:
    body = {"model": model_name(url), "messages": messages, "max_tokens": 16}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=600).read()


def run_guidellm(guidellm: str, url: str, tokenizer: str, data: Path, streams: int, requests: int,
                 max_tokens: int, out: Path) -> dict:
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model_name(url),
                    "request_format": "/v1/chat/completions", "stream": True, "max_tokens": max_tokens},
        "profile": {"kind": "concurrent", "streams": streams},
        "data": [{"kind": "json_file", "path": str(data)}],
        "constraints": [{"kind": "max_requests", "count": requests}]}}
    spec = out.with_suffix(".scenario.json")
    spec.write_text(json.dumps(scenario))
    cmd = [guidellm, "run", "-c", str(spec), "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=3600)
    bench = json.loads(out.read_text())["benchmarks"][0]["requests"]
    done = [{"ok": True, "start": r["request_start_time"], "end": r["request_end_time"],
             "latency": r["request_latency"], "ttft": (r["time_to_first_token_ms"] or 0) / 1000,
             "tokens": r["output_tokens"], "output": r["output"],
             "key": json.dumps(json.loads(r["request_args"])["body"]["messages"])} for r in bench["successful"]]
    return done + [{"ok": False}] * (len(bench["errored"]) + len(bench["incomplete"]))


def stream_one(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streaming chat request, as guidellm sends it; the builtin client's unit of load."""
    body = {"model": model_name(url), "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, first, text, tokens = time.time(), None, "", None
    try:
        with urllib.request.urlopen(req, timeout=3600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                delta = msg["choices"][0]["delta"].get("content") if msg.get("choices") else None
                if delta:
                    first = first or time.time()
                    text += delta
                if msg.get("usage"):
                    tokens = msg["usage"]["completion_tokens"]
    except OSError:
        return {"ok": False}
    end = time.time()
    return {"ok": tokens is not None, "start": start, "end": end, "latency": end - start,
            "ttft": (first or end) - start, "tokens": tokens or 0, "output": text, "key": json.dumps(messages)}


def run_builtin(url: str, prompts: list[list[dict]], streams: int, max_tokens: int) -> list[dict]:
    """guidellm's concurrent profile: ``streams`` clients, each sending its next request when the last ends."""
    todo, lock, results = iter(prompts), threading.Lock(), []

    def client() -> None:
        while True:
            with lock:
                messages = next(todo, None)
            if messages is None:
                return
            r = stream_one(url, messages, max_tokens)
            with lock:
                results.append(r)

    workers = [threading.Thread(target=client) for _ in range(streams)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return results


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(results: list[dict]) -> dict:
    """Throughput over the level's wall time, and latency percentiles over its successful requests."""
    ok = [r for r in results if r["ok"]]
    start, end = min(r["start"] for r in ok), max(r["end"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    ttft, latency = [r["ttft"] for r in ok], [r["latency"] for r in ok]
    return {"requests": len(results), "errors": len(results) - len(ok), "output_tokens": tokens,
            "wall_s": end - start, "output_tokens_per_s": tokens / (end - start),
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": pct(ttft, 0.95),
            "latency_p50_s": statistics.median(latency), "latency_p95_s": pct(latency, 0.95),
            "outputs": {r["key"]: r["output"] for r in ok}}


def drop_outputs(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "outputs"}


def medians(runs: list[dict]) -> dict:
    """Each measurement's median over a level's repeats (the errors summed)."""
    out = {k: statistics.median(r[k] for r in runs) for k in drop_outputs(runs[0]) if k != "errors"}
    return {**out, "errors": sum(r["errors"] for r in runs), "repeats": len(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="testbed")
    ap.add_argument("--method", default="pad")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level (default: 4 x concurrency, >= 8: mostly a full batch, little tail)")
    ap.add_argument("--max-batch", type=int, default=8, help="the batching server's --max-batch")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each level per server, interleaved (medians)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--client", choices=["guidellm", "builtin"], default="guidellm",
                    help="the load generator (builtin: client threads, where guidellm cannot be installed)")
    ap.add_argument("--guidellm", default=str(ROOT / ".venv-bench" / "bin" / "guidellm"))
    ap.add_argument("--device", default=None, help="the servers' --device")
    ap.add_argument("--dtype", default=None, help="the servers' --dtype")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_batching.json"))
    args = ap.parse_args()
    if args.client == "guidellm" and not (Path(args.guidellm).is_file() or shutil.which(args.guidellm)):
        raise SystemExit(f"guidellm not found at {args.guidellm}: make .venv-bench (CPU torch, then "
                         "guidellm==0.8.1) or pass --guidellm")
    from pivotspec import api

    levels = [int(c) for c in args.concurrency.split(",")]
    problems = api.get_task(api.pair_task(args.pair)).problems("test", max(max(levels) * 4, 8, args.requests),
                                                               seed=1)
    work = Path(tempfile.mkdtemp(prefix="serve_batching."))
    tokenizer = str(api.model_dir(api.resolve_names(None, None, args.pair)[0]))
    placement = [*(["--device", args.device] if args.device else []), *(["--dtype", args.dtype] if args.dtype else [])]
    servers = {}
    for batch in (1, args.max_batch):
        servers[batch] = start_server(args.pair, args.method, batch, args.threads, work / f"server{batch}.log",
                                      placement)
        warm_up(servers[batch][1], problems[0].messages)
    results: dict[tuple[int, int], list[dict]] = {}
    try:
        for i, c in enumerate(levels):
            n = args.requests or max(8, 4 * c)
            data = work / f"prompts{c}.jsonl"  # exactly the level's requests: both servers get the same prompts
            data.write_text("".join(json.dumps({"messages": p.messages}) + "\n" for p in problems[:n]))
            for repeat in range(args.repeats):
                order = [1, args.max_batch] if (i + repeat) % 2 == 0 else [args.max_batch, 1]
                for batch in order:
                    if args.client == "guidellm":
                        done = run_guidellm(args.guidellm, servers[batch][1], tokenizer, data, c, n,
                                            args.max_tokens, work / f"c{c}-b{batch}-r{repeat}.json")
                    else:
                        done = run_builtin(servers[batch][1], [p.messages for p in problems[:n]], c,
                                           args.max_tokens)
                    r = summarize(done)
                    results.setdefault((c, batch), []).append(r)
                    print(f"concurrency {c}, --max-batch {batch}: {r['output_tokens_per_s']:.1f} tokens/s, "
                          f"TTFT p50 {r['ttft_p50_s']:.2f} s, errors {r['errors']}", file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
    rows = []
    for c in levels:
        ones, manys = results[(c, 1)], results[(c, args.max_batch)]
        # Compared where both servers answered: guidellm's request count sometimes stops one short (31 of 32
        # recorded, no error), and a missing answer is not a different one.
        pairs = [(k, one["outputs"][k], m["outputs"][k]) for one, m in zip(ones, manys, strict=True)
                 for k in m["outputs"] if k in one["outputs"]]
        same = sum(a == b for _, a, b in pairs)
        # A differing response is kept whole (the prompt, both answers), so that it can be replayed.
        differing = [{"messages": json.loads(k), "one_at_a_time": a, "batched": b} for k, a, b in pairs if a != b]
        rows.append({"concurrency": c, "one_at_a_time": medians(ones), "batched": medians(manys),
                     "throughput_ratio": statistics.median(m["output_tokens_per_s"] / o["output_tokens_per_s"]
                                                           for o, m in zip(ones, manys, strict=True)),
                     "ttft_p50_ratio": statistics.median(m["ttft_p50_s"] / o["ttft_p50_s"]
                                                         for o, m in zip(ones, manys, strict=True)),
                     "identical_responses": f"{same}/{len(pairs)}", "differing_responses": differing,
                     "runs": {"one_at_a_time": [drop_outputs(r) for r in ones],
                              "batched": [drop_outputs(r) for r in manys]}})
    client = "guidellm 0.8.1 (concurrent profile)" if args.client == "guidellm" else "builtin client threads"
    meta = {"pair": args.pair, "method": args.method, "max_batch": args.max_batch, "max_tokens": args.max_tokens,
            "threads": args.threads, "cpu": os.cpu_count(), "load_generator": client, "device": args.device,
            "dtype": args.dtype, "cpu_kernels": os.environ.get("PIVOTSPEC_CPU_KERNELS", "auto"),
            "machine": cpu_capabilities()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "levels": rows}, indent=1))
    print(f"{args.pair} pair, {args.method}, greedy, streaming chat; {client}; "
          f"--max-batch 1 vs {args.max_batch}, same run; medians of {args.repeats} interleaved repeat(s) per level")
    print("| clients | max-batch | output tok/s | TTFT p50 | TTFT p95 | latency p50 | latency p95 | errors | "
          "throughput vs batch 1 | TTFT p50 vs batch 1 | identical to batch 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        for name, batch in (("one_at_a_time", 1), ("batched", args.max_batch)):
            r = row[name]
            extra = (f"{row['throughput_ratio']:.2f}x | {row['ttft_p50_ratio']:.2f}x | {row['identical_responses']}"
                     if batch != 1 else "- | - | -")
            print(f"| {row['concurrency']} | {batch} | {r['output_tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} s | "
                  f"{r['ttft_p95_s']:.2f} s | {r['latency_p50_s']:.2f} s | {r['latency_p95_s']:.2f} s | "
                  f"{r['errors']} | {extra} |")


if __name__ == "__main__":
    main()
