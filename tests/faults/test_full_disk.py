"""A full filesystem mid-save: a clear error, the previous checkpoint intact, the next save works.

Two real ways to run out of space, no fault backend:

- ``RLIMIT_FSIZE`` in a real rank process (SIGXFSZ ignored, so an oversized write fails with
  ``EFBIG`` instead of killing the process); "freeing space" is raising the limit again.
- A small tmpfs mounted by the test (needs root and mount permission; skipped with the reason
  otherwise): the save fails with ``ENOSPC``; ``clean_incomplete`` frees the torn save's space and
  the next save fits.
"""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest
import torch

import cpuckpt
from cpuckpt import StorageIOError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CFG = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 30}


def state(k: int, nfloats: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {"w": torch.randn(nfloats, generator=g), "step": k}


def _loads_as(path: Path, k: int, nfloats: int) -> bool:
    out = {"w": torch.zeros(nfloats), "step": None}
    cpuckpt.load(out, path, CFG)
    return torch.equal(out["w"], state(k, nfloats)["w"]) and out["step"] == k


def rank_fsize_limited(root: str) -> dict:
    """In a rank process: save, cap file size, fail a bigger save, lift the cap, save again."""
    import resource
    import signal

    root_p = Path(root)
    cpuckpt.save(state(1, 20_000), root_p / "step_0001", CFG, step=1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
    err: dict = {}
    try:
        cpuckpt.save(state(2, 200_000), root_p / "step_0002", CFG, step=2)  # ~800 KB file
    except StorageIOError as e:
        err = {"type": type(e).__name__, "errno": e.errno, "path": e.path, "offset": e.offset, "message": str(e)}
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    after_fail = str(cpuckpt.find_latest(root_p))
    cpuckpt.save(state(3, 200_000), root_p / "step_0003", CFG, step=3)
    return {"err": err, "after_fail": after_fail, "latest": str(cpuckpt.find_latest(root_p))}


def test_file_size_limit_mid_save(run_ranks, tmp_path):
    root = tmp_path / "root"
    (res,) = run_ranks(1, rank_fsize_limited, str(root), timeout_s=120)
    err = res["err"]
    assert err, "the save over the file size limit did not fail"
    # The error crossed DCP's gather (a pickle round trip), which keeps only the message: errno,
    # path and offset attributes come back None (errors.StorageIOError has no __reduce__).
    assert f"[errno {errno.EFBIG}]" in err["message"], err["message"]
    assert str(root / "step_0002" / "__0_0.distcp") in err["message"] and "at offset" in err["message"]
    assert "File too large" in err["message"] and "__0_0.distcp" in err["message"]
    assert res["after_fail"] == str(root / "step_0001")
    assert not (root / "step_0002" / ".metadata").exists()
    assert res["latest"] == str(root / "step_0003")
    assert _loads_as(root / "step_0001", 1, 20_000)
    assert _loads_as(root / "step_0003", 3, 200_000)


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "cpuckpt-test", str(mnt)],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)


def test_full_tmpfs_mid_save(small_tmpfs):
    root = small_tmpfs
    cpuckpt.save(state(1, 100_000), root / "step_0001", CFG, step=1)  # ~400 KB of 2 MiB
    with pytest.raises(StorageIOError) as ei:
        cpuckpt.save(state(2, 500_000), root / "step_0002", CFG, step=2)  # ~2 MB: does not fit
    e = ei.value
    assert e.errno == errno.ENOSPC, e
    assert "step_0002" in str(e) and "No space left" in str(e), e
    assert not (root / "step_0002" / ".metadata").exists()
    assert cpuckpt.find_latest(root) == root / "step_0001"
    assert _loads_as(root / "step_0001", 1, 100_000)
    removed = cpuckpt.clean_incomplete(root)  # frees the torn save's space
    assert root / "step_0002" in removed
    cpuckpt.save(state(3, 300_000), root / "step_0003", CFG, step=3)  # ~1.2 MB: fits now
    assert cpuckpt.find_latest(root) == root / "step_0003"
    assert _loads_as(root / "step_0003", 3, 300_000) and _loads_as(root / "step_0001", 1, 100_000)
