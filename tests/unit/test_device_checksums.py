"""blocksum32 split between the GPU and the copy process (``memory.checksum_kind: blocksum32``): the device bytes'
share of each chunk from one reduction over a snapshot laid out as the files are
(:func:`cpuckpt.transfer.device_snapshot.device_chunk_sums`), the host bytes' share from the rest of the chunk
(:func:`cpuckpt.format.checksums.blocksum32_except`); together, each chunk's blocksum32 as the CPU computes it from the
file. The reduction runs here on CPU tensors (the same torch integer arithmetic the GPU runs; the device path
itself: tests/gpu/test_copy_process_gpu.py)."""

from __future__ import annotations

import random
from types import MethodType, SimpleNamespace

import numpy as np
import torch

from cpuckpt.format.checksums import blocksum32, blocksum32_except
from cpuckpt.format.layout import LayoutCache, LayoutItem
from cpuckpt.transfer.device_snapshot import BLOCK_BYTES, DeviceSnapshots, Mirror, device_chunk_sums
from cpuckpt.transfer.save_job import SaveJob

MASK = (1 << 32) - 1


def _files(rng: random.Random, chunk: int) -> tuple[list[bytearray], list[list[tuple[int, int]]]]:
    """Two files of random bytes and, per file, the (offset, bytes) ranges that came from the device."""
    files, ranges = [], []
    for size in (3 * chunk + 1234, chunk - 7):
        data = bytearray(rng.getrandbits(8) for _ in range(size))
        cut, at = [], 0
        while at < size:
            start = at + rng.randrange(0, 300)
            n = rng.choice([1, 2, 3, 5, 64, 4095, 4096, 9000, 2 * BLOCK_BYTES + 3])
            if start + n > size:
                break
            cut.append((start, n))
            at = start + n
        files.append(data)
        ranges.append(cut)
    return files, ranges


def test_device_share_plus_host_share_is_each_chunks_blocksum32():
    rng = random.Random(7)
    chunk = 4 * BLOCK_BYTES
    files, ranges = _files(rng, chunk)
    bases, base = [], 0
    for data in files:
        bases.append(base)
        base += -(-len(data) // chunk) * chunk
    buffer = torch.zeros(base, dtype=torch.uint8)  # the mirrored snapshot: device ranges at their files' places
    places = []
    for f, (data, cut) in enumerate(zip(files, ranges)):
        for start, n in cut:
            buffer[bases[f] + start : bases[f] + start + n] = torch.frombuffer(bytearray(data[start : start + n]),
                                                                               dtype=torch.uint8)
            places.append((f, start))
    mirror = Mirror(tuple(places), tuple(bases), base, chunk)
    weights = 2 * torch.arange(chunk // BLOCK_BYTES, dtype=torch.int64) + 1
    device = [int(v) & MASK for v in device_chunk_sums(buffer, mirror, weights).tolist()]
    k = 0
    for data, cut in zip(files, ranges):
        for off in range(0, len(data), chunk):
            view = memoryview(bytes(data[off : off + chunk]))
            # each chunk's part of the device ranges (the copy process's ops are cut at chunk boundaries)
            inside = [(max(s, off), min(s + n, off + chunk) - max(s, off)) for s, n in cut
                      if s < off + chunk and s + n > off]
            host = blocksum32_except(view, off, inside)
            assert (host + device[k]) & MASK == blocksum32(view), k
            k += 1
    assert k == len(device)


def test_the_reduction_wraps_its_block_sums_mod_2_32_as_the_definition_does():
    """Whole 32 MiB chunks of words whose block sums leave 32 bits (2**31, 2**31 - 1, 2**32 - 1 repeated): summed in
    32-bit integers (no wider copy of the buffer), they wrap to the definition's s_b mod 2**32."""
    chunk = 8192 * BLOCK_BYTES
    for word in (-(2**31), 2**31 - 1, -1):
        data = np.full(chunk // 4, word, dtype="<i4").tobytes()
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mirror = Mirror(((0, 0),), (0,), chunk, chunk)
        weights = 2 * torch.arange(chunk // BLOCK_BYTES, dtype=torch.int64) + 1
        (got,) = device_chunk_sums(buffer, mirror, weights).tolist()
        assert int(got) & MASK == blocksum32(data), word


def test_a_host_share_without_ranges_is_the_whole_chunks():
    data = bytes(random.Random(3).getrandbits(8) for _ in range(3 * BLOCK_BYTES + 17))
    assert blocksum32_except(memoryview(data), 8 * BLOCK_BYTES, []) == blocksum32(data)
    overlapping = [(8 * BLOCK_BYTES + 10, 100), (8 * BLOCK_BYTES + 50, 4000)]  # sorted and merged: counted once
    rest = blocksum32(data[:10]) + blocksum32(data[4050:], 4050)
    assert blocksum32_except(memoryview(data), 8 * BLOCK_BYTES, overlapping) == rest & MASK


def _job(files: list, sources: list, chunk: int, kind: str = "blocksum32") -> SimpleNamespace:
    """The parts of a SaveJob that ``_mirror`` reads (its layouts, sources, config, sink's kind, save stream)."""
    job = SimpleNamespace(files=files, sources=sources, rank=0, snapshots=DeviceSnapshots(),
                          cfg=SimpleNamespace(io=SimpleNamespace(chunk_bytes=chunk)),
                          sink=SimpleNamespace(checksum_kind=kind))
    job._mirror_of = MethodType(SaveJob._mirror_of, job)
    job._mirror = MethodType(SaveJob._mirror, job)
    return job


def _layouts(rng: random.Random, num_files: int, chunk: int) -> tuple[list, list, list[bool]]:
    """Planned files of random items: raw payloads, and tensor records (some empty) whose sources are on the
    device or not."""
    items, sources, on_device = [], [], []
    for _ in range(rng.randrange(3, 25)):
        if rng.random() < 0.15:
            payload = rng.randbytes(rng.randrange(0, 300))
            items.append(LayoutItem(len(payload), payload=payload))
            sources.append(None)
            on_device.append(False)
            continue
        n = rng.choice([0, 1, 3, 100, 4096, 5000, 3 * chunk + 7])
        items.append(LayoutItem(n, head=rng.randbytes(rng.randrange(0, 50)), tail=rng.randbytes(rng.randrange(0, 20))))
        sources.append(torch.frombuffer(bytearray(rng.randbytes(n)), dtype=torch.uint8) if n else
                       torch.empty(0, dtype=torch.uint8))
        on_device.append(rng.random() < 0.7)
    files, _, _ = LayoutCache().plan(items, num_files=num_files, chunk_bytes=chunk, align_bytes=512,
                                     align_data_min_bytes=1024)
    return files, sources, on_device


def test_a_mirrored_snapshot_and_the_host_bytes_give_every_chunks_blocksum32_of_planned_files():
    """SaveJob's mirror over files planned as a save plans them (several files, payloads, empty tensors, records
    across chunk boundaries, images holding stale bytes in their gaps): the device share of the snapshot laid out by
    it, plus the copy process's share of the rest of each chunk, is each chunk's blocksum32 of the final bytes."""
    chunk = 4 * BLOCK_BYTES
    mirrored = refused = 0
    for seed in range(60):
        rng = random.Random(seed)
        files, sources, on_device = _layouts(rng, 1 + seed % 3, chunk)
        idx = [i for i, d in enumerate(on_device) if d]
        job = _job(files, sources, chunk)
        mirror = job._mirror(idx)
        if mirror is None:
            refused += 1
            continue
        mirrored += 1
        assert job._mirror(idx) is mirror  # kept for the next save of the same layouts
        snapshot = torch.zeros(mirror.nbytes, dtype=torch.uint8)
        for i, (f, off) in zip(idx, mirror.places):
            n = sources[i].numel()
            snapshot[mirror.bases[f] + off : mirror.bases[f] + off + n] = sources[i]
        weights = 2 * torch.arange(chunk // BLOCK_BYTES, dtype=torch.int64) + 1
        device = iter(int(v) & MASK for v in device_chunk_sums(snapshot, mirror, weights).tolist())
        for layout in files:
            image = bytearray(rng.randbytes(layout.nbytes))  # gaps hold whatever an earlier save left
            copied = []
            for seg in layout.segments:
                data = bytes(seg.payload)[: seg.nbytes] if seg.payload is not None else \
                    bytes(sources[seg.item][seg.src_offset : seg.src_offset + seg.nbytes].numpy())
                image[seg.file_offset : seg.file_offset + seg.nbytes] = data
                if seg.payload is None and on_device[seg.item]:
                    copied.append((seg.file_offset, seg.nbytes))
            for c in layout.chunks:
                inside = [(max(s, c.offset), min(s + n, c.offset + c.nbytes) - max(s, c.offset)) for s, n in copied
                          if s < c.offset + c.nbytes and s + n > c.offset]
                view = memoryview(bytes(image[c.offset : c.offset + c.nbytes]))
                assert (blocksum32_except(view, c.offset, inside) + next(device)) & MASK == blocksum32(view), seed
        assert next(device, None) is None
    assert mirrored > 20 and refused > 0, (mirrored, refused)  # the memory bound refuses some (CPU-heavy states)


def test_auto_mirrors_a_snapshot_only_at_about_the_device_bytes():
    """``auto`` (the default, chosen by nobody for its GPU memory) lays a snapshot out as the files only where that
    costs at most a chunk per file more than the device bytes; blocksum32, asked for, up to twice them. A state whose
    host tensors are a third of the files: blocksum32 mirrors it, auto does not (its saves record crc32c)."""
    chunk = 4 * BLOCK_BYTES
    device, host = torch.zeros(10 * chunk, dtype=torch.uint8), torch.ones(5 * chunk, dtype=torch.uint8)
    files, _, _ = LayoutCache().plan([LayoutItem(device.numel()), LayoutItem(host.numel())], num_files=1,
                                     chunk_bytes=chunk, align_bytes=512, align_data_min_bytes=1024)
    asked = _job(files, [device, host], chunk, "blocksum32")._mirror([0])
    assert asked is not None and asked.nbytes >= 15 * chunk
    assert _job(files, [device, host], chunk, "auto")._mirror([0]) is None
    small, _, _ = LayoutCache().plan([LayoutItem(device.numel()), LayoutItem(100)], num_files=1, chunk_bytes=chunk,
                                     align_bytes=512, align_data_min_bytes=1024)
    mirror = _job(small, [device, torch.ones(100, dtype=torch.uint8)], chunk, "auto")._mirror([0])
    assert mirror is not None and mirror.nbytes <= device.numel() + 2 * chunk
