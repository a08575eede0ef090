"""A load's own read slots (``transfer.read_slots``) and single-thread host copies (``transfer.hostcopy``).

Pinning needs CUDA: tests/gpu/test_load_gpu.py checks that a load without a process pool pins its
slots one at a time. Here: leases, back-pressure, alignment, teardown, and that a load leaves no
process pool behind.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time

import pytest
import torch

import cpuckpt
from cpuckpt.errors import CheckpointTimeoutError, StagingError
from cpuckpt.transfer import staging
from cpuckpt.transfer.hostcopy import copy_host_bytes
from cpuckpt.transfer.read_slots import ReadSlots

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_slots_are_distinct_page_aligned_and_writable():
    with ReadSlots(1 << 20, 3, pin=False) as slots:
        leased = [slots.lease(1.0) for _ in range(3)]
        assert sorted(s.index for s in leased) == [0, 1, 2]
        for s in leased:
            assert s.tensor.data_ptr() % mmap.PAGESIZE == 0 and s.tensor.numel() == 1 << 20
            s.tensor.fill_(s.index + 1)
        for s in leased:
            assert int(s.tensor.min()) == int(s.tensor.max()) == s.index + 1
            slots.release(s)


def test_a_lease_waits_for_a_release_and_times_out_with_a_clear_error():
    with ReadSlots(4096, 1, pin=False) as slots:
        held = slots.lease(1.0)
        with pytest.raises(CheckpointTimeoutError, match="none of 1 free"):
            slots.lease(0.05)
        t0 = time.monotonic()  # before the timer starts: its 0.1 s run from after t0, however late this thread is
        threading.Timer(0.1, slots.release, args=(held,)).start()
        again = slots.lease(5.0)
        assert again.index == held.index and time.monotonic() - t0 >= 0.05
        slots.release(again)


def test_pin_is_refused_without_cuda_or_when_not_wanted():
    with ReadSlots(4096, 2, pin=True) as slots:
        s = slots.lease(1.0)
        assert slots.pin(s, torch.device("cuda", 0)) is torch.cuda.is_available()
        slots.release(s)
    with ReadSlots(4096, 2, pin=False) as slots:
        s = slots.lease(1.0)
        assert slots.pin(s, torch.device("cuda", 0)) is False and slots.pinned_nbytes == 0
        slots.release(s)


def test_close_while_a_slot_is_leased_waits_for_its_release(caplog):
    slots = ReadSlots(4096, 2, pin=False)
    s = slots.lease(1.0)
    with caplog.at_level(logging.WARNING, logger="cpuckpt.transfer.read_slots"):
        slots.close()
    assert "1 of 2 slots still leased" in caplog.text
    s.tensor.fill_(5)  # still mapped: a straggling read thread does not fault
    assert int(s.tensor.sum()) == 5 * 4096
    with pytest.raises(StagingError, match="after the load closed them"):
        slots.lease(1.0)  # closing: nothing new is handed out
    slots.release(s)  # the last release tears down
    assert slots._state == "closed"
    slots.close()  # idempotent


def test_slots_of_odd_sizes_start_on_their_own_pages():
    with ReadSlots(1000, 3, pin=False) as slots:
        leased = [slots.lease(1.0) for _ in range(3)]
        starts = sorted(s.tensor.data_ptr() for s in leased)
        assert all(p % mmap.PAGESIZE == 0 for p in starts) and len(set(p // mmap.PAGESIZE for p in starts)) == 3
        assert all(s.tensor.numel() == 1000 for s in leased)
        for s in leased:
            slots.release(s)


def test_a_load_without_a_process_pool_leaves_none_behind(tmp_path, fresh_pool):
    sd = {"w": torch.randn(300, 200), "b": torch.arange(1000)}
    cfg = {"io": {"chunk_bytes": "64KiB"}, "integrity": {"verify": "always"}}
    cpuckpt.save(sd, tmp_path / "c", cfg)
    staging.release_pool()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = cpuckpt.StorageReader(tmp_path / "c", cfg)
    cpuckpt.load(out, tmp_path / "c", cfg, storage_reader=reader)
    assert staging.pool_state() == (0, False)
    assert reader.last_stats.slots_pinned_nbytes == 0  # CPU targets: no slot pinned, with or without CUDA
    assert all(torch.equal(out[k], v) for k, v in sd.items())


@pytest.mark.parametrize("nslots", [16, 2])
def test_a_load_reads_through_the_process_pool_when_it_has_a_slot_per_thread(tmp_path, fresh_pool, nslots):
    sd = {"w": torch.randn(300, 200)}
    cfg = {"io": {"chunk_bytes": "64KiB", "read_threads": 4}}
    cpuckpt.save(sd, tmp_path / "c", cfg)
    staging.release_pool()
    pool = staging.get_pool(64 << 10, nslots, pin=False, pretouch=False)
    leases = []
    real_lease = pool.lease

    def counting_lease(*a, **kw):
        leases.append(1)
        return real_lease(*a, **kw)

    pool.lease = counting_lease
    try:
        out = {"w": torch.zeros(300, 200)}
        cpuckpt.load(out, tmp_path / "c", cfg)
    finally:
        del pool.lease
    assert torch.equal(out["w"], sd["w"])
    assert bool(leases) is (nslots >= 4)  # fewer slots than read threads: the load's own slots instead
    assert staging.existing_pool(64 << 10, nslots) is pool and staging.existing_pool(1 << 20) is None


@pytest.mark.parametrize("case", ["contiguous", "strided", "dtype", "shape", "empty"])
def test_copy_host_bytes_equals_copy_and_memmoves_only_plain_bytes(case, monkeypatch):
    calls = []
    real = ctypes.memmove
    monkeypatch.setattr(ctypes, "memmove", lambda d, s, n: calls.append(n) or real(d, s, n))
    src = torch.arange(4096, dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    if case == "strided":
        src, dst = src.view(64, 64).t(), torch.zeros(64, 64, dtype=torch.uint8)
    elif case == "dtype":
        src = torch.arange(4096, dtype=torch.int32)
    elif case == "shape":  # as many bytes, shapes that do not broadcast: copy_ refuses, so must this
        with pytest.raises(RuntimeError):
            copy_host_bytes(torch.zeros(64, 64, dtype=torch.uint8), src)
        assert calls == []
        return
    elif case == "empty":
        src, dst = src[:0], dst[:0]
    copy_host_bytes(dst, src)
    assert torch.equal(dst, src.to(dst.dtype).reshape(dst.shape))
    assert calls == ([4096] if case == "contiguous" else [])


def test_a_loads_own_slots_are_torn_down_after_it(tmp_path, fresh_pool, monkeypatch):
    import cpuckpt.backend.reader as reader_mod

    made: list[ReadSlots] = []

    class Recorded(ReadSlots):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(reader_mod, "ReadSlots", Recorded)
    sd = {"w": torch.randn(300, 200)}
    cfg = {"io": {"chunk_bytes": "64KiB", "read_threads": 3}}
    cpuckpt.save(sd, tmp_path / "c", cfg)
    staging.release_pool()
    out = {"w": torch.zeros(300, 200)}
    cpuckpt.load(out, tmp_path / "c", cfg)
    assert torch.equal(out["w"], sd["w"]) and len(made) == 1 and made[0].nslots == 3
    deadline = time.monotonic() + 10
    while made[0]._state != "closed" and time.monotonic() < deadline:  # closed on a daemon thread
        time.sleep(0.01)
    assert made[0]._state == "closed" and made[0]._mmap.closed
