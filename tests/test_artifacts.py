"""The shipped testbed weights are kept packed (``.safetensors.xz``) and unpacked to the very same bytes."""

from __future__ import annotations

import lzma

import pytest
from safetensors.torch import load

from pivotspec.errors import UsageError
from pivotspec.testbed.artifacts import DATA, HARD, stored, weights_bytes

SHIPPED = [d / f for d in (DATA, HARD) for f in ("target_lora.safetensors", "draft/model.safetensors")]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(DATA)))
def test_shipped_weights_unpack_to_safetensors(path):
    assert stored(path).suffix == ".xz"  # packed, so the tracked tree fits a device call
    tensors = load(weights_bytes(path))
    assert len(tensors) > 30 and all(t.numel() for t in tensors.values())


def test_plain_file_wins_and_missing_is_one_line(tmp_path):
    path = tmp_path / "w.safetensors"
    path.with_name("w.safetensors.xz").write_bytes(lzma.compress(b"packed"))
    assert weights_bytes(path) == b"packed"
    path.write_bytes(b"plain")  # a freshly trained file, not packed yet
    assert weights_bytes(path) == b"plain"
    with pytest.raises(UsageError, match="other.safetensors is missing .*reinstall"):
        weights_bytes(tmp_path / "other.safetensors")


def test_tracked_tree_leaves_room_for_a_device_call():
    """A device call carries at most 64 MiB: the tracked tree plus ``.device/`` (the server's wheels and
    SmolLM2's tokenizer, 3.7 MiB; ``device_check.sh prepare``). Past 59 MiB the GPU check cannot travel."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [root / name for name in listed.decode().split("\0") if name]
    size = sum(f.stat().st_size for f in files if f.is_file())
    assert size <= 59 * 2**20, f"tracked files take {size / 2**20:.1f} MiB: compress or drop results (see README)"
