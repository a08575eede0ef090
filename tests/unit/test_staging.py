"""Host staging pieces that need no GPU: the pool's pre-touch over several threads, its bulk lease."""

from __future__ import annotations

import torch

from cpuckpt.transfer import staging


def test_pretouch_pages_zeroes_every_byte_across_threads():
    n = 200 * 2**20 + 12345  # several 64 MiB pieces and an unaligned tail
    t = torch.full((n,), 0xFF, dtype=torch.uint8)
    staging.pretouch_pages(t)
    assert int(t.count_nonzero()) == 0


def test_pretouch_pages_single_thread_for_small_regions():
    t = torch.full((4096,), 7, dtype=torch.uint8)
    staging.pretouch_pages(t)
    assert int(t.count_nonzero()) == 0


def test_pool_created_with_pretouch_is_zeroed_and_leasable():
    pool = staging.HostPool(2**20, 8, pin=False, pretouch=True)
    try:
        slot = pool.lease(5.0)
        assert slot.tensor.numel() == 2**20 and int(slot.tensor.count_nonzero()) == 0
        pool.release(slot)
    finally:
        pool.close()


def test_lease_each_takes_distinct_free_slots_and_waits_for_releases():
    import threading

    import pytest

    from cpuckpt.errors import CheckpointTimeoutError, StagingError

    pool = staging.HostPool(4096, 6, pin=False)
    try:
        first = pool.lease(5.0)
        slots = pool.lease_each(4, 5.0)
        assert len({s.index for s in slots} | {first.index}) == 5 and pool.free_slots == 1
        for s in slots:
            assert s.count == 1 and s.tensor.numel() == 4096 and len(s.view) == 4096
        slots[0].tensor.fill_(1)  # each slot is its own bytes
        assert int(slots[1].tensor.count_nonzero()) == 0
        with pytest.raises(CheckpointTimeoutError):
            pool.lease_each(3, 0.05)  # one free: nothing taken while waiting
        assert pool.free_slots == 1
        threading.Timer(0.1, pool.release, (first,)).start()
        more = pool.lease_each(2, 5.0)
        assert pool.free_slots == 0 and {s.index for s in more}.isdisjoint(s.index for s in slots)
        with pytest.raises(StagingError):
            pool.lease_each(7, 1.0)
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(StagingError, match="cancelled"):
            pool.lease_each(1, 5.0, cancel=cancel)
        for s in slots + more:
            pool.release(s)
        assert pool.free_slots == 6
    finally:
        pool.close()


def test_prepare_pool_in_background_makes_the_pool_and_reports_failures():
    import cpuckpt

    staging.release_pool()
    try:
        made = cpuckpt.prepare_pool_in_background(8 * 2**20, {"io": {"chunk_bytes": "1MiB"}, "staging": {"pin": False}})
        made.join(60)
        assert made.done and made.error is None and made.seconds is not None
        nbytes, _ = staging.pool_state()
        assert nbytes >= 8 * 2**20
        bad = cpuckpt.prepare_pool_in_background(2**20, {"io": {"no_such_key": 1}})
        bad.join(60)
        assert bad.done and bad.error is not None and bad.seconds is None  # logged, not raised
    finally:
        staging.release_pool()


def test_own_host_sources_clones_cpu_sources_for_paced_copies():
    """A paced save copies host bytes after the call returned: the CPU sources it reads are clones, so a
    change the caller makes at once does not reach them; missing sources stay missing."""
    from cpuckpt.transfer.staging import own_host_sources

    src = torch.arange(8, dtype=torch.uint8)
    owned = own_host_sources([src, None])
    src.add_(1)
    assert owned[1] is None and torch.equal(owned[0], torch.arange(8, dtype=torch.uint8))
