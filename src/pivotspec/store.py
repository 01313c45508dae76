"""Append-only JSONL files that survive being killed: one record per line, flushed and fsynced.

A process killed mid-write leaves at most a truncated last line; ``read_records`` drops it (with a
warning) and cuts the file back to the last complete record, so a rerun appends cleanly after it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from pivotspec.errors import UsageError


def read_records(path: Path, repair: bool = True) -> list[dict[str, Any]]:
    """All complete records of ``path`` ([] if it does not exist). A malformed line before the last is
    a UsageError: that file was not written by us or was edited by hand."""
    if not path.exists():
        return []
    if not path.is_file():
        raise UsageError(f"{path} is not a file: give a JSONL file path")
    data = path.read_bytes()
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


def append_record(fh: TextIO, record: dict[str, Any]) -> None:
    """Write one record as one line, then flush and fsync so a crash cannot lose it."""
    fh.write(json.dumps(record) + "\n")
    fh.flush()
    os.fsync(fh.fileno())
