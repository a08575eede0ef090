"""The memory tier's writer process, persisting to object storage: its pieces for an ``s3://`` durable root.

``tier.persister`` runs the same steps for a directory and for a prefix; here are the steps that differ. A slot's
image is uploaded as one multipart upload per file, its chunks (the memory manifest's ``chunk_bytes``, the unit
its checksums were computed in) the parts, read straight from the mapped image and compared with the memory
manifest's checksums (of their kind: crc32c or blocksum32) before they leave (:func:`persist_image_s3`; the
durable entries record crc32c); a rank's part of the manifest is an object, and the coordinator's writer
commits with ``backend.s3commit.S3Target`` (``.metadata`` last, by a conditional PUT). Nothing here runs
collectives: the writers of a save meet only through the objects.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import crc32c

from cpuckpt import faultpoint
from cpuckpt.backend import s3commit
from cpuckpt.config import Config
from cpuckpt.errors import CheckpointCorrupt, CheckpointTimeoutError, ConfigError, IntegrityError, StorageIOError
from cpuckpt.format.checksums import CRC32C, KINDS, chunk_checksum
from cpuckpt.format.manifest import FileEntry, part_name
from cpuckpt.paths import S3Url
from cpuckpt.tier.imagecopy import expected_crcs
from cpuckpt.transfer.objstore import PART_MIN_BYTES, ObjectStore
from cpuckpt.transfer.threads import run_parallel

__all__ = ["await_parts", "committed_save_id", "part_save_id", "persist_image_s3"]

POLL_S = 0.05


def committed_save_id(store: ObjectStore, url: S3Url) -> str | None:
    """The save committed at ``url`` (None when incomplete)."""
    if not s3commit.check_complete(store, url).complete:
        return None
    manifest = s3commit.read_manifest(store, url)
    return manifest.save_id if manifest is not None else None


part_save_id = s3commit.manifest_save_id  # the save a rank's manifest part object belongs to


def persist_image_s3(src: Path, url: S3Url, store: ObjectStore, cfg: Config, *, expect: FileEntry) -> FileEntry:
    """Upload the memory image ``src`` to the object ``url``, each chunk checked against ``expect`` first (its
    kind: crc32c or blocksum32). The entry returned records crc32c when ``expect`` is of a kind known here (a
    blocksum32 one: both computed per chunk), else ``expect``'s kind without checksums.

    Raises:
        CheckpointCorrupt: ``src`` does not match its memory manifest (size, chunk count, a checksum).
        ConfigError: more than one chunk smaller than S3's 5 MiB part minimum.
        StorageIOError: reading ``src`` or an upload failed (the upload is aborted).
        CheckpointTimeoutError: not done within ``timeout_s``.
    """
    chunk_bytes = expect.chunk_bytes if expect.chunk_checksums else cfg.io.chunk_bytes
    try:
        fd = os.open(src, os.O_RDONLY)
    except OSError as e:
        raise StorageIOError(f"cannot open memory image {src}: {e}", path=str(src), errno_=e.errno) from e
    try:
        size = os.fstat(fd).st_size
        if size < expect.nbytes:
            raise CheckpointCorrupt(f"memory image {src} holds {size} bytes, its memory manifest says "
                                    f"{expect.nbytes}; not persisted")
        expected = expected_crcs(str(src), expect, expect.nbytes, chunk_bytes)
        durable = CRC32C if expect.checksum in KINDS else expect.checksum  # never the memory kind
        if expect.nbytes == 0:
            store.put(url, b"")
            return FileEntry(name=url.name, nbytes=0, chunk_bytes=chunk_bytes, checksum=durable)
        offsets = list(range(0, expect.nbytes, chunk_bytes))
        if len(offsets) > 1 and chunk_bytes < PART_MIN_BYTES:
            raise ConfigError(f"{url}: memory chunks of {chunk_bytes} bytes are below S3's {PART_MIN_BYTES}-byte part "
                              "minimum: set io.chunk_bytes to 8MiB or more")
        with mmap.mmap(fd, expect.nbytes, prot=mmap.PROT_READ) as image:
            view = memoryview(image)
            upload = store.create_upload(url)
            crcs = [0] * len(offsets)

            def one(k: int, cancel: threading.Event) -> str:
                lo = offsets[k]
                piece = view[lo:min(lo + chunk_bytes, expect.nbytes)]
                try:
                    crcs[k] = crc32c.crc32c(piece)
                    if expected is not None:
                        seen = crcs[k] if expect.checksum == CRC32C else chunk_checksum(expect.checksum, piece)
                        if seen != expected[k]:
                            raise CheckpointCorrupt(f"memory image {src}: checksum mismatch in bytes [{lo}, "
                                                    f"{lo + len(piece)}) (chunk {k}, {expect.checksum}) since its "
                                                    "memory commit; not persisted")
                    faultpoint.hit(f"persist-chunk:{url.name}:{k}")
                    return store.upload_part(upload, k + 1, piece)
                finally:
                    # The error raised keeps this frame, and ``piece`` in it, alive: unreleased, it holds the
                    # mapping, whose close then raises BufferError in place of that error.
                    piece.release()

            try:
                etags = run_parallel(one, range(len(offsets)), threads=cfg.io.threads, timeout_s=cfg.timeout_s,
                                     name="cpuckpt-persist")
                store.complete_upload(upload, etags)
            except BaseException:
                store.abort_upload(upload)
                raise
            finally:
                view.release()
    finally:
        os.close(fd)
    return FileEntry(name=url.name, nbytes=expect.nbytes, chunk_bytes=chunk_bytes, checksum=durable,
                     chunk_checksums=crcs if durable == CRC32C else [])


def await_parts(store: ObjectStore, url: S3Url, save_id: str, world_size: int, deadline: float,
                cancelled: callable) -> list[str]:  # type: ignore[valid-type]
    """Poll until every rank's manifest part *of this save* is under ``url``; returns the prefixes.

    Raises:
        IntegrityError: ``cancelled()`` (the trainers withdrew the persist). CheckpointTimeoutError: ``deadline``.
    """
    prefixes = [f"__{r}_" for r in range(world_size)]
    while missing := [p for p in prefixes if part_save_id(store, url / part_name(p)) != save_id]:
        if cancelled():
            raise IntegrityError(f"{url}: the trainer cancelled the persist of {save_id[:8]} while the parts of "
                                 f"{missing} were missing; not committed")
        if time.monotonic() > deadline:
            raise CheckpointTimeoutError(f"{url}: the parts of {missing} for save {save_id[:8]} never arrived; "
                                         "not committed")
        time.sleep(POLL_S)
    return prefixes
