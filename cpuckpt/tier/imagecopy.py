"""An image's bytes to durable storage: the memory tier's writer process copies each data file of a memory
checkpoint through the file backends, checksumming every chunk on the way and comparing it with the memory
checkpoint's checksums when it has them (of their kind: crc32c or blocksum32), so a RAM page damaged after the
save is never made durable. The durable copy records crc32c, whatever kind the memory checkpoint used.

Writer side only: nothing here imports torch (the writer process starts in a fraction of a second).
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from pathlib import Path

import crc32c

from cpuckpt import faultpoint
from cpuckpt.config import Config
from cpuckpt.errors import CheckpointCorrupt, CheckpointTimeoutError, StorageIOError
from cpuckpt.format.checksums import CRC32C, chunk_checksum, verifiable
from cpuckpt.format.manifest import FileEntry
from cpuckpt.tier import pinning
from cpuckpt.transfer.files import BufferedFileBackend, get_backend
from cpuckpt.transfer.threads import run_parallel

__all__ = ["expected_crcs", "os_error", "persist_image"]


def os_error(what: str, e: OSError, path: Path, nbytes: int | None = None) -> StorageIOError:
    """``e`` of ``what`` on the memory image ``path`` as a ``StorageIOError`` (errno and path kept)."""
    size = f" ({nbytes} bytes)" if nbytes is not None else ""
    return StorageIOError(f"{what} failed on memory image {path}{size}: [errno {e.errno}] {e.strerror or e}",
                          path=str(path), nbytes=nbytes, errno_=e.errno)


def expected_crcs(src: str, expect: FileEntry | None, nbytes: int, chunk_bytes: int) -> list[int] | None:
    """The memory manifest's checksums of ``src`` to compare with, of kind ``expect.checksum`` (None: it recorded
    none, or none of a kind known here)."""
    if expect is None or not verifiable(expect):
        return None
    if expect.nbytes != nbytes:
        raise CheckpointCorrupt(f"memory image {src} holds {nbytes} bytes, its memory manifest says {expect.nbytes}; "
                                "not persisted")
    nchunks = -(-nbytes // chunk_bytes)
    if len(expect.chunk_checksums) != nchunks:
        raise CheckpointCorrupt(f"memory image {src}: its memory manifest has {len(expect.chunk_checksums)} chunk "
                                f"checksums for {nchunks} chunks of {chunk_bytes} bytes; not persisted")
    return expect.chunk_checksums


def persist_image(src: str | os.PathLike, dst: str | os.PathLike, cfg: Config, *,
                  threads: int | None = None, expect: FileEntry | None = None) -> FileEntry:
    """Copy the image ``src`` to the durable file ``dst``, checksumming every chunk on the way.

    Chunks of ``io.chunk_bytes`` are read into page-aligned buffers on ``threads`` (default
    ``io.threads``) threads, checksummed (crc32c with ``integrity.checksum: crc32c``, as ``SaveJob`` does for
    the same bytes: the returned entry's) and written at the same offset through ``io.backend`` (O_DIRECT where
    allowed: the last chunk is padded, and ``finish_write`` truncates the file to its size and fsyncs it when
    ``io.fsync``). The caller fsyncs ``dst``'s directory once its files are written.

    ``expect`` is ``src``'s entry in the memory checkpoint's manifest: when it records checksums per chunk
    (``memory.checksum``; crc32c or blocksum32), every chunk's checksum of that kind is compared with it after
    it is read and before it is written (its ``chunk_bytes`` is then the unit), so bytes damaged in RAM since
    the memory commit never reach ``dst`` whole; the caller must not commit ``dst`` after an error. A blocksum32
    memory entry costs a second pass over each chunk (blocksum32 to compare, crc32c to record). Between reading
    a chunk and writing it, each task passes the fault point ``persist-chunk:<dst name>:<chunk index>``.

    Raises:
        CheckpointCorrupt: ``src`` does not match ``expect`` (a chunk's checksum, its size or chunk count).
        StorageIOError: reading ``src`` or writing ``dst`` failed, or ``src`` shrank meanwhile.
        CheckpointTimeoutError: not done within ``timeout_s``.
    """
    src_s, dst_s = str(src), str(dst)
    chunk_bytes, align = cfg.io.chunk_bytes, cfg.layout.align_bytes
    if expect is not None and verifiable(expect):
        chunk_bytes = expect.chunk_bytes  # the unit the checksums were computed in
        if chunk_bytes <= 0 or chunk_bytes % align:
            raise CheckpointCorrupt(f"memory image {src_s}: its manifest's chunk_bytes {chunk_bytes} is not a positive "
                                    f"multiple of layout.align_bytes ({align}); not persisted")
    checksum = cfg.integrity.checksum == CRC32C  # what the durable entry records (never the memory kind)
    reader = BufferedFileBackend()
    backend = get_backend(cfg.io.backend, Path(dst).parent, align)
    sfd = reader.open_read(src_s)
    buffers: list[mmap.mmap] = []
    try:
        try:
            nbytes = os.fstat(sfd).st_size
        except OSError as e:
            raise os_error("fstat", e, Path(src)) from e
        offsets = list(range(0, nbytes, chunk_bytes))
        crcs = [0] * len(offsets)
        expected = expected_crcs(src_s, expect, nbytes, chunk_bytes)
        kind = expect.checksum if expected is not None and expect is not None else None
        name = Path(dst).name
        nthreads = max(1, min(threads or cfg.io.threads, len(offsets)))
        free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for _ in range(nthreads if offsets else 0):
            buffers.append(mmap.mmap(-1, chunk_bytes))  # page-aligned: O_DIRECT-ready
            free.put(buffers[-1])
        dfd = backend.open_write(dst_s)

        def copy_chunk(k: int, cancel: threading.Event) -> None:
            off = offsets[k]
            n = min(chunk_bytes, nbytes - off)
            buf = free.get()
            view = memoryview(buf)
            try:
                if cancel.is_set():
                    return
                got = reader.pread_into(sfd, view[:n], off, src_s)
                if cancel.is_set():  # another chunk failed or the wait timed out: the files may be closed
                    return
                if got != n:
                    raise StorageIOError(f"memory image {src_s} shrank while being persisted: {got} of {n} bytes "
                                         f"at offset {off}", path=src_s, offset=off, nbytes=n)
                if checksum:
                    crcs[k] = crc32c.crc32c(view[:n])
                if kind is not None and expected is not None:
                    seen = crcs[k] if checksum and kind == CRC32C else chunk_checksum(kind, view[:n])
                    if seen != expected[k]:
                        raise CheckpointCorrupt(
                            f"memory image {src_s}: checksum mismatch in bytes [{off}, {off + n}) (chunk {k}): "
                            f"recorded {kind} {expected[k]} at the memory commit, read {seen}; the RAM copy is "
                            f"damaged and is not persisted to {dst_s}")
                faultpoint.hit(f"persist-chunk:{name}:{k}")
                io_n = pinning.round_up(n, align) if backend.aligned else n
                if io_n > n:
                    view[n:io_n] = bytes(io_n - n)
                backend.pwrite(dfd, view[:io_n], off, dst_s)
            finally:
                view.release()
                free.put(buf)

        try:
            run_parallel(copy_chunk, range(len(offsets)), threads=nthreads, timeout_s=cfg.timeout_s,
                         name="cpuckpt-persist")
        except CheckpointTimeoutError:
            # Tasks may still be running: closing now would let a late pwrite land in whatever file
            # reuses the descriptor number. Both descriptors are left open (a rare, bounded leak), and
            # the tasks' closures now see -1, so a late read or write fails (EBADF) instead.
            sfd = dfd = -1
            raise
        except BaseException:
            backend.close(dfd)
            raise
        backend.finish_write(dfd, nbytes, dst_s, cfg.io.fsync)
    finally:
        if sfd >= 0:
            reader.close(sfd)
        for buf in buffers:
            try:
                buf.close()
            except BufferError:  # a timed-out task still holds it: freed when it ends
                pass
    return FileEntry(name=Path(dst).name, nbytes=nbytes, chunk_bytes=chunk_bytes,
                     checksum=CRC32C if checksum else "none", chunk_checksums=crcs if checksum else [0] * len(crcs))
