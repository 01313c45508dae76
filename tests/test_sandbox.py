"""The code sandbox: limits, network, writes outside its directory."""

from __future__ import annotations

import time
from pathlib import Path

from pivotspec.sandbox import run_code


def test_passing_and_failing_code():
    assert run_code("assert sum([1, 2]) == 3\nprint('ok')").passed
    r = run_code("assert 1 == 2")
    assert r.status == "failed" and "AssertionError" in r.output


def test_infinite_loop_is_killed():
    start = time.perf_counter()
    r = run_code("while True:\n    pass", timeout_s=2)
    assert r.status in ("timeout", "failed") and not r.passed
    assert time.perf_counter() - start < 10


def test_fork_bomb_is_stopped():
    start = time.perf_counter()
    r = run_code("import os\nwhile True:\n    os.fork()", timeout_s=3)
    assert not r.passed and time.perf_counter() - start < 15
    r = run_code("import subprocess\nsubprocess.Popen(['sleep', '100'])", timeout_s=3)
    assert not r.passed


def test_network_is_blocked():
    r = run_code("import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=2)\nprint('connected')",
                 timeout_s=5)
    assert not r.passed and "connected" not in r.output
    r = run_code("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9', timeout=2)", timeout_s=5)
    assert not r.passed


def test_writes_outside_its_directory_are_blocked(tmp_path):
    target = tmp_path / "outside.txt"
    r = run_code(f"open({str(target)!r}, 'w').write('x')")
    assert not r.passed and not target.exists()
    r = run_code(f"import os\nos.remove({str(Path(__file__))!r})")
    assert not r.passed and Path(__file__).exists()
    assert run_code("open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())").passed


def test_memory_limit():
    r = run_code("x = bytearray(4 * 1024 ** 3)", memory_mb=256)
    assert not r.passed and "MemoryError" in r.output
