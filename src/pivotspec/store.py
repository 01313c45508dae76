"""Append-only JSONL files that survive being killed: one record per line, flushed and fsynced.

A process killed mid-write leaves at most a truncated last line; ``read_records`` drops it (with a
warning) and cuts the file back to the last complete record, so a rerun appends cleanly after it.

A finished file may be stored compressed beside its name (``results.jsonl.gz``, made with ``gzip -9n``: the
benchmark rows and labels files kept in the repository are, so the tracked tree fits a device call):
``exists``, ``read_records`` and ``open_bytes`` see it when the plain file is absent, and ``open_for_append``
restores the plain file first, so a rerun resumes. Each takes either name (``plain``): a user who passes the
``.gz`` file gets the same records and the same content hash as one who passes the plain name.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from pivotspec.errors import UsageError


def plain(path: Path) -> Path:
    """The plain name of ``path`` (``labels.jsonl`` for ``labels.jsonl.gz``; any other name as it is)."""
    path = Path(path)
    return path.with_name(path.name[:-3]) if path.name.endswith(".jsonl.gz") else path


def compressed(path: Path) -> Path:
    """Where ``path`` is kept compressed."""
    return path.with_name(path.name + ".gz")


def exists(path: Path) -> bool:
    """Whether ``path`` is there as a plain file or compressed beside its name."""
    path = plain(path)
    return path.is_file() or compressed(path).is_file()


def open_bytes(path: Path) -> BinaryIO:
    """``path`` open for reading its plain bytes, from the compressed copy when the plain file is absent (so a
    file's content hash is the same either way)."""
    path = plain(path)
    return path.open("rb") if path.exists() else gzip.open(compressed(path), "rb")


def content_digest(path: Path) -> str:
    """First 16 hex digits of the SHA-256 of ``path``'s plain content (compressed or not), read in chunks."""
    import hashlib

    h = hashlib.sha256()
    with open_bytes(path) as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()[:16]


def restore(path: Path) -> None:
    """Put back the plain file of a compressed one (no-op when the plain file exists or none is compressed)."""
    gz = compressed(path)
    if path.exists() or not gz.is_file():
        return
    tmp = path.with_name(f"{path.name}.restoring-{os.getpid()}")
    tmp.write_bytes(gzip.decompress(gz.read_bytes()))
    tmp.replace(path)
    gz.unlink(missing_ok=True)


def read_records(path: Path, repair: bool = True) -> list[dict[str, Any]]:
    """All complete records of ``path``, or of its compressed copy when only that exists ([] if neither does).
    A malformed line before the last is a UsageError: that file was not written by us or was edited by hand."""
    path = plain(path)
    if not path.exists():
        if compressed(path).is_file():
            return parse_records(gzip.decompress(compressed(path).read_bytes()), compressed(path), repair=False)
        return []
    if not path.is_file():
        raise UsageError(f"{path} is not a file: give a JSONL file path")
    return parse_records(path.read_bytes(), path, repair)


def parse_records(data: bytes, path: Path, repair: bool) -> list[dict[str, Any]]:
    """The records in ``data`` (the bytes of ``path``); ``repair`` cuts a torn last line off ``path``."""
    records, offset = [], 0
    lines = data.split(b"\n")
    for n, line in enumerate(lines, 1):
        last = n == len(lines)
        if not line.strip():
            offset += len(line) + (0 if last else 1)
            continue
        try:
            obj = json.loads(line)
            if last:  # a complete record always ends with a newline
                raise ValueError("no trailing newline")
            if not isinstance(obj, dict):
                raise ValueError("not an object")
        except ValueError:
            if last or n == len(lines) - 1 and not lines[-1]:
                print(f"pivotspec: warning: dropping truncated last line {n} of {path}", file=sys.stderr)
                if repair:
                    with path.open("r+b") as fh:
                        fh.truncate(offset)
                break
            raise UsageError(f"{path}:{n}: malformed JSON line: fix or remove the file (or pass --overwrite)") from None
        records.append(obj)
        offset += len(line) + 1
    return records


def lock_for_append(fh: TextIO, path: Path) -> None:
    """Take an exclusive lock on an open output file, so two runs cannot append to it at once (the
    second would redo and duplicate what the first is doing)."""
    import fcntl

    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"another pivotspec process is writing {path}: wait for it or stop it first") from None


@contextmanager
def open_for_append(path: Path, overwrite: bool = False) -> Iterator[TextIO]:
    """``path`` open for appending and locked while the block runs; ``overwrite`` empties it first. The lock
    comes before anything reads the file, so a second run cannot cut the first's half-written last line
    while checking what is there."""
    path = plain(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    restore(path)
    with path.open("a") as fh:
        lock_for_append(fh, path)
        if overwrite:
            fh.truncate(0)
        yield fh


def append_record(fh: TextIO, record: dict[str, Any]) -> None:
    """Write one record as one line, then flush and fsync so a crash cannot lose it."""
    fh.write(json.dumps(record) + "\n")
    fh.flush()
    os.fsync(fh.fileno())


def read_user_jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    """A user's JSONL input file (prompts, data): strict, every problem a one-line UsageError naming the line."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {str(path)!r} is a directory: give a JSONL file")
    if not path.is_file():
        raise UsageError(f"{what} {str(path)!r} does not exist: check the path")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} {str(path)!r} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {str(path)!r} ({exc.strerror}): check its permissions") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise UsageError(f"{path}:{n}: not valid JSON: the file must be JSONL, one object per line") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{path}:{n}: each line must be a JSON object")
        rows.append(obj)
    if not rows:
        raise UsageError(f"{what} {str(path)!r} has no records: write one JSON object per line")
    return rows


def ensure_writable_dir(path: Path) -> None:
    """Create ``path`` if needed; a file there, or a directory that cannot be created or written, is a
    one-line error (checked before any model loads, not after)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} is a file, not a directory: choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {path} ({exc.strerror}): choose a writable --out") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{path} is not writable: choose a writable --out")


def check_output_dir(path: Path, overwrite: bool, *ours: str) -> None:
    """Refuse to write into a directory that already holds something, unless ``overwrite``: a second run
    must not silently replace a trained classifier or a finished report. Called before any model loads.
    ``ours`` names files that mark the directory as this command's own output (replaced on --overwrite)."""
    path = Path(path)
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        what = "an earlier result" if any((path / f).exists() for f in ours) else "other files"
        raise UsageError(f"{path} already holds {what}: pass --overwrite to replace it, or choose another --out")
    ensure_writable_dir(path)
