"""Server counters in the Prometheus text format, under vLLM's names where vLLM has one (counters end in
``_total`` in the exposition, as vLLM's do).

| pivotspec name | meaning | vLLM's |
|---|---|---|
| pivotspec:spec_decode_num_drafts | verification steps that checked draft tokens | vllm:spec_decode_num_drafts |
| pivotspec:spec_decode_num_draft_tokens | draft tokens proposed | vllm:spec_decode_num_draft_tokens |
| pivotspec:spec_decode_num_accepted_tokens | draft tokens kept | vllm:spec_decode_num_accepted_tokens |
| pivotspec:pad_overrides | draft tokens SD rejected that PAD (or a relaxed rule) kept | - |
| pivotspec:request_latency_seconds | request wall time, histogram | vllm:e2e_request_latency_seconds |
| pivotspec:time_to_first_token_seconds | arrival to first token, histogram | vllm:time_to_first_token_seconds |
| pivotspec:num_requests_waiting / _running | queued / in the batch | vllm:num_requests_waiting / _running |
| pivotspec:prefix_cache_queries / _hits | prompt tokens / of them already held | vllm:prefix_cache_queries / _hits |
"""

from __future__ import annotations

import threading
from typing import Any

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
COUNTERS = {
    "spec_decode_num_drafts": "Verification steps that checked at least one draft token.",
    "spec_decode_num_draft_tokens": "Draft tokens proposed.",
    "spec_decode_num_accepted_tokens": "Draft tokens kept, by lossless SD or by an override.",
    "pad_overrides": "Draft tokens SD rejected that PAD or a relaxed rule kept.",
    "generation_tokens": "Tokens generated.",
    "prompt_tokens": "Prompt tokens processed.",
    "prefix_cache_queries": "Prompt tokens looked up in the batch's keys (prefix caching).",
    "prefix_cache_hits": "Prompt tokens whose keys the batch already held, so they were not computed again.",
    "request_success": "Requests finished.",
    "request_failure": "Requests that ended in an error.",
}


def speculative_metrics(stats: dict[str, Any]) -> dict[str, Any]:
    """Per-response statistics, named like vLLM's per-request spec-decode metrics plus pivotspec's own."""
    steps = stats["target_forwards"] if stats["drafted"] else 0
    kept = stats["accepted"] + stats["override"]
    return {"num_drafts": steps, "num_draft_tokens": stats["drafted"], "num_accepted_tokens": kept,
            "mean_acceptance_length": (stats["new_tokens"] / stats["target_forwards"]
                                       if stats["target_forwards"] else None),
            "acceptance_rate": kept / stats["drafted"] if stats["drafted"] else None,
            "pad_overrides": stats["override"], "corrections": stats["corrected"], "bonus_tokens": stats["bonus"]}


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.histograms = {"request_latency_seconds": [], "time_to_first_token_seconds": []}
        self.waiting = self.running = 0

    def add_response(self, stats: dict[str, Any]) -> None:
        spec = speculative_metrics(stats)
        with self.lock:
            self.counters["spec_decode_num_drafts"] += spec["num_drafts"]
            self.counters["spec_decode_num_draft_tokens"] += spec["num_draft_tokens"]
            self.counters["spec_decode_num_accepted_tokens"] += spec["num_accepted_tokens"]
            self.counters["pad_overrides"] += spec["pad_overrides"]
            self.counters["generation_tokens"] += stats["new_tokens"]
            self.counters["prompt_tokens"] += stats.get("prompt_tokens", 0)
            self.counters["prefix_cache_queries"] += stats.get("prompt_tokens", 0)
            self.counters["prefix_cache_hits"] += stats.get("cached_prompt_tokens", 0)

    def set_queue(self, waiting: int, running: int) -> None:
        """Requests queued for a free row, and rows decoding (vLLM's num_requests_waiting / _running)."""
        with self.lock:
            self.waiting, self.running = waiting, running

    def count(self, name: str) -> None:
        with self.lock:
            self.counters[name] += 1

    def observe(self, name: str, seconds: float) -> None:
        with self.lock:
            self.histograms[name].append(seconds)

    def render(self) -> str:
        lines = []
        with self.lock:
            for name, help_text in COUNTERS.items():
                lines += [f"# HELP pivotspec:{name}_total {help_text}", f"# TYPE pivotspec:{name}_total counter",
                          f"pivotspec:{name}_total {self.counters[name]}"]
            for name, value in (("num_requests_waiting", self.waiting), ("num_requests_running", self.running)):
                lines += [f"# TYPE pivotspec:{name} gauge", f"pivotspec:{name} {value}"]
            for name, values in self.histograms.items():
                lines.append(f"# TYPE pivotspec:{name} histogram")
                for bound in BUCKETS:
                    lines.append(f'pivotspec:{name}_bucket{{le="{bound}"}} {sum(v <= bound for v in values)}')
                lines += [f'pivotspec:{name}_bucket{{le="+Inf"}} {len(values)}',
                          f"pivotspec:{name}_sum {sum(values)}", f"pivotspec:{name}_count {len(values)}"]
        return "\n".join(lines) + "\n"
