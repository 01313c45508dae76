"""Small C kernels compiled once per machine with the system's C compiler (``cc``, ``gcc`` or ``$CC``) and
loaded with ctypes: the per-query attention (``query_attention``) and the row-wise linear (``rowwise``).

Why C and not a PyTorch extension: no build step at install and no compiler headers for torch, only a C
compiler, which every Linux image that built llama.cpp or numpy has; where none is found the callers keep
PyTorch's own kernels. Each library is built for this CPU (``-march=native``) and cached under
``$PIVOTSPEC_CACHE/kernels`` keyed by its source, flags, compiler and the CPU's name and flags, so a source
change or another machine builds anew. Both are compiled with ``-ffp-contract=off``: a multiply and an add are
fused where the source says so and nowhere else, so that the order of every sum is the code's.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from pivotspec.decoding.machine import cache_dir, cpu_flags, cpu_name

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp")
log = logging.getLogger("pivotspec")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(source: Path, cc: str) -> Path:
    """Where ``source`` built by ``cc`` for this CPU lives: keyed by source, flags, compiler and CPU."""
    ident = "|".join([source.read_text(), *FLAGS, cc, cpu_name(), *sorted(cpu_flags())])
    return cache_dir() / "kernels" / f"{source.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.so"


def load(source: Path, symbol: str, argtypes: list, restype: type = ctypes.c_int) -> ctypes._CFuncPtr | None:
    """``symbol`` of ``source`` compiled for this CPU (built on first use), or None where it cannot be built
    here (the reason logged)."""
    cc = compiler()
    if cc is None:
        log.info("no C compiler found: %s stays with PyTorch's kernels", source.name)
        return None
    path = library_path(source, cc)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.so")
        try:
            built = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(source), "-lm"], capture_output=True,
                                   text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as err:
            log.warning("%s did not build (%s): PyTorch's kernels run instead", source.name, err)
            return None
        if built.returncode != 0:
            log.warning("%s did not build (%s): PyTorch's kernels run instead", source.name,
                        built.stderr.strip()[-500:])
            return None
        os.replace(tmp, path)  # atomic: processes building at once each write their own file
    function = getattr(ctypes.CDLL(str(path)), symbol)
    function.argtypes, function.restype = argtypes, restype
    return function
