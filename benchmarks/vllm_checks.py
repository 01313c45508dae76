"""Three end-to-end checks of PAD inside vLLM that each start an engine of their own, kept out of the test suite
so that CI stays inside its 15 minutes on 2 cores (each costs 1-3 minutes there):

    python benchmarks/vllm_checks.py          # needs ./install.sh --with-vllm (or a python with vLLM 0.32.0)
    python benchmarks/vllm_checks.py --checks override_rate --out benchmarks/results/vllm_override_rate.json

1. `ar` through vLLM (`api.vllm_decoder(pair, "ar")`) against pivotspec's loop: greedy token ids on 20 arith
   test problems, vLLM's prefill token included.
2. `pivotspec serve --engine vllm --pair testbed --method pad`: greedy completions (`return_token_ids`) whose
   tokens are pivotspec's PAD tokens after vLLM's prefill token (pivotspec decodes from prompt + that token,
   as tests/test_vllm_plugin.py does), on 3 problems where PAD differs from SD; `/metrics` carries
   `pivotspec:pad_overrides_total` beside `vllm:spec_decode_num_draft_tokens`.
3. The sampled override rate (in tests/test_vllm_plugin.py until stop 40): temperature 0.7 on both sides, the
   same draft checkpoint (the full-vocabulary export vLLM runs), PAD's default floor, sigma 0.95 (loose, so
   overrides are many): overrides per draft token from vLLM's counters and from pivotspec's loop agree within
   3.5 standard errors on 40 arith test problems. Each prompt samples on its own (pivotspec seeds each row;
   with one seed shared by every row, as generate_many had, the counts moved with the seed and looked like a
   bug in the floor).

Prints one line per check and writes benchmarks/results/vllm_checks.json; exits 1 if a check fails.
(The plugin's own tests, engine parity for sd and pad and sigma 0, are in tests/test_vllm_plugin.py and run
in CI.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from pivotspec import api

os.environ.setdefault("PIVOTSPEC_VLLM_ARGS", '{"enforce_eager": true}')
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def arith_prompts(pair: api.Pair, n: int) -> list[list[int]]:
    return [api.encode(pair.target, p.prompt, p.messages or None) for p in api.get_task("arith").problems("test", n, 0)]


def ar_parity(pair: api.Pair, n: int) -> dict[str, Any]:
    prompts = arith_prompts(pair, n)
    got = api.vllm_generate(pair, prompts, "ar", max_new_tokens=128)
    ref = api.generate_many(pair, prompts, method="ar", max_new_tokens=128, batch_size=10)
    differ = sum(g.token_ids != r.token_ids for g, r in zip(got, ref, strict=True))
    return {"problems": n, "differ": differ, "ok": differ == 0}


def override_rate(pair: api.Pair, n: int, sigma: float = 0.95) -> dict[str, Any]:
    prompts = arith_prompts(pair, n)
    gens = api.vllm_generate(pair, prompts, "pad", temperature=0.7, max_new_tokens=64, sigma=sigma)
    v_over, v_drafted = gens[0].stats["override"], gens[0].stats["drafted"]  # the batch's counters
    same_draft = api.load_pair("testbed-target", str(api.full_vocab_checkpoint("testbed-draft")), dtype="float32")
    policy = api.make_policy(same_draft, "pad", classifier=api.default_classifier("testbed"), sigma=sigma)
    ref = api.generate_many(same_draft, prompts, method="pad", policy=policy, temperature=0.7, max_new_tokens=64,
                            batch_size=10)
    t_over, t_drafted = sum(g.stats["override"] for g in ref), sum(g.stats["drafted"] for g in ref)
    pooled = (v_over + t_over) / (v_drafted + t_drafted)
    se = (pooled * (1 - pooled) * (1 / v_drafted + 1 / t_drafted)) ** 0.5
    z = (v_over / v_drafted - t_over / t_drafted) / se if se else 0.0
    return {"problems": n, "vllm": [v_over, v_drafted], "pivotspec": [t_over, t_drafted], "z": round(z, 2),
            "ok": v_over > 0 and t_over > 0 and abs(z) <= 3.5}


def served_pad(pair: api.Pair, n: int, log: Path) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pivotspec.cli", "serve", "--pair", "testbed", "--method",
                                 "pad", "--engine", "vllm", "--port", str(port), "--model-name", "testbed", "--",
                                 "--enforce-eager"], stdout=out, stderr=subprocess.STDOUT)
        try:
            start = time.time()
            while True:
                if proc.poll() is not None or time.time() - start > 600:
                    return {"ok": False, "error": f"the server did not come up: see {log}"}
                try:
                    urllib.request.urlopen(url + "/v1/models", timeout=5).read()
                    break
                except OSError:
                    time.sleep(2)
            equal, overrides = 0, []
            for ids in arith_prompts(pair, n):
                body = {"model": "testbed", "prompt": ids, "max_tokens": 48, "temperature": 0, "return_token_ids": True}
                req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=300) as resp:
                    got = json.loads(resp.read())["choices"][0]["token_ids"]
                ref = api.generate(pair, prompt_ids=ids + got[:1], method="pad", policy=api.make_policy(pair, "pad"),
                                   max_new_tokens=47)
                equal += got == got[:1] + ref.token_ids
                overrides.append(ref.stats["override"])
            text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
            counters = "pivotspec:pad_overrides_total" in text and "vllm:spec_decode_num_draft_tokens" in text
            return {"problems": n, "equal": equal, "pad_overrides": overrides, "metrics": counters,
                    "ok": equal == n and counters and sum(overrides) > 0}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ar-problems", type=int, default=20)
    ap.add_argument("--served-problems", type=int, default=3)
    ap.add_argument("--override-problems", type=int, default=40)
    ap.add_argument("--checks", default="ar_parity,served_pad,override_rate", help="which checks, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_checks.json"))
    args = ap.parse_args()
    wanted = args.checks.split(",")
    unknown = sorted(set(wanted) - {"ar_parity", "served_pad", "override_rate"})
    if unknown:
        sys.exit(f"unknown check(s) {', '.join(unknown)}: choose from ar_parity, served_pad, override_rate")
    pair = api.load_pair(pair="testbed", dtype="float32")
    checks = {"ar_parity": lambda: ar_parity(pair, args.ar_problems),
              "served_pad": lambda: served_pad(pair, args.served_problems, Path(tempfile.mkdtemp()) / "serve.log"),
              "override_rate": lambda: override_rate(pair, args.override_problems)}
    result = {name: checks[name]() for name in wanted}
    for name, r in result.items():
        print(f"{name}: {'ok' if r['ok'] else 'FAILED'} {json.dumps({k: v for k, v in r.items() if k != 'ok'})}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    sys.exit(0 if all(r["ok"] for r in result.values()) else 1)


if __name__ == "__main__":
    main()
