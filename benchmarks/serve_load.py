"""A bounded load on `pivotspec serve` over loopback: failures, latency, time to first token, throughput, and
the server's spec-decode counters against the sum of the per-response metrics.

    python benchmarks/serve_load.py --requests 64 --concurrency 8 --method pad

Starts the server in this process (testbed pair, uvicorn on 127.0.0.1), then sends streaming chat
completions for arith test problems from `--concurrency` client threads. Writes
benchmarks/results/serve_load.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
import urllib.request
from pathlib import Path

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "pad_overrides")


def counters(url: str) -> dict[str, int]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {name: int(next(x.split()[-1] for x in text.splitlines() if x.startswith(f"pivotspec:{name}_total")))
            for name in COUNTERS}


def one_request(url: str, body: dict) -> dict:
    start = time.perf_counter()
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    first, final = None, None
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if first is None and msg.get("choices") and msg["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - start
                if "metrics" in msg:
                    final = msg
                if msg.get("usage"):
                    final["usage"] = msg["usage"]
    except Exception as exc:  # counted as a failure
        return {"ok": False, "error": str(exc)}
    return {"ok": final is not None, "latency": time.perf_counter() - start, "ttft": first,
            "tokens": final["usage"]["completion_tokens"] if final else 0,
            "spec": final["metrics"]["speculative_decoding"] if final else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--method", default="pad")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_load.json"))
    args = ap.parse_args()
    import uvicorn

    from pivotspec import api
    from pivotspec.server import Settings, create_app

    pair = api.load_pair(pair="testbed", threads=args.threads)
    settings = Settings(model="testbed", method=args.method, max_queue=args.requests)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(pair, settings), host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    problems = api.get_task("arith").problems("test", args.requests, seed=1)
    bodies = [{"model": "testbed", "messages": p.messages, "max_tokens": args.max_tokens, "stream": True,
               "stream_options": {"include_usage": True}} for p in problems]
    one_request(url, bodies[0])  # warm-up, before the counters are read
    before = counters(url)
    results: list[dict] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = one_request(url, bodies[i])

    start = time.perf_counter()
    workers = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - start
    after = counters(url)
    server.should_exit = True
    ok = [r for r in results if r["ok"]]
    summed = {name: 0 for name in COUNTERS}
    for r in ok:
        summed["spec_decode_num_drafts"] += r["spec"]["num_drafts"]
        summed["spec_decode_num_draft_tokens"] += r["spec"]["num_draft_tokens"]
        summed["spec_decode_num_accepted_tokens"] += r["spec"]["num_accepted_tokens"]
        summed["pad_overrides"] += r["spec"]["pad_overrides"]
    served = {name: after[name] - before[name] for name in COUNTERS}
    lat = sorted(r["latency"] for r in ok)
    ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    result = {"requests": len(bodies), "concurrency": args.concurrency, "method": args.method,
              "failed": len(bodies) - len(ok), "wall_s": wall,
              "latency_p50_s": statistics.median(lat), "latency_p95_s": pct(lat, 0.95),
              "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": pct(ttft, 0.95),
              "tokens": sum(r["tokens"] for r in ok), "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
              "server_counters": served, "sum_of_responses": summed, "counters_match": served == summed}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{len(bodies)} streaming chat requests, {args.concurrency} concurrent, testbed pair, {args.method}, "
          f"the server in this process at its default --max-batch {settings.max_batch}")
    print("| failed | latency p50 | p95 | TTFT p50 | p95 | tokens/s | server counters = sum of responses |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {result['failed']} | {result['latency_p50_s']:.2f} s | {result['latency_p95_s']:.2f} s | "
          f"{result['ttft_p50_s']:.2f} s | {result['ttft_p95_s']:.2f} s | {result['tokens_per_s']:.1f} | "
          f"{'yes' if result['counters_match'] else 'NO'} ({served}) |")


if __name__ == "__main__":
    main()
