"""plan_files: properties checked over many seeded random item lists (plain RNG, no hypothesis)."""

from __future__ import annotations

import itertools
import random

import pytest

from cpuckpt.format.layout import FileLayout, LayoutItem, Placement, plan_files

N_CASES = 400


def _random_items(rng: random.Random, align_min: int) -> list[LayoutItem]:
    items = []
    for _ in range(rng.choice([0, 1, 2, 3, 5, 8, 13, 30])):
        kind = rng.random()
        if kind < 0.25:  # non-tensor payload (possibly empty)
            n = rng.choice([0, 1, 17, 300, 1261, 5000])
            items.append(LayoutItem(data_nbytes=n, payload=rng.randbytes(n)))
            continue
        head = rng.randbytes(rng.choice([0, 64, 704, 900]))
        tail = rng.randbytes(rng.choice([0, 825, 1000]))
        if kind < 0.5:
            data = rng.choice([0, 1, 2, 4, 48, 4096])
        elif kind < 0.8:
            data = rng.randrange(0, 3 * max(align_min, 4096) + 1)
        else:  # around and above the alignment threshold
            data = max(0, align_min + rng.randrange(-3, 4)) if align_min else rng.randrange(20000)
        items.append(LayoutItem(data_nbytes=data, head=head, tail=tail))
    return items


def _random_params(rng: random.Random) -> dict:
    align = rng.choice([512, 1024, 4096])
    return {
        "num_files": rng.choice([1, 1, 2, 3, 4, 7]),
        "chunk_bytes": align * rng.choice([1, 2, 3, 8]),
        "align_bytes": align,
        "align_data_min_bytes": rng.choice([0, 1, 100, 2048, 10000]),
    }


def _overlaps(a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> bool:
    return max(a_lo, b_lo) < min(a_hi, b_hi)


def _check_plan(items: list[LayoutItem], params: dict, files: list[FileLayout], placements: list[Placement]) -> None:
    align, cb, amin = params["align_bytes"], params["chunk_bytes"], params["align_data_min_bytes"]
    assert len(files) == max(1, min(params["num_files"], len(items)))
    assert [f.index for f in files] == list(range(len(files)))
    assert len(placements) == len(items)

    # placements: one per item, in item order, describing the item
    for i, (it, p) in enumerate(zip(items, placements)):
        assert p.item == i
        assert 0 <= p.file < len(files)
        assert p.record_nbytes == it.record_nbytes
        assert p.data_nbytes == it.data_nbytes
        if it.payload is None:
            assert p.data_offset == p.record_offset + len(it.head)
            if amin > 0 and it.data_nbytes >= amin:
                assert p.data_offset % align == 0, f"item {i}: large data at {p.data_offset} not aligned"
        else:
            assert p.data_offset == p.record_offset
        assert p.record_offset >= 0
        assert p.record_offset + p.record_nbytes <= files[p.file].nbytes

    for f in files:
        mine = [p for p in placements if p.file == f.index]
        # records keep the caller's order and never overlap
        assert [p.item for p in sorted(mine, key=lambda p: (p.record_offset, p.item))] == sorted(p.item for p in mine)
        for a, b in itertools.pairwise(mine):
            assert a.record_offset + a.record_nbytes <= b.record_offset
        # the file is exactly as long as its last record (no trailing padding)
        assert f.nbytes == (max((p.record_offset + p.record_nbytes for p in mine), default=0))
        # gaps between records are only alignment padding for a large tensor: < align_bytes
        for a, b in itertools.pairwise(mine):
            gap = b.record_offset - (a.record_offset + a.record_nbytes)
            if gap:
                it = items[b.item]
                assert it.payload is None and amin > 0 and it.data_nbytes >= amin and gap < align

        # segments: sorted, disjoint, non-empty, each inside its item's record
        segs = f.segments
        for s in segs:
            assert s.nbytes > 0
        for a, b in itertools.pairwise(segs):
            assert a.file_offset + a.nbytes <= b.file_offset
        # segments tile exactly every record
        by_item: dict[int, list] = {}
        for s in segs:
            by_item.setdefault(s.item, []).append(s)
        assert set(by_item) <= {p.item for p in mine}
        for p in mine:
            it = items[p.item]
            ss = by_item.get(p.item, [])
            assert sum(s.nbytes for s in ss) == p.record_nbytes
            pos = p.record_offset
            for s in ss:
                assert s.file_offset == pos, "segments of a record are not contiguous"
                pos += s.nbytes
            assert pos == p.record_offset + p.record_nbytes or not ss
            # the image bytes the segments describe equal head + data + tail
            image = bytearray()
            for s in ss:
                if s.payload is not None:
                    image += bytes(s.payload)
                else:
                    assert s.file_offset == p.data_offset + s.src_offset
                    assert s.src_offset + s.nbytes <= it.data_nbytes
                    image += b"D" * s.nbytes
            if it.payload is not None:
                assert bytes(image) == bytes(it.payload)
            else:
                assert bytes(image) == it.head + b"D" * it.data_nbytes + it.tail

        # chunks: aligned, contiguous, cover [0, nbytes), full except the last
        ch = f.chunks
        assert [c.index for c in ch] == list(range(len(ch)))
        pos = 0
        for c in ch:
            assert c.file == f.index
            assert c.offset == pos and c.offset % align == 0 and c.offset % cb == 0
            assert 0 < c.nbytes <= cb
            if c is not ch[-1]:
                assert c.nbytes == cb
            pos += c.nbytes
        assert pos == f.nbytes


def _check_balance(items: list[LayoutItem], placements: list[Placement], nfiles: int) -> None:
    """Greedy largest-first assignment: no file exceeds another by more than the largest record."""
    if nfiles < 2:
        return
    loads = [0] * nfiles
    for p in placements:
        loads[p.file] += p.record_nbytes
    biggest = max((it.record_nbytes for it in items), default=0)
    assert max(loads) - min(loads) <= biggest, (loads, biggest)
    # every file gets an item when items carry bytes and there are at least as many as files
    if sum(1 for it in items if it.record_nbytes) >= nfiles:
        assert all(loads), loads


def test_random_plans_hold_every_property():
    rng = random.Random(20240611)
    checked = 0
    for case in range(N_CASES):
        params = _random_params(rng)
        items = _random_items(rng, params["align_data_min_bytes"])
        files, placements = plan_files(items, **params)
        try:
            _check_plan(items, params, files, placements)
            _check_balance(items, placements, len(files))
        except AssertionError as e:
            raise AssertionError(f"case {case}: params {params}, {len(items)} items: {e}") from e
        checked += len(items)
    assert checked > 1000


def _brute_segments(f: FileLayout, start: int, stop: int) -> list:
    return [s for s in f.segments if _overlaps(s.file_offset, s.file_offset + s.nbytes, start, stop)]


def test_segments_in_returns_exactly_the_overlapping_segments():
    rng = random.Random(7)
    for _ in range(150):
        params = _random_params(rng)
        items = _random_items(rng, params["align_data_min_bytes"])
        files, _ = plan_files(items, **params)
        for f in files:
            ranges = [(c.offset, c.offset + c.nbytes) for c in f.chunks]
            top = f.nbytes + 10
            for _ in range(20):
                a = rng.randrange(0, top)
                b = rng.randrange(a + 1, top + 1)
                ranges.append((a, b))
            ranges += [(0, top), (f.nbytes, f.nbytes + 5), (0, 1)]
            for s in f.segments:  # boundaries exactly at segment edges
                lo, hi = s.file_offset, s.file_offset + s.nbytes
                ranges += [(lo, lo + 1), (hi - 1, hi), (max(0, lo - 1), lo), (hi, hi + 1)]
            for a, b in ranges:
                assert list(f.segments_in(a, b)) == _brute_segments(f, a, b), (a, b)


def test_chunks_cover_segments_exactly():
    """Every image byte in a segment falls in exactly one chunk (the writer fills chunk by chunk)."""
    rng = random.Random(99)
    for _ in range(100):
        params = _random_params(rng)
        items = _random_items(rng, params["align_data_min_bytes"])
        files, _ = plan_files(items, **params)
        for f in files:
            covered = sum(min(s.file_offset + s.nbytes, c.offset + c.nbytes) - max(s.file_offset, c.offset)
                          for c in f.chunks for s in f.segments_in(c.offset, c.offset + c.nbytes))
            assert covered == sum(s.nbytes for s in f.segments)


def test_large_tensor_data_is_aligned_small_ones_packed():
    head, tail = b"h" * 700, b"t" * 800
    items = [
        LayoutItem(10, head, tail),
        LayoutItem(1 << 20, head, tail),  # >= threshold: aligned
        LayoutItem(10, head, tail),  # small: packed right after
        LayoutItem((1 << 20) - 1, head, tail),  # just below: packed
        LayoutItem(1 << 21, head, tail),
    ]
    files, pl = plan_files(items, num_files=1, chunk_bytes=1 << 16, align_bytes=4096, align_data_min_bytes=1 << 20)
    assert pl[0].record_offset == 0
    assert pl[1].data_offset % 4096 == 0 and pl[1].record_offset > pl[0].record_offset + pl[0].record_nbytes
    assert pl[2].record_offset == pl[1].record_offset + pl[1].record_nbytes
    assert pl[3].record_offset == pl[2].record_offset + pl[2].record_nbytes
    assert pl[4].data_offset % 4096 == 0
    assert files[0].nbytes == pl[4].record_offset + pl[4].record_nbytes


def test_alignment_disabled_with_zero_threshold():
    items = [LayoutItem(1 << 20, b"h" * 700, b"t" * 800) for _ in range(3)]
    _, pl = plan_files(items, num_files=1, chunk_bytes=4096, align_bytes=4096, align_data_min_bytes=0)
    assert [p.record_offset for p in pl] == [0, pl[0].record_nbytes, 2 * pl[0].record_nbytes]


def test_payload_items_are_never_padded():
    items = [LayoutItem(5, b"h", b"t"), LayoutItem(1 << 20, payload=b"x" * (1 << 20))]
    _, pl = plan_files(items, num_files=1, chunk_bytes=4096, align_bytes=4096, align_data_min_bytes=100)
    assert pl[1].record_offset == pl[0].record_offset + pl[0].record_nbytes == 7


def test_balanced_assignment_across_files():
    sizes = [1000, 900, 800, 700, 600, 500, 400, 300, 200, 100]
    items = [LayoutItem(n) for n in sizes]
    files, pl = plan_files(items, num_files=3, chunk_bytes=4096, align_bytes=4096, align_data_min_bytes=0)
    loads = [f.nbytes for f in files]
    assert sum(loads) == sum(sizes)
    assert max(loads) - min(loads) <= 100
    # within a file, the caller's order is kept
    for f in files:
        idx = [p.item for p in pl if p.file == f.index]
        offs = [p.record_offset for p in pl if p.file == f.index]
        assert offs == sorted(offs) and idx == sorted(idx)


def test_more_files_than_items_and_no_items():
    files, pl = plan_files([LayoutItem(10)], num_files=8, chunk_bytes=4096, align_bytes=4096, align_data_min_bytes=0)
    assert len(files) == 1 and pl[0].file == 0
    files, pl = plan_files([], num_files=4, chunk_bytes=4096, align_bytes=4096, align_data_min_bytes=0)
    assert len(files) == 1 and files[0].nbytes == 0 and files[0].chunks == [] and pl == []


def test_chunk_not_multiple_of_align_is_rejected():
    with pytest.raises(ValueError, match="multiple"):
        plan_files([LayoutItem(1)], num_files=1, chunk_bytes=6000, align_bytes=4096, align_data_min_bytes=0)


def test_exact_chunk_boundaries():
    files, _ = plan_files([LayoutItem(8192)], num_files=1, chunk_bytes=4096, align_bytes=4096, align_data_min_bytes=0)
    assert [(c.offset, c.nbytes) for c in files[0].chunks] == [(0, 4096), (4096, 4096)]
    files, _ = plan_files([LayoutItem(8193)], num_files=1, chunk_bytes=4096, align_bytes=4096, align_data_min_bytes=0)
    assert [(c.offset, c.nbytes) for c in files[0].chunks] == [(0, 4096), (4096, 4096), (8192, 1)]


# ------------------------------------------------------------------------------------ LayoutCache


def _items(payload: bytes = b"step=7", head: bytes = b"H" * 64) -> list:
    from cpuckpt.format.layout import LayoutItem

    return [LayoutItem(4096, head, b"T" * 22), LayoutItem(len(payload), payload=memoryview(payload)),
            LayoutItem(3 << 20, head, b"T" * 22)]


KW = {"num_files": 1, "chunk_bytes": 1 << 20, "align_bytes": 4096, "align_data_min_bytes": 1 << 20}


def _payloads(files) -> list[bytes]:
    return [bytes(s.payload) for f in files for s in f.segments if s.payload is not None]


def test_layout_cache_returns_the_same_layout_with_this_saves_payload():
    from cpuckpt.format.layout import LayoutCache, plan_files

    cache = LayoutCache()
    first, _, first_cached = cache.plan(_items(b"step=7"), **KW)
    again, p2, cached = cache.plan(_items(b"step=8"), **KW)  # same lengths: the cached layout, new bytes bound
    fresh, p3 = plan_files(_items(b"step=8"), **KW)
    assert (first_cached, cached) == (False, True) and p2 == p3
    assert [(s.file_offset, s.nbytes, s.item, s.src_offset) for s in again[0].segments] == \
        [(s.file_offset, s.nbytes, s.item, s.src_offset) for s in fresh[0].segments]
    assert _payloads(again) == _payloads(fresh) and b"step=8" in _payloads(again)
    assert b"step=7" in _payloads(first)  # the first save's layout is not rebound under it
    again[0].segments.clear()  # a caller's copy: the cache is not affected
    assert cache.plan(_items(b"step=9"), **KW)[0][0].segments


def test_layout_cache_misses_when_anything_plan_files_reads_changes():
    from cpuckpt.format.layout import LayoutCache

    cache = LayoutCache()
    assert not cache.plan(_items(), **KW).cached
    assert not cache.plan(_items(b"step=10"), **KW).cached  # longer payload
    assert not cache.plan(_items(head=b"h" * 64), **KW).cached  # same length, other skeleton bytes (another dtype)
    assert not cache.plan(_items(), **{**KW, "align_data_min_bytes": 0}).cached
    assert cache.plan(_items(), **KW).cached
