"""The code sandbox holds: every escape a hostile completion tried in review is contained by the kernel."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import time
from pathlib import Path

import pytest

from pivotspec.tasks.sandbox import run_code


def test_passing_and_failing_code():
    assert run_code("assert sum([1, 2]) == 3\nprint('ok')").passed
    r = run_code("assert 1 == 2")
    assert r.status == "failed" and "AssertionError" in r.output


@pytest.mark.parametrize("early_exit", ["import sys\nsys.exit(0)", "import os\nos._exit(0)",
                                        "raise SystemExit"])
def test_an_exit_before_the_tests_is_not_a_pass(early_exit):
    r = run_code(early_exit + "\nassert False, 'the tests'")
    assert r.returncode == 0 and r.status == "failed"  # exit status 0, but the tests never ran


def test_infinite_loop_is_killed():
    start = time.perf_counter()
    r = run_code("while True:\n    pass", timeout_s=2)
    assert r.status in ("timeout", "failed") and not r.passed
    assert time.perf_counter() - start < 10


def _processes_of(uid: int, settle_s: float = 5.0) -> list[str]:
    """Live processes of ``uid``, after giving a killed namespace up to ``settle_s`` to be torn down."""
    deadline = time.monotonic() + settle_s
    while (found := _live(uid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _live(uid: int) -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        lines = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if lines.get("Uid", "").split()[:1] == [str(uid)] and not lines.get("State", "").strip().startswith("Z"):
            out.append(pid)
    return out


def test_fork_bomb_is_bounded_and_leaves_nothing_behind():
    start = time.perf_counter()
    r = run_code("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=3)
    assert not r.passed and time.perf_counter() - start < 15
    if os.geteuid() == 0:
        assert _processes_of(65534) == []


def test_a_detached_child_holding_stdout_neither_delays_the_call_nor_survives_it(tmp_path):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')")
    start = time.perf_counter()
    r = run_code(code, timeout_s=3)
    assert time.perf_counter() - start < 6 and r.passed and "parent done" in r.output
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "time.sleep(60)" not in ps and (os.geteuid() != 0 or _processes_of(65534) == [])


def test_fork_and_exec_of_a_shell_cannot_write_outside(tmp_path):
    target = tmp_path / "shell-wrote-this"
    r = run_code(f"import posix\npid = posix.fork()\nif pid == 0:\n    posix.execv('/bin/sh', ['sh', '-c', "
                 f"'touch {target}; id -u > /tmp/uid'])\nposix.waitpid(pid, 0)\nprint(open('/tmp/uid').read())")
    assert not target.exists()
    assert r.output.strip().splitlines()[-1] == "65534"  # nobody inside the namespace


@pytest.mark.parametrize("how", [
    "io.FileIO({p!r}, 'w').write(b'x')",
    "posix.close(posix.open({p!r}, posix.O_WRONLY | posix.O_CREAT))",
    "sqlite3.connect({p!r}).execute('create table t (x)')",
    "os.mkdir({p!r})",
    "ctypes.CDLL(None).creat({p!r}.encode(), 0o644)",
])
def test_writes_outside_its_directory_are_contained(tmp_path, how):
    target = tmp_path / "outside"
    code = ("import io, os, posix, sqlite3, sys\nsys.modules.pop('ctypes', None)\nimport ctypes\n"
            + how.format(p=str(target)))
    run_code(code)
    assert not target.exists()


@pytest.mark.parametrize("how", ["posix.unlink({p!r})", "os.remove({p!r})",
                                 "ctypes.CDLL(None).unlink({p!r}.encode())"])
def test_deleting_host_files_is_contained(tmp_path, how):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    victim.chmod(0o666)
    run_code("import os, posix, ctypes\n" + how.format(p=str(victim)))
    assert victim.read_text() == "keep me"


def test_cannot_signal_host_processes():
    host = subprocess.Popen(["sleep", "30"])  # a host process the candidate knows the pid of
    try:
        run_code(f"import os, signal\nfor pid in ({host.pid}, os.getppid(), 1):\n    try:\n"
                 "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass")
        assert host.poll() is None  # still running: host pids are not even visible in its PID namespace
    finally:
        host.kill()


def test_network_is_blocked():
    r = run_code("import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=2)\nprint('connected')",
                 timeout_s=5)
    assert not r.passed and "connected" not in r.output
    r = run_code("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9', timeout=2)", timeout_s=5)
    assert not r.passed


def test_host_unix_sockets_are_unreachable(tmp_path):
    path = str(tmp_path / "host.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(0.1)
    try:
        r = run_code(f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\nprint('reached')",
                     timeout_s=5)
        assert not r.passed and "reached" not in r.output
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_output_flood_is_capped_in_the_caller():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_code("import sys\nfor _ in range(200):\n    sys.stdout.write('x' * 1_000_000)\nprint('end')",
                 timeout_s=20)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert r.passed and r.output.endswith("end") and len(r.output) <= 2000
    assert grown_mb < 50


def test_memory_limit():
    r = run_code("x = bytearray(4 * 1024 ** 3)", memory_mb=256)
    assert not r.passed and "MemoryError" in r.output


def test_disk_filling_is_bounded():
    r = run_code("i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (8 << 20))\n    i += 1", timeout_s=5)
    assert not r.passed and ("No space left" in r.output or "File too large" in r.output)


def test_code_tasks_refuse_to_run_without_isolation(monkeypatch, capsys):
    from pivotspec.cli import main
    from pivotspec.tasks import sandbox

    sandbox.check_available.cache_clear()
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    try:
        assert main(["eval", "--target", "nowhere/model", "--task", "humaneval", "--methods", "ar", "--n", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "bubblewrap is missing" in err
        with pytest.raises(sandbox.SandboxUnavailable):
            run_code("print(1)")
    finally:
        sandbox.check_available.cache_clear()
