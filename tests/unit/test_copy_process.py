"""The memory tier's copy process (``memory.copy_process``): a save's checksums (and, on a GPU with a device
snapshot, its copies: tests/gpu/test_copy_process_gpu.py) computed by a process of ours, not the trainer's.

Single trainer process, real RAM-root files, a real copy process (``python -m cpuckpt.tier.copier``).
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import crc32c
import pytest
import torch

import cpuckpt
from cpuckpt.backend.committed import read_manifest
from cpuckpt.errors import CpuckptError
from cpuckpt.tier import copier
from cpuckpt.tier.images import ImageFile
from cpuckpt.tier.memory import MemoryTier


def _cfg(tmp_path: Path, **memory: object) -> dict:
    return {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60,
            "memory": {"root": str(tmp_path / "ram"), "persist_every": 0, "slots": 2, "headroom_bytes": 0,
                       "copy_process": True, **memory}}


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 257, generator=g), "b": torch.randn(77, generator=g).to(torch.bfloat16),
            "step": step}


def _check(path: Path, step: int) -> None:
    """The checkpoint at ``path`` holds ``step``'s values, and every chunk's recorded crc32c is its bytes'."""
    out = {"w": torch.empty(300, 257), "b": torch.empty(77, dtype=torch.bfloat16), "step": -1}
    cpuckpt.load(out, path)
    want = _state(step)
    assert out["step"] == step and torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
    manifest = read_manifest(path)
    checked = 0
    for entry in manifest.files.values():
        data = (path / entry.name).read_bytes()
        assert entry.checksum == "crc32c" and len(entry.chunk_checksums) == -(-len(data) // entry.chunk_bytes)
        for k, crc in enumerate(entry.chunk_checksums):
            assert crc == crc32c.crc32c(data[k * entry.chunk_bytes : (k + 1) * entry.chunk_bytes]), (entry.name, k)
            checked += 1
    assert checked > 1


def test_memory_saves_are_checksummed_by_the_copy_process_and_load_bit_exact(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path))
    try:
        assert tier.copier is not None
        for step in (1, 2, 3):
            tier.save(_state(step), step).wait()
            pid = tier.copier.pid
            assert pid is not None and pid != os.getpid()
            _check(tier.find_latest(), step)
        assert tier.copier.pid == pid, "one copy process serves every save"
    finally:
        tier.close(persist_newest=False)
    assert tier.copier.pid is None, "close() ends the copy process"


def test_without_checksums_the_copy_process_records_none(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, checksum=False))
    try:
        tier.save(_state(1), 1).wait()
        (entry,) = read_manifest(tier.find_latest()).files.values()
        assert entry.checksum == "none" and entry.chunk_checksums == []
    finally:
        tier.close(persist_newest=False)


def test_a_copy_process_killed_during_a_save_fails_it_naming_the_process_and_the_next_save_starts_another(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path))
    try:
        tier.save(_state(1), 1).wait()
        pid = tier.copier.pid
        os.kill(pid, signal.SIGSTOP)  # it holds the next save without answering
        handle = tier.save(_state(2), 2)
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(CpuckptError, match=rf"copy process \(pid {pid}\) exited with status -9"):
            handle.wait()
        assert tier.find_latest() is not None and _check(tier.find_latest(), 1) is None, "the failed save is listed"
        tier.save(_state(3), 3).wait()
        assert tier.copier.pid not in (None, pid)
        _check(tier.find_latest(), 3)
    finally:
        tier.close(persist_newest=False)


def test_an_images_identity_changes_with_its_size_and_mapping_not_with_a_save_of_the_same_size(tmp_path):
    img = ImageFile(tmp_path / "f", pin=False)
    try:
        img.ensure(100_000)
        first = img.identity
        img.ensure(100_000)
        assert img.identity == first, "a save of the same size would make the copy process map and pin it again"
        img.ensure(50_000)
        shrunk = img.identity
        assert shrunk != first
        img.ensure(100_000)
        assert img.identity not in (first, shrunk), "after shrinking and growing back the pages are new"
        other = ImageFile(tmp_path / "f", pin=False)
        other.ensure(100_000)
        assert other.identity != img.identity
        other.close()
    finally:
        img.close()


def test_a_message_naming_a_class_is_refused():
    assert copier._loads(copier._dumps(("save", 1, [("p", "i", 3)], [(0, 0, 3)], 64, True, None)))[0] == "save"
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        copier._loads(pickle.dumps(("save", torch.device("cpu"))))
