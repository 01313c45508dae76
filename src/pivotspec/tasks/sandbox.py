"""Run generated code confined by the kernel: the only way code tasks execute completions.

An in-process guard cannot be made tight (ctypes, posix.*, sqlite3 all reach the system), so the isolation
comes from the kernel, through bubblewrap (Debian package ``bubblewrap``):

- new user, PID, network, IPC, UTS and cgroup namespaces: the code sees no network interface but a down
  loopback, no host process (every descendant dies with the namespace), and cannot signal its caller;
- when pivotspec runs as root, the sandbox runs as uid/gid 65534 (nobody) outside the namespace too, so
  ``RLIMIT_NPROC`` binds (it never binds root) and host files are only as open as they are to nobody;
- a file system of read-only binds (``/usr``, ``/lib``, ``/bin`` and the interpreter's prefix) plus two
  small tmpfs mounts (its working directory and ``/tmp``, 64 MB each): nothing of the host is writable,
  and no host socket file is visible;
- CPU, address-space, file-size and process limits set before the sandbox starts, a wall-clock kill of
  the whole namespace, and output read through a capped buffer.

The program arrives on standard input, not as a file. A run passes only when it exits 0 AND prints, after
the last line of the program (its tests), a marker the wrapper was given on standard input: an early
``sys.exit(0)`` or ``os._exit(0)`` is a failure. The marker is not a secret from code that walks the
interpreter's frames; it guards the pass count against early exits, the kernel guards the machine.
If the kernel or the machine cannot provide this isolation, code tasks refuse to run.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from pivotspec.errors import UsageError

NOBODY = 65534
OUTPUT_TAIL = 64 * 1024  # bytes of output kept (the rest is read and dropped)
TMPFS_BYTES = 64 << 20

# Runs inside the sandbox: read marker and program from stdin, run the program, print the marker after it.
WRAPPER = r'''
import os, sys
marker = sys.stdin.readline().strip()
code = sys.stdin.read()
fd = os.open(os.devnull, os.O_RDONLY)
os.dup2(fd, 0)
os.close(fd)
exec(compile(code, "candidate.py", "exec"), {"__name__": "__main__"})
sys.stdout.flush()
sys.stdout.write("\n" + marker + "\n")
sys.stdout.flush()
'''


class SandboxUnavailable(UsageError):
    """The kernel or the machine cannot isolate generated code; code tasks must not run."""


@dataclass
class SandboxResult:
    status: str  # passed | failed | timeout
    returncode: int | None
    output: str  # last 2,000 characters of stdout + stderr (marker removed)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _open_to_others(path: Path) -> bool:
    """Whether uid nobody can reach and run ``path`` (every directory above it searchable by others)."""
    path = path.resolve()
    for p in [path, *path.parents]:
        mode = p.stat().st_mode
        if not mode & stat.S_IXOTH or (p == path and not mode & stat.S_IROTH):
            return False
    return True


def _interpreter(drop_to_nobody: bool) -> Path:
    """A Python 3 the sandbox can run: this one, or (when this one lives where nobody cannot reach, such
    as under /root) the system's."""
    own = Path(os.path.realpath(sys.executable))
    if not drop_to_nobody or _open_to_others(own):
        return own
    system = Path("/usr/bin/python3")
    if system.exists() and _open_to_others(system):
        return system.resolve()
    raise SandboxUnavailable(f"no Python that uid {NOBODY} may run ({own} is not reachable by it): install "
                             "python3 from the distribution, or run pivotspec as a non-root user")


def _command(python: Path) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("code tasks run generated code only under kernel isolation, and bubblewrap is "
                                 "missing: install it (apt-get install bubblewrap)")
    prefix = python.parent.parent  # .../bin/python3 -> the installation prefix (stdlib lives under it)
    binds = ["/usr", "/lib", "/lib64", "/bin", str(prefix)]
    cmd = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for path in dict.fromkeys(binds):
        cmd += ["--ro-bind-try", path, path]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp",
            "--size", str(TMPFS_BYTES), "--tmpfs", "/sandbox", "--chdir", "/sandbox", "--clearenv",
            "--setenv", "HOME", "/sandbox", "--setenv", "TMPDIR", "/tmp", "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONHASHSEED", "0",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            str(python), "-I", "-c", WRAPPER]
    return cmd


def _limits(cpu_s: int, memory_mb: int, drop_to_nobody: bool) -> None:
    """In the child, before bubblewrap starts: limits its whole tree inherits; then, if root, become nobody."""
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if drop_to_nobody:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


@functools.cache
def check_available() -> None:
    """Raise SandboxUnavailable (one line) unless a trivial program runs confined; cached per process."""
    drop = os.geteuid() == 0
    cmd = _command(_interpreter(drop))
    try:
        proc = subprocess.run(cmd, input=b"M\nprint('ok')\n", capture_output=True, timeout=30,
                              preexec_fn=lambda: _limits(10, 1024, drop))  # noqa: PLW1509
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailable(f"cannot start the code sandbox ({exc}): code tasks need bubblewrap and user "
                                 "namespaces") from None
    if proc.returncode != 0 or b"ok" not in proc.stdout:
        why = (proc.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise SandboxUnavailable(f"the kernel refused the code sandbox ({why}): code tasks need unprivileged user "
                                 "namespaces (sysctl kernel.unprivileged_userns_clone=1) and will not run unconfined")


def _drain(stream, keep: bytearray) -> None:
    """Read everything, keep only the last OUTPUT_TAIL bytes: a flood of output cannot fill our memory."""
    while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
        keep.extend(chunk)
        if len(keep) > OUTPUT_TAIL:
            del keep[: len(keep) - OUTPUT_TAIL]


def run_code(code: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> SandboxResult:
    """Run ``code`` as a program in the sandbox; passed = exit status 0 and the end-of-program marker seen."""
    check_available()
    drop = os.geteuid() == 0
    marker = "PIVOTSPEC-END-" + secrets.token_hex(16)
    proc = subprocess.Popen(_command(_interpreter(drop)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: _limits(int(timeout_s) + 1, memory_mb, drop))  # noqa: PLW1509
    tail = bytearray()
    reader = threading.Thread(target=_drain, args=(proc.stdout, tail), daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.stdin.write(marker.encode() + b"\n" + code.encode("utf-8", errors="surrogatepass"))
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the program ended before reading all of itself (it cannot pass without the marker anyway)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_group(proc)  # the namespace dies with bubblewrap: nothing the candidate started outlives it
        proc.wait()
        reader.join(timeout=5)
    text = bytes(tail).decode(errors="replace")
    seen = text.rstrip().endswith(marker)
    output = text.replace(marker, "").rstrip()[-2000:]
    if timed_out:
        return SandboxResult("timeout", None, output)
    status = "passed" if proc.returncode == 0 and seen else "failed"
    return SandboxResult(status, proc.returncode, output)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
