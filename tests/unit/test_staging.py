"""Host staging pieces that need no GPU: the pool's pre-touch over several threads."""

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
