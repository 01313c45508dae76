"""PAD's step counts, shared between vLLM's processes without a message channel.

Each worker process owns one small memory-mapped file (``<dir>/<pid>.counts``, int64 per field) and adds to
it every step; the API server (its ``/metrics``) and the offline worker read the sum of all files. Writes are
plain stores into shared pages, so counting costs a step nothing measurable and a reader never blocks one.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

FIELDS = ("steps", "draft_tokens", "kept_by_sd", "overrides")


class Counter:
    """This process's counts in ``directory``."""

    def __init__(self, directory: str | Path):
        path = Path(directory) / f"{os.getpid()}.counts"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.values = np.memmap(path, dtype=np.int64, mode="w+", shape=(len(FIELDS),))

    def add(self, **counts: int) -> None:
        for name, n in counts.items():
            self.values[FIELDS.index(name)] += int(n)


def totals(directory: str | Path) -> dict[str, int]:
    """The sum over every process's file in ``directory`` (zeros when none has counted yet)."""
    out = dict.fromkeys(FIELDS, 0)
    for path in Path(directory).glob("*.counts"):
        try:
            values = np.fromfile(path, dtype=np.int64, count=len(FIELDS))
        except OSError:  # a file being created right now
            continue
        for name, v in zip(FIELDS, values, strict=False):
            out[name] += int(v)
    return out


def register_metrics(directory: str | Path) -> None:
    """Serve the counts beside vLLM's ``vllm:spec_decode_*`` metrics on its ``/metrics`` (prometheus_client's
    default registry, which vLLM's API server exposes), read from the files at each scrape."""
    from prometheus_client import REGISTRY
    from prometheus_client.core import CounterMetricFamily

    help_text = {"steps": "Verification steps PAD judged", "draft_tokens": "Draft tokens PAD judged",
                 "kept_by_sd": "Draft tokens the lossless rule accepted",
                 "overrides": "Draft tokens only PAD's override kept (the lossless rule rejected them)"}

    class PadCollector:
        def collect(self):
            for name, value in totals(directory).items():
                family = CounterMetricFamily(f"pivotspec:pad_{name}", help_text[name])
                family.add_metric([], value)
                yield family

    REGISTRY.register(PadCollector())
