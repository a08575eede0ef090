"""The memory tier writer's persist of a memory checkpoint whose manifest records blocksum32: every chunk is
compared with the memory checksums (blocksum32) before it is written or uploaded, and the durable copy records
crc32c (``integrity.checksum``), never the memory kind."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import pytest

from cpuckpt.config import Config
from cpuckpt.errors import CheckpointCorrupt, IntegrityError
from cpuckpt.format.checksums import blocksum32
from cpuckpt.format.manifest import FileEntry
from cpuckpt.paths import S3Url
from cpuckpt.testing.faults import flip_byte
from cpuckpt.tier import s3persist
from cpuckpt.tier.imagecopy import persist_image
from cpuckpt.transfer.objstore import Upload

CHUNK = 64 * 1024


def _sums(data: bytes, chunk: int) -> list[int]:
    return [blocksum32(memoryview(data)[o:o + chunk]) for o in range(0, len(data), chunk)]


def _cfg() -> Config:
    return Config.from_dict({"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered"}}, env=False)


def _image(tmp_path: Path, nbytes: int = 5 * CHUNK + 777) -> tuple[Path, FileEntry]:
    src = tmp_path / "ram" / "__0_0.distcp"
    src.parent.mkdir()
    src.write_bytes(os.urandom(nbytes))
    data = src.read_bytes()
    return src, FileEntry(src.name, len(data), CHUNK, "blocksum32", _sums(data, CHUNK))


def test_persist_image_compares_blocksum32_and_records_crc32c(tmp_path):
    src, expect = _image(tmp_path)
    data = src.read_bytes()
    (tmp_path / "out").mkdir()
    out = persist_image(src, tmp_path / "out" / "ok.distcp", _cfg(), threads=3, expect=expect)
    assert (tmp_path / "out" / "ok.distcp").read_bytes() == data
    assert (out.checksum, out.chunk_bytes) == ("crc32c", CHUNK)
    assert out.chunk_checksums == [crc32c.crc32c(data[o:o + CHUNK]) for o in range(0, len(data), CHUNK)]

    flip_byte(src, 3 * CHUNK + 5)  # one RAM page damaged after the memory commit
    with pytest.raises(CheckpointCorrupt, match=r"chunk 3\): recorded blocksum32 .*not persisted") as ei:
        persist_image(src, tmp_path / "out" / "bad.distcp", _cfg(), expect=expect)
    assert isinstance(ei.value, IntegrityError) and str(src) in str(ei.value)


def test_persist_image_with_blocksum32_and_integrity_checksum_none(tmp_path):
    """The durable copy follows ``integrity.checksum`` (none: no checksums); the memory ones are still compared."""
    src, expect = _image(tmp_path)
    cfg = Config.from_dict({"io": {"chunk_bytes": CHUNK, "backend": "buffered"}, "integrity": {"checksum": "none"}},
                           env=False)
    out = persist_image(src, tmp_path / "d", cfg, expect=expect)
    assert out.checksum == "none" and out.chunk_checksums == [0] * 6
    flip_byte(src, 7)
    with pytest.raises(CheckpointCorrupt, match=r"chunk 0\): recorded blocksum32"):
        persist_image(src, tmp_path / "d2", cfg, expect=expect)


class _Store:
    """The object store calls ``persist_image_s3`` makes, in a dict."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.parts: dict[str, dict[int, bytes]] = {}

    def put(self, url: S3Url, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        self.objects[str(url)] = bytes(data)
        return True

    def create_upload(self, url: S3Url) -> Upload:
        self.parts[str(url)] = {}
        return Upload(url, str(url))

    def upload_part(self, upload: Upload, number: int, data: memoryview) -> str:
        self.parts[upload.upload_id][number] = bytes(data)
        return f"etag{number}"

    def complete_upload(self, upload: Upload, etags: list[str]) -> None:
        parts = self.parts.pop(upload.upload_id)
        self.objects[upload.upload_id] = b"".join(parts[k] for k in sorted(parts))

    def abort_upload(self, upload: Upload) -> None:
        self.parts.pop(upload.upload_id, None)


def test_persist_to_object_storage_compares_blocksum32_and_records_crc32c(tmp_path, monkeypatch):
    monkeypatch.setattr(s3persist, "PART_MIN_BYTES", 1)  # 64 KiB parts: S3's 5 MiB minimum is the store's rule
    src, expect = _image(tmp_path)
    data = src.read_bytes()
    store, url = _Store(), S3Url.parse("s3://bucket/ckpt/step_7") / src.name
    out = s3persist.persist_image_s3(src, url, store, _cfg(), expect=expect)  # type: ignore[arg-type]
    assert store.objects[str(url)] == data
    assert (out.checksum, out.chunk_bytes, out.nbytes) == ("crc32c", CHUNK, len(data))
    assert out.chunk_checksums == [crc32c.crc32c(data[o:o + CHUNK]) for o in range(0, len(data), CHUNK)]

    del store.objects[str(url)]
    flip_byte(src, 4 * CHUNK + 9)
    with pytest.raises(CheckpointCorrupt, match=r"chunk 4, blocksum32\) since its memory commit; not persisted"):
        s3persist.persist_image_s3(src, url, store, _cfg(), expect=expect)  # type: ignore[arg-type]
    assert str(url) not in store.objects and not store.parts  # aborted
    # crc32c memory checksums too: the error raised is the mismatch (it was a BufferError from closing the mapping
    # that the failed chunk's memoryview, kept by the error's traceback, still held)
    crcs = FileEntry(src.name, len(data), CHUNK, "crc32c",
                     [crc32c.crc32c(data[o:o + CHUNK]) for o in range(0, len(data), CHUNK)])
    with pytest.raises(CheckpointCorrupt, match=r"chunk 4, crc32c\) since its memory commit"):
        s3persist.persist_image_s3(src, url, store, _cfg(), expect=crcs)  # type: ignore[arg-type]


def test_an_empty_blocksum32_image_persists_as_crc32c(tmp_path, monkeypatch):
    src, expect = _image(tmp_path, 0)
    assert expect.chunk_checksums == []
    out = persist_image(src, tmp_path / "d", _cfg(), expect=expect)
    assert (out.checksum, out.nbytes, out.chunk_checksums) == ("crc32c", 0, [])
    store = _Store()
    out = s3persist.persist_image_s3(src, S3Url.parse("s3://bucket/x") / src.name, store, _cfg(),  # type: ignore[arg-type]
                                     expect=expect)
    assert (out.checksum, out.nbytes, out.chunk_checksums) == ("crc32c", 0, [])


def test_a_file_sets_durable_marker_records_the_persists_crc32c_in_place_of_blocksum32(tmp_path):
    """A DeepSpeed tag persisted from a blocksum32 slot: its durable marker records what the writers' persists
    computed (crc32c), as a durable manifest does, so a release that knows crc32c only verifies it; a marker of crc32c
    files is the slot's, byte for byte; a file no rank's part lists is an IntegrityError (never committed)."""
    import json

    from cpuckpt.format.manifest import Manifest
    from cpuckpt.tier.persister import _durable_marker
    from cpuckpt.tier.tagmarker import TagFile, TagMarker

    a, b = os.urandom(5000), os.urandom(300)
    memory = {"model.pt": TagFile(0, len(a), 4096, "blocksum32", (blocksum32(a[:4096]), blocksum32(a[4096:]))),
              "optim.pt": TagFile(1, len(b), 4096, "crc32c", (crc32c.crc32c(b),))}
    marker = TagMarker("global_step4", 2, memory, global_step=4, save_id="s1").to_json().encode()
    parts = []
    for rank, (name, data) in enumerate((("model.pt", a), ("optim.pt", b))):
        crcs = [crc32c.crc32c(data[k : k + 4096]) for k in range(0, len(data), 4096)]
        part = tmp_path / f"part-{rank}"
        entry = FileEntry(name, len(data), 4096, "crc32c", crcs)
        part.write_text(Manifest(save_id="s1", files={name: entry}).to_json())
        parts.append(part)
    durable = TagMarker.from_json(_durable_marker(marker, parts, tmp_path).decode(), "durable")
    assert durable.files["model.pt"] == TagFile(0, len(a), 4096, "crc32c", (crc32c.crc32c(a[:4096]),
                                                                             crc32c.crc32c(a[4096:])))
    assert durable.files["optim.pt"] == memory["optim.pt"] and durable.save_id == "s1" and durable.global_step == 4
    plain = TagMarker("global_step4", 2, {"optim.pt": memory["optim.pt"]}, save_id="s1").to_json().encode()
    assert _durable_marker(plain, parts, tmp_path) == plain
    with pytest.raises(IntegrityError, match=r"model\.pt"):
        _durable_marker(marker, parts[1:], tmp_path)
    assert json.loads(marker)["files"]["model.pt"]["checksum"] == "blocksum32"
