"""This machine: its CPU's model name and instruction flags, which decide the fast paths and key what is
cached or compiled for one machine, and the directory where pivotspec keeps what it builds."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> Path:
    """Where converted checkpoints, measured verdicts and compiled kernels live: ``$PIVOTSPEC_CACHE``, default
    ``~/.cache/pivotspec``."""
    return Path(os.environ.get("PIVOTSPEC_CACHE", Path.home() / ".cache" / "pivotspec"))
