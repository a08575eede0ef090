"""Memory images with CUDA sources: pinned file pages, D2H copies straight into them, stream order.

Run on the device machine (``pytest -m gpu tests/gpu``); skipped where CUDA is absent. The CPU path of
the same code runs in tests/unit/test_images.py.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import _helpers as H
import crc32c
import pytest
import torch

from cpuckpt.config import Config
from cpuckpt.tier.images import ImageFile, ImageSet
from cpuckpt.transfer import save_job as engine
from cpuckpt.transfer.save_job import SaveJob

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the device machine)"),
    pytest.mark.usefixtures("fresh_pool"),  # tests/conftest.py
]

MiB = 1 << 20
CFG = Config.from_dict({"io": {"chunk_bytes": "1MiB", "threads": 4, "backend": "buffered"}}, env=False)


@pytest.fixture
def ram_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs (/dev/shm) where there is one, else under tmp_path."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="cpuckpt-test-") as d:
            yield Path(d)
    else:
        yield tmp_path / "ram"


def _state(seed: int = 0) -> list[object]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(1024, 1536, device="cuda", generator=g),  # 6 MiB: several chunks
        torch.randn(3000, device="cuda", generator=g).to(torch.bfloat16),
        torch.randn(64, 128, device="cuda", generator=g)[:, ::2],  # not contiguous
        torch.arange(1000, dtype=torch.int64),  # a CPU tensor in a GPU save
        b"extra state \x00" * 5,
        torch.randn(777, device="cuda", generator=g).to(torch.bfloat16),
        torch.empty(0, device="cuda"),
        torch.tensor(2.5, device="cuda"),
    ]


def _disk(directory: Path, values: list[object]) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    names, files, sources = H.plan_layout(values, CFG)
    job = SaveJob(directory, names, files, sources, CFG, rank=0, mode="snapshot")
    job.start()
    job.wait_done(60)
    return names


def _image(directory: Path, values: list[object], images: ImageSet) -> SaveJob:
    names, files, sources = H.plan_layout(values, CFG)
    job = H.memory_job(directory, names, files, sources, CFG, rank=0, images=images)
    job.start()
    return job


def test_cuda_sources_into_pinned_images_equal_save_job(tmp_path: Path, ram_dir: Path) -> None:
    sd = _state()
    names = _disk(tmp_path / "disk", sd)
    images = ImageSet(ram_dir, pin=True)
    try:
        job = _image(ram_dir, sd, images)
        job.wait_staged(60)
        job.wait_done(60)
        for n in names:
            img = images.image(n, os.stat(ram_dir / n).st_size)
            assert img.pinned, img
            assert (ram_dir / n).read_bytes() == (tmp_path / "disk" / n).read_bytes(), n
        pins = [images.image(n, os.stat(ram_dir / n).st_size).pins for n in names]

        sd2 = _state(1)  # same structure, new values: no new mapping, no new registration
        names2 = _disk(tmp_path / "disk2", sd2)
        _image(ram_dir, sd2, images).wait_done(60)
        for n, p in zip(names2, pins):
            img = images.image(n, os.stat(ram_dir / n).st_size)
            assert (img.remaps, img.pins, img.pinned) == (1, p, True)
            assert (ram_dir / n).read_bytes() == (tmp_path / "disk2" / n).read_bytes(), n
    finally:
        images.close()


def test_tensors_changed_after_staged_are_not_in_the_image(tmp_path: Path, ram_dir: Path) -> None:
    sd = _state(2)
    names = _disk(tmp_path / "disk", sd)
    images = ImageSet(ram_dir)
    try:
        job = _image(ram_dir, sd, images)
        job.wait_staged(60)
        for v in sd:
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
                v.add_(1)  # the trainer's next step
        job.wait_done(60)
        for n in names:
            assert (ram_dir / n).read_bytes() == (tmp_path / "disk" / n).read_bytes(), n
    finally:
        images.close()


def test_copies_wait_for_kernels_queued_on_the_current_stream(ram_dir: Path) -> None:
    a = torch.randn(4096, 4096, device="cuda")
    big = torch.ones(64 * MiB // 4, device="cuda")
    torch.cuda.synchronize()
    for _ in range(4):
        a = a @ a / 64  # keep the stream busy
    big.mul_(2)  # queued behind them: the save must see 2s
    images = ImageSet(ram_dir)
    try:
        names, files, sources = H.plan_layout([big, a], CFG, num_files=1)
        job = H.memory_job(ram_dir, names, files, sources, CFG, rank=0, images=images)
        job.start()
        job.wait_done(60)
        data = torch.frombuffer(bytearray((ram_dir / names[0]).read_bytes()), dtype=torch.uint8)
        seg = next(s for s in files[0].segments if s.payload is None and s.item == 0)
        got = data[seg.file_offset : seg.file_offset + seg.nbytes].view(torch.float32)
        assert bool((got == 2).all())
        seg = next(s for s in files[0].segments if s.payload is None and s.item == 1)
        got = data[seg.file_offset : seg.file_offset + seg.nbytes].view(torch.float32)
        assert torch.equal(got, a.reshape(-1).cpu())
    finally:
        images.close()


def test_shrink_then_grow_copies_land_in_the_file(ram_dir: Path) -> None:
    """Pages past a smaller end leave tmpfs; after growing again, copies must reach the new pages."""
    ram_dir.mkdir(parents=True, exist_ok=True)
    img = ImageFile(ram_dir / "img", pin=True)
    try:
        n = 16 * MiB
        img.ensure(n, chunk_bytes=MiB)
        assert img.pinned and img.remaps == 1
        img.ensure(n - 5 * MiB - 123, chunk_bytes=MiB)
        assert img.pinned and os.stat(img.path).st_size == n - 5 * MiB - 123
        img.ensure(n, chunk_bytes=MiB)
        assert img.pinned and img.remaps == 1
        src = torch.arange(n // 4, device="cuda", dtype=torch.int32)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        dst = img.tensor()
        with torch.cuda.stream(stream):
            for off in range(0, n, MiB):  # one copy per chunk, as the job does
                dst[off : off + MiB].copy_(src.view(torch.uint8)[off : off + MiB], non_blocking=True)
        stream.synchronize()
        back = torch.frombuffer(bytearray(img.path.read_bytes()), dtype=torch.int32)
        assert torch.equal(back, src.cpu())
    finally:
        img.close()


def _crcs(data: bytes, chunk_bytes: int) -> list[int]:
    return [crc32c.crc32c(data[o : o + chunk_bytes]) for o in range(0, len(data), chunk_bytes)]


def test_checksums_of_cuda_saves_are_the_disk_paths_and_follow_each_chunks_copy(
        tmp_path: Path, ram_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk's crc32c is computed from the pinned image once that chunk's D2H copy completed (its
    CUDA event), on the crc threads: ``staged`` does not wait for them, the memory commit (``done``) does,
    and they equal the disk path's checksums of the same bytes, whatever the trainer does after staged."""
    import threading

    sd = _state(3)
    tmp_path.joinpath("disk").mkdir()
    names, files, sources = H.plan_layout(sd, CFG)
    disk = SaveJob(tmp_path / "disk", names, files, sources, CFG, rank=0, mode="snapshot")
    disk.start()
    disk_entries = disk.wait_done(60)
    gate = threading.Event()

    real = engine.chunk_checksum

    def gated_checksum(kind: str, view: memoryview) -> int:
        assert gate.wait(60), "test gate never opened"
        return real(kind, view)

    monkeypatch.setattr(engine, "chunk_checksum", gated_checksum)
    images = ImageSet(ram_dir, pin=True)
    try:
        job = _image(ram_dir, sd, images)
        job.wait_staged(60)  # every D2H copy completed; no checksum could finish
        assert not job.done.done()
        for v in sd:
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
                v.add_(1)  # the trainer's next step: the checksums are of the image, not of the tensors
        gate.set()
        entries = job.wait_done(60)
        for e, d in zip(entries, disk_entries):
            data = (ram_dir / e.name).read_bytes()
            assert data == (tmp_path / "disk" / e.name).read_bytes(), e.name
            assert e.checksum == "crc32c" and e.chunk_checksums == d.chunk_checksums == _crcs(data, e.chunk_bytes)
        assert sum(len(e.chunk_checksums) for e in entries) > 4  # several chunks, several crc tasks
    finally:
        gate.set()
        images.close()
