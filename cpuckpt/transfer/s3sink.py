"""The object-storage sink: a save's chunks uploaded as the parts of one multipart upload per data file.

Part *k* + 1 of a file is its chunk *k* (``io.chunk_bytes``; S3 wants every part but a file's last at least
5 MiB, so a multi-chunk file needs ``io.chunk_bytes`` >= 5 MiB). Chunks are staged in the process's pinned
pool exactly as for files (:class:`~cpuckpt.transfer.sinks.PoolSink`), and the engine's writer threads
upload them in parallel straight from the slots (the engine computes their crc32c first, for the manifest).
``finish`` completes the uploads; ``abort`` (a failed save) aborts them, so no parts are left behind.
A killed process cannot abort: the next save to the same checkpoint path aborts what is left there
(``backend.s3commit``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from pathlib import Path

from cpuckpt import faultpoint
from cpuckpt.config import Config
from cpuckpt.errors import ConfigError
from cpuckpt.format.layout import Chunk, FileLayout
from cpuckpt.paths import S3Url
from cpuckpt.transfer.objstore import PART_MIN_BYTES, PARTS_MAX, ObjectStore, Upload
from cpuckpt.transfer.sinks import DeviceCopies, Offloaded, SlotSource
from cpuckpt.transfer.staging import HostPool, Slot, get_pool

__all__ = ["S3Sink", "S3SinkFactory"]

logger = logging.getLogger(__name__)


class S3Sink:
    """One rank's data files of one save, uploaded to ``url / name`` (see the module docstring)."""

    holds_every_chunk = False
    write_as_copied = False
    offloads = False
    name = "s3"

    def __init__(self, store: ObjectStore, url: S3Url, names: list[str], files: list[FileLayout], cfg: Config, *,
                 rank: int) -> None:
        self.store = store
        self.url = url
        self.names = names
        self.files = files
        self.cfg = cfg
        self.rank = rank
        self.checksum = cfg.integrity.checksum == "crc32c"
        self.checksum_kind = "crc32c"
        self._pool: HostPool | None = None
        self._uploads: list[Upload | None] = [None] * len(names)  # started by the first part of each file
        self._etags: list[list[str | None]] = [[None] * len(f.chunks) for f in files]
        self._lock = threading.Lock()
        self._closed = False
        self._nbytes = 0

    def open(self, nslots: int, done: cf.Future) -> SlotSource:
        chunk_bytes = self.cfg.io.chunk_bytes
        for name, f in zip(self.names, self.files):
            if len(f.chunks) > 1 and chunk_bytes < PART_MIN_BYTES:
                raise ConfigError(f"rank {self.rank}: {self.url / name} has {len(f.chunks)} chunks of "
                                  f"io.chunk_bytes={chunk_bytes}, but S3 parts (all but the last) need at least "
                                  f"{PART_MIN_BYTES} bytes: set io.chunk_bytes to 8MiB or more")
            if len(f.chunks) > PARTS_MAX:
                raise ConfigError(f"rank {self.rank}: {self.url / name} needs {len(f.chunks)} parts of "
                                  f"io.chunk_bytes={chunk_bytes}; S3 allows {PARTS_MAX}: raise io.chunk_bytes")
        self._pool = get_pool(chunk_bytes, max(nslots, 1), pin=self.cfg.staging.pin)
        return self._pool

    def _upload(self, file: int) -> Upload:
        """File ``file``'s multipart upload, started at its first part."""
        up = self._uploads[file]
        if up is not None:
            return up
        with self._lock:
            if self._closed:
                raise RuntimeError(f"rank {self.rank}: uploads of {self.url} already closed")
            up = self._uploads[file]
            if up is None:
                up = self._uploads[file] = self.store.create_upload(self.url / self.names[file])
        return up

    def write(self, chunk: Chunk, slot: Slot) -> None:
        upload = self._upload(chunk.file)
        faultpoint.hit(f"s3-part:{self.names[chunk.file]}:{chunk.index}")
        with slot.view[: chunk.nbytes] as view:
            etag = self.store.upload_part(upload, chunk.index + 1, view)
        self._etags[chunk.file][chunk.index] = etag
        with self._lock:
            self._nbytes += chunk.nbytes

    def finish(self) -> None:
        for i, name in enumerate(self.names):
            if not self.files[i].chunks:  # an empty file: a plain empty object
                self.store.put(self.url / name, b"")
                continue
            etags = self._etags[i]
            missing = [k for k, tag in enumerate(etags) if tag is None]
            if missing:
                raise RuntimeError(f"rank {self.rank}: {self.url / name}: parts {missing[:5]} were never uploaded")
            self.store.complete_upload(self._upload(i), [t for t in etags if t is not None])
        with self._lock:
            self._closed = True

    def abort(self) -> None:
        with self._lock:
            self._closed, uploads = True, [u for u in self._uploads if u is not None]
        for up in uploads:
            try:
                self.store.abort_upload(up)
            except OSError as e:  # the save's own error says more; the next save to this path cleans up
                logger.warning("rank %d: could not abort the upload of %s: %s", self.rank, up.url, e)

    def submit_offload(self, copies: DeviceCopies | None, kind: str) -> Offloaded:
        raise NotImplementedError("the S3 sink computes nothing in another process")

    def stats(self) -> dict[str, float]:
        return {"uploaded_nbytes": float(self._nbytes)}


class S3SinkFactory:
    """A :class:`~cpuckpt.transfer.sinks.SinkFactory` for ``StorageWriter(sink=)``: this rank's files under
    ``url`` through ``store``. (The ``directory`` a factory is given is the writer's path, an S3 URL here.)"""

    def __init__(self, store: ObjectStore, url: S3Url) -> None:
        self.store = store
        self.url = url

    def __call__(self, directory: Path, names: list[str], files: list[FileLayout], cfg: Config, *,
                 rank: int) -> S3Sink:
        return S3Sink(self.store, self.url, names, files, cfg, rank=rank)
