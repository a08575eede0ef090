"""The copy process on a GPU: with a device snapshot, a memory save's D2H copies and checksums run in a
process of ours (``memory.copy_process``), and every save loads bit-exact with its recorded crc32c.

Run on the device machine (``pytest -m gpu tests/gpu``); skipped where CUDA is absent. The CPU path (the
process computes the checksums only) runs in tests/unit/test_copy_process.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import crc32c
import pytest
import torch

import cpuckpt
from cpuckpt.backend.committed import read_manifest
from cpuckpt.errors import CheckpointCorrupt, CpuckptError
from cpuckpt.format.checksums import blocksum32
from cpuckpt.testing.faults import flip_byte
from cpuckpt.tier.memory import MemoryTier
from cpuckpt.transfer import device_snapshot
from cpuckpt.transfer.device_snapshot import Mirror, device_chunk_sums

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the device machine)"),
]


def _cfg(root: Path, **memory: object) -> dict:
    return {"io": {"chunk_bytes": "1MiB", "threads": 4, "backend": "buffered"}, "timeout_s": 120,
            "staging": {"device_snapshot": True},
            "memory": {"root": str(root), "persist_every": 0, "slots": 2, "headroom_bytes": 0,
                       "copy_process": True, **memory}}


def _state(step: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(step)
    return {
        "big": torch.randn(1024, 1536, device="cuda", generator=g),  # 6 MiB: several chunks
        "bf16": torch.randn(3000, device="cuda", generator=g).to(torch.bfloat16),
        "strided": torch.randn(64, 128, device="cuda", generator=g)[:, ::2],  # not contiguous
        "cpu": torch.arange(1000, dtype=torch.int64) + step,  # a CPU tensor in a GPU save
        "scalar": torch.tensor(2.5 + step, device="cuda"),
        "step": step,
    }


def _check(path: Path, step: int, kind: str = "crc32c") -> None:
    want = _state(step)
    out = {k: (torch.empty_like(v).contiguous() if isinstance(v, torch.Tensor) else -1) for k, v in want.items()}
    cpuckpt.load(out, path)
    assert out["step"] == step
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k].cpu(), v.cpu()), k
    for entry in read_manifest(path).files.values():
        data = (path / entry.name).read_bytes()
        assert entry.checksum == kind and entry.chunk_checksums
        for k, crc in enumerate(entry.chunk_checksums):
            chunk = data[k * entry.chunk_bytes : (k + 1) * entry.chunk_bytes]
            assert crc == (crc32c.crc32c(chunk) if kind == "crc32c" else blocksum32(chunk)), (entry.name, k)


@pytest.mark.parametrize("configured", ["crc32c", "blocksum32", "auto"])
def test_device_snapshot_saves_copied_by_the_copy_process_load_bit_exact(tmp_path, monkeypatch, configured):
    """``auto``: a device snapshot the copy process copies is summed on the GPU, so its saves record blocksum32."""
    kind = "crc32c" if configured == "crc32c" else "blocksum32"
    summed = []  # blocksum32: the device bytes' share is summed on the GPU, from the mirrored snapshot
    real = device_snapshot.device_chunk_sums
    monkeypatch.setattr(device_snapshot, "device_chunk_sums", lambda *a: summed.append(1) or real(*a))
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path / "ram", checksum_kind=configured))
    try:
        for step in (1, 2, 3, 4):
            state = _state(step)
            pending = tier.save(state, step)
            for v in state.values():  # the trainer goes on: the save holds its snapshot, not these tensors
                if isinstance(v, torch.Tensor) and v.is_cuda:
                    v.add_(1000.0)
            pending.wait()
            _check(tier.find_latest(), step, kind)
        assert tier.copier is not None and tier.copier.pid is not None
        assert len(summed) == (4 if kind == "blocksum32" else 0)
        # another structure into the same buffers (a new layout: the buffer zeroed again), an empty GPU tensor in it
        other = {**_state(5), "extra": torch.ones(5000, device="cuda"), "empty": torch.empty(0, device="cuda")}
        tier.save(other, 5).wait()
        out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in other.items()}
        cpuckpt.load(out, tier.find_latest())
        assert all(torch.equal(out[k].cpu(), v.cpu()) for k, v in other.items() if isinstance(v, torch.Tensor))
        assert len(summed) == (5 if kind == "blocksum32" else 0)
        if kind == "blocksum32":  # a byte changed in RAM after the commit: the load says so
            latest = tier.find_latest()
            entry = next(iter(read_manifest(latest).files.values()))
            flip_byte(latest / entry.name, entry.chunk_bytes + 4321)
            with pytest.raises(CheckpointCorrupt, match="chunk 1"):
                cpuckpt.load(out, latest)
    finally:
        tier.close(persist_newest=False)


@pytest.mark.parametrize("kind", ["crc32c", "blocksum32"])
def test_a_save_whose_copy_process_is_killed_gives_its_snapshot_buffer_back(tmp_path, kind):
    """The save fails naming the process; its device snapshot is released, not leaked: the next save (another
    process) reuses the one buffer instead of allocating a second."""
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path / "ram", checksum_kind=kind))
    try:
        tier.save(_state(1), 1).wait()
        snaps = tier.saves.snapshots
        assert (snaps.allocations, len(snaps)) == (1, 1)
        pid = tier.copier.pid
        os.kill(pid, signal.SIGSTOP)  # it takes the next save's message without answering
        handle = tier.save(_state(2), 2)
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(CpuckptError, match=rf"copy process \(pid {pid}\) exited"):
            handle.wait()
        for step in (3, 4):
            tier.save(_state(step), step).wait()
            _check(tier.find_latest(), step, kind)
        assert tier.copier.pid not in (None, pid)
        assert (snaps.allocations, len(snaps)) == (1, 1), "the failed save's snapshot buffer was not given back"
    finally:
        tier.close(persist_newest=False)


def test_the_device_sums_take_no_copy_of_the_snapshot_and_equal_the_definition():
    """blocksum32's reduction over a 256 MiB snapshot: its GPU memory beside the buffer stays a small fraction of it
    (a 64-bit sum had torch convert every word first: twice the buffer), and each chunk's share is the definition's."""
    nbytes, chunk = 256 << 20, 1 << 20
    g = torch.Generator(device="cuda").manual_seed(7)
    buf = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda", generator=g)
    buf = buf.view(torch.uint8)
    weights = 2 * torch.arange(chunk // device_snapshot.BLOCK_BYTES, dtype=torch.int64, device="cuda") + 1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    sums = device_chunk_sums(buf, Mirror((), (0,), nbytes, chunk), weights)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= nbytes // 64, f"the sums took {extra} bytes of GPU memory for a {nbytes}-byte snapshot"
    host = buf.cpu().numpy().tobytes()
    for k in (0, 1, 131, 255):
        assert int(sums[k]) & 0xFFFFFFFF == blocksum32(host[k * chunk : (k + 1) * chunk]), k


def _sized(step: int, mib: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(step)
    return {"big": torch.randn(mib << 18, device="cuda", generator=g), "step": step}


def _check_sized(path: Path, step: int, mib: int) -> None:
    out = {"big": torch.empty(mib << 18, device="cuda"), "step": -1}
    cpuckpt.load(out, path)
    assert out["step"] == step and torch.equal(out["big"], _sized(step, mib)["big"]), (path, step, mib)


def test_reserved_images_are_pinned_by_the_copy_process_once_and_resizes_keep_every_copy_in_the_file(tmp_path):
    """The copy process pins the images reserved before training; the first save (smaller than the reservation)
    re-registers only the segment past its size; a shrink the process never saw (two resizes between its
    messages) still drops the registrations past it, so a save that grows back lands every byte in the file."""
    ram = Path("/dev/shm") / f"cpuckpt-gpu-test-{uuid.uuid4().hex[:8]}"  # tmpfs: a disk file's pages cannot be pinned
    cfg = _cfg(ram)
    cfg["io"]["chunk_bytes"] = "4MiB"  # 64 MiB registration segments
    tier = MemoryTier(tmp_path / "durable", cfg)
    try:
        assert tier.reserve(200 << 20) == 2
        log_path = tier.root.path / f"copier-{tier.rank}.log"
        deadline = time.monotonic() + 60  # the process pins them beside the job's start: here, before any save
        while log_path.read_text().count("4 of 4 segments registered") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log_path.read_text().count("4 of 4 segments registered") == 2, log_path.read_text()[-3000:]
        step = 0
        for mib in (150, 150, 100, 100, 150, 150):  # each slot: 150 -> 100 -> 150 (seen by the process)
            step += 1
            tier.save(_sized(step, mib), step).wait()
            _check_sized(tier.find_latest(), step, mib)
        k = tier.slots.index(tier.find_latest())
        name = tier.images[k].names[0]
        tier.images[k].image(name, 50 << 20)  # a shrink the copy process is never told of as a size
        for _ in range(2):  # the slot after it, then this one again: grown back to 150 MiB
            step += 1
            tier.save(_sized(step, 150), step).wait()
            _check_sized(tier.find_latest(), step, 150)
        log = log_path.read_text()
        first = str(tier.slots[0] / name)
        lines = [ln.split(first + ": ", 1)[1] for ln in log.splitlines() if first + ": " in ln]
        assert len(lines) >= 2 and lines[0] == "4 of 4 segments registered (209715200 bytes)", lines
        assert lines[1].startswith("1 of 3 segments registered"), lines  # the first save: only the last segment
    finally:
        tier.close(persist_newest=False)
        shutil.rmtree(ram, ignore_errors=True)
