"""The memory tier's copy process (``memory.copy_process``): a save's device-to-host copies and checksums
done by a process of ours, so nothing of them runs in the trainer's process.

A memory save every iteration copies the whole state to the host each step. Done from the trainer's process,
its enqueues, waits and crc32c threads take the trainer's interpreter (the GIL) while it trains. Here the
trainer only enqueues the device-to-device snapshot (``staging.device_snapshot``, milliseconds) and writes the
few host bytes of the files (record skeletons); this rank's copy process, started once per tier, then

1. waits on the GPU for the trainer's snapshot (an interprocess CUDA event),
2. copies the snapshot buffer (opened once over CUDA IPC) into the slot's image files, which it maps
   ``MAP_SHARED`` and pins itself, all of a save's copies enqueued at once on its own stream (a second
   process's copies do not queue ahead of the trainer's own device-to-host reads: the floor tool's
   ``ipc_d2h``),
3. computes each chunk's checksum from the image once that chunk's copy completed, on its own threads
   (crc32c; or blocksum32, ``memory.checksum_kind``, of the bytes its copies do not write when the trainer
   summed the device bytes on the GPU),

and replies ``copied`` (the snapshot buffer may be reused) then ``done`` with the checksums, which the
trainer's :class:`~cpuckpt.transfer.save_job.SaveJob` records in the memory commit. Without a device
snapshot (CPU state, or GPU copies paced from the trainer) the process computes the checksums only.

The messages are pickles of plain values only (no classes: the process refuses any global), over a socket
pair private to the two processes. A process that dies fails the saves it had with an error naming its pid,
exit status and log; the next save starts a new one.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import functools
import io
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from cpuckpt.errors import StagingError
from cpuckpt.format.checksums import BLOCKSUM32, KINDS, blocksum32_except, chunk_checksum
from cpuckpt.tier import pinning

__all__ = ["CopyProcess", "ImageDesc", "RemoteSave", "main"]

logger = logging.getLogger(__name__)

# An image file as the trainer describes it to the process: path, the name of the trainer's object that owns it
# (a new one: the process maps the file anew), its size, and the smallest size it had since its last description
# (registrations past it are dropped: pinning.stale). Made under the process's lock, so the process reads the
# descriptions of an image in the order they were made (:meth:`CopyProcess.submit`).
ImageDesc = tuple[str, str, int, int]
Describe = Callable[[], Sequence[ImageDesc]]



@dataclass
class RemoteSave:
    """One save handed to the copy process: ``copied`` once its copies completed (the snapshot buffer is free),
    ``done`` with the checksum of every chunk per file (empty lists without checksums)."""

    copied: cf.Future[None]
    done: cf.Future[list[list[int]]]
    keep: Any = None  # what must live until ``copied`` (the trainer's event the copies wait for)


def _ended(proc: subprocess.Popen, within_s: float) -> bool:
    """Whether ``proc`` exits within ``within_s`` (a process's sockets close before it can be reaped: a send that
    failed on its closed socket may come just before its exit status does)."""
    try:
        proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def _dumps(msg: tuple) -> bytes:
    return pickle.dumps(msg, protocol=5)


class _PlainUnpickler(pickle.Unpickler):
    """Plain values only: no message between the two processes names a class or function."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"copy process message names {module}.{name}: refused")


def _loads(data: bytes) -> tuple:
    return _PlainUnpickler(io.BytesIO(data)).load()


# -- the trainer's side ------------------------------------------------------------------------------------
class CopyProcess:
    """This rank's copy process, as its trainer sees it: started at the first save (or :meth:`start`),
    restarted by the save after one died, ended by :meth:`close`. Thread-safe."""

    def __init__(self, rank: int, log_path: Path, *, threads: int, timeout_s: float,
                 warm_device: int | None = None) -> None:
        self.rank = rank
        self.log_path = Path(log_path)
        self.threads = threads
        self.timeout_s = timeout_s
        # a process that will copy device snapshots imports torch and makes its CUDA context as it starts (-1: no
        # device in use yet, torch imported only), beside the trainer's work until its first message needs them:
        # otherwise both came at the first image it pins, inside the wait of a job before it trains
        self.warm_device = warm_device
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._pending: dict[int, RemoteSave] = {}
        self._next_id = 0
        self._buffers: dict[int, int] = {}  # id(snapshot buffer) -> its key in the process, while it lives
        # keys of freed snapshot buffers, sent with the next message: a buffer's finalizer runs on whatever thread
        # frees it, maybe one inside this object's lock, so it never takes the lock itself
        self._dropped: collections.deque[tuple[int, int]] = collections.deque()
        self._closed = False
        # replies are settled here, in order, not on the reading thread: a save's callbacks (its job's end, the
        # commit it starts) must not hold up the replies of the saves after it
        self._settler = cf.ThreadPoolExecutor(1, thread_name_prefix=f"cpuckpt-copy-settle-{rank}")

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the process now (its interpreter and imports take seconds: before training, not at a save)."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> Connection:
        """Lock held: the connection to a running process, starting one if there is none."""
        if self._closed:
            raise StagingError(f"rank {self.rank}: the copy process was closed")
        if self._conn is not None and self._proc is not None and self._proc.poll() is None:
            return self._conn
        ours, theirs = socket.socketpair()
        try:
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "cpuckpt.tier.copier", "--fd", str(theirs.fileno()),
                     "--threads", str(self.threads), "--close-s", str(self.timeout_s),
                     *(["--warm-device", str(self.warm_device)] if self.warm_device is not None else [])],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, close_fds=True,
                    pass_fds=(theirs.fileno(),), start_new_session=True)
        except OSError as e:
            ours.close()
            raise StagingError(f"rank {self.rank}: the copy process could not be started: {e}") from e
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._buffers = {}  # a new process knows none of the buffers
        # this process's saves only: the reader of a process that ended fails its own, never a new one's
        self._pending = {}
        self._reader = threading.Thread(target=self._read, args=(self._conn, self._proc, self._pending),
                                        name=f"cpuckpt-copy-replies-{self.rank}", daemon=True)
        self._reader.start()
        logger.info("cpuckpt memory tier: rank %d copy process pid %d started (log %s)", self.rank, self._proc.pid,
                    self.log_path)
        return self._conn

    def prepare(self, files: Describe, chunk_bytes: int, device: int | None) -> None:
        """Map and pin image files in the process ahead of their first save, under CUDA ``device`` (the trainer's:
        a registration counts for the context that made it); ``files`` describes them (called under the lock that
        orders every description sent)."""
        with self._lock:
            conn = self._ensure()
            self._send_drops(conn)
            self._send_described(conn, files, lambda desc: ("prepare", desc, chunk_bytes, device))

    def wait_prepared(self, timeout_s: float) -> bool:
        """Wait until the process has pinned every image :meth:`prepare` asked for (a job waits before it trains:
        pins taken while it trains held up its first saves by seconds). True once they are (or none was ever
        started: nothing was asked of one); False at the timeout.

        Raises:
            StagingError: the process failed or exited first, was closed, or the request could not be sent.
        """
        remote = RemoteSave(cf.Future(), cf.Future())
        with self._lock:
            if self._closed:
                raise StagingError(f"rank {self.rank}: the copy process was closed")
            if self._conn is None:
                if self._proc is None:
                    return True
                raise StagingError(f"rank {self.rank}: the copy process (pid {self._proc.pid}) exited; see "
                                   f"{self.log_path}")
            conn = self._conn
            token = self._next_id
            self._next_id += 1
            pending = self._pending
            pending[token] = remote
            try:
                self._send(conn, ("ready", token))  # a process that died says so (its socket closed first)
            except BaseException:
                pending.pop(token, None)
                raise
        try:
            remote.done.result(timeout=timeout_s)
        except cf.TimeoutError:
            with self._lock:
                pending.pop(token, None)  # not a save of its: its end must not count one as failed
            return False
        return True

    def submit(self, files: Describe, chunks: Sequence[tuple[int, int, int]], *,
               chunk_bytes: int, checksum: str, buffer: Any = None, ready: Any = None,
               ops: array | None = None, host_share: bool = False) -> RemoteSave:
        """Hand one save over: ``files`` describes its images (:data:`ImageDesc`; called under the lock that
        orders every description sent), ``chunks`` (file index, offset, bytes) in order, ``checksum`` their kind
        (:mod:`cpuckpt.format.checksums`; empty: none); with ``buffer`` (the device snapshot, a uint8 CUDA
        tensor), ``ready`` (an interprocess CUDA event after the snapshot) and ``ops`` (:data:`OP_FIELDS` int64 per
        copy), the copies too; ``host_share`` (blocksum32): each chunk's sum leaves out the bytes the copies write
        (the trainer summed them on the GPU).

        Raises:
            StagingError: the process could not be started or the request not sent.
        """
        remote = RemoteSave(cf.Future(), cf.Future(), keep=ready)
        with self._lock:
            conn = self._ensure()
            self._send_drops(conn)
            save_id = self._next_id
            self._next_id += 1
            copy = None
            shared = None  # a buffer the process learns of with this message
            if buffer is not None:
                key = self._buffers.get(id(buffer))
                desc = None
                if key is None:
                    key = save_id
                    desc = _share(buffer)
                    shared = (id(buffer), key)
                copy = (key, desc, ready.ipc_handle(), buffer.device.index or 0, ops.tobytes() if ops else b"")
            pending = self._pending
            pending[save_id] = remote
            try:
                self._send_described(conn, files, lambda desc: ("save", save_id, desc, list(chunks), chunk_bytes,
                                                                checksum, copy, host_share))
            except BaseException:
                pending.pop(save_id, None)
                raise
            if shared is not None:  # only once sent: a failed message shares it again with the next one
                self._buffers[shared[0]] = shared[1]
                weakref.finalize(buffer, self._drop, *shared)
        return remote

    def _send_described(self, conn: Connection, files: Describe, message: Callable[[list], tuple]) -> None:
        """Lock held: ``message`` of the images as ``files`` describes them now. A description read and not sent
        (an error, an interrupt) would leave the process keeping registrations past a shrink it never hears of:
        that process is ended, the next message starts a new one (nothing pinned)."""
        desc = list(files())
        try:
            self._send(conn, message(desc))
        except BaseException:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                logger.error("rank %d: a message to the copy process (pid %d) was not sent after its images were "
                             "described; the process is ended (the next save starts a new one)", self.rank, proc.pid)
                proc.kill()
            self._conn = None  # the next message starts a new process (its reader reaps this one)
            raise

    def _send_drops(self, conn: Connection) -> None:
        """Lock held, before any buffer is looked up: the freed buffers are forgotten here (a new buffer may have
        the id of a freed one) and let go of in the process."""
        while self._dropped:
            ident, key = self._dropped.popleft()
            if self._buffers.get(ident) == key:
                del self._buffers[ident]
            self._send(conn, ("drop", key))

    def _send(self, conn: Connection, msg: tuple) -> None:
        try:
            with self._send_lock:
                conn.send_bytes(_dumps(msg))
        except OSError as e:
            proc = self._proc
            if proc is not None and _ended(proc, within_s=1.0):  # its socket closes as it exits, before it is reaped
                raise StagingError(f"rank {self.rank}: the copy process (pid {proc.pid}) exited with status "
                                   f"{proc.returncode}; see {self.log_path}") from e
            raise StagingError(f"rank {self.rank}: sending to the copy process (pid {self.pid}) failed: {e}; "
                               f"see {self.log_path}") from e

    def _drop(self, ident: int, key: int) -> None:
        """A snapshot buffer was freed: the process lets go of its mapping of it at the next message (a finalizer:
        it takes no lock)."""
        self._dropped.append((ident, key))

    def _read(self, conn: Connection, proc: subprocess.Popen, pending: dict[int, RemoteSave]) -> None:
        """The replies of one process, until it ends; then every save it still had (``pending``) fails."""
        try:
            while True:
                msg = _loads(conn.recv_bytes())
                kind, save_id = msg[0], msg[1]
                with self._lock:
                    remote = pending.get(save_id)
                    if kind in ("done", "error", "ready"):
                        pending.pop(save_id, None)
                if remote is not None:
                    self._settle_later(remote, msg, proc.pid)
        except (EOFError, OSError):
            pass
        except BaseException as e:  # a malformed reply: the process is not trusted further
            logger.error("rank %d: bad reply from the copy process (pid %d): %r", self.rank, proc.pid, e)
            proc.kill()
        with self._lock:
            failed = list(pending.values())
            pending.clear()
            if self._conn is conn:
                self._conn = None
            closed = self._closed
        try:
            code = proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        conn.close()
        if failed or not closed:
            logger.error("rank %d: the copy process (pid %d) exited with status %s; %d save(s) failed; see %s",
                         self.rank, proc.pid, code, len(failed), self.log_path)
        for remote in failed:
            # it is gone: no copy of it still lands anywhere, so the snapshot buffer is free either way
            err = f"exited with status {code} before the save's copies and checksums were done; see {self.log_path}"
            self._settle_later(remote, ("error", -1, err), proc.pid)

    def _settle_later(self, remote: RemoteSave, msg: tuple, pid: int) -> None:
        """Settle on the settler thread (in order), or here once it was shut down (a close that stopped waiting)."""
        try:
            self._settler.submit(self._settle_reply, remote, msg, pid)
        except RuntimeError:  # cannot schedule new futures after shutdown
            self._settle_reply(remote, msg, pid)

    def _settle_reply(self, remote: RemoteSave, msg: tuple, pid: int) -> None:
        kind = msg[0]
        if kind == "copied":
            _settle(remote.copied, None)
        elif kind == "done":
            _settle(remote.copied, None)
            _settle(remote.done, msg[2])
        elif kind == "ready":  # a wait_prepared
            _settle(remote.copied, None)
            _settle(remote.done, [])
        elif kind == "error":
            err = StagingError(f"rank {self.rank}: the copy process (pid {pid}) {msg[2]}")
            _settle(remote.copied, error=err)
            _settle(remote.done, error=err)

    def close(self) -> None:
        """End the process (after the saves it has: it finishes them first) and wait for it, bounded."""
        with self._lock:
            self._closed = True
            conn, proc, reader = self._conn, self._proc, self._reader
        if conn is None or proc is None:
            return
        try:
            with self._send_lock:
                conn.send_bytes(_dumps(("close",)))
        except OSError:
            pass
        if reader is not None:
            reader.join(self.timeout_s)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if reader is not None:
            reader.join(10.0)  # it fails what the process still had, once it sees the end
        self._settler.shutdown(wait=True)


def _settle(fut: cf.Future, result: object = None, *, error: BaseException | None = None) -> None:
    """Complete ``fut`` unless it already is (a failed save's ``copied`` too: the process drained its copies
    before it replied, or it is gone)."""
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except cf.InvalidStateError:
        pass


def _share(buffer: Any) -> tuple:
    """The CUDA IPC description of ``buffer``'s storage, as plain values (torch's own sharing, without
    pickling classes): the process opens it with :func:`_open_shared`."""
    storage = buffer.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return (int(device), bytes(handle), int(size), int(offset), bytes(ref_handle), int(ref_offset),
            bytes(event_handle) if event_handle else b"", bool(event_sync), int(buffer.storage_offset()),
            int(buffer.numel()))


# -- the process ------------------------------------------------------------------------------------------
def _open_shared(desc: tuple) -> Any:
    import torch

    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync, t_offset, numel = desc
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(device, handle, size, offset, ref_handle, ref_offset,
                                                    event_handle or None, event_sync)
    t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    return t.set_(storage, t_offset, (numel,), (1,))


def _cuda_available() -> bool:
    """Whether this process can pin (imports torch: only a process that copies or pins asks)."""
    import torch

    return torch.cuda.is_available()


class _Mapped:
    """An image file as the copy process maps it: ``MAP_SHARED`` over the size it had when mapped (the trainer owns
    the file's size; a larger one is mapped anew), pinned in chunk-aligned segments for copies that are kept
    across saves and sizes while their pages stay in the file (:mod:`cpuckpt.tier.pinning`)."""

    def __init__(self, path: str, owner: str, nbytes: int,
                 prefault: Callable[[int, int], object] | None = None) -> None:
        import mmap

        self.path, self.owner, self.nbytes, self.pinned = path, owner, nbytes, False
        self._prefault = prefault  # (address, bytes): the pages faulted in before they are registered
        self._regs: dict[int, int] = {}  # registered: offset -> bytes
        self._pin_failed = False
        self._fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            self._check_size(nbytes)
            self._mmap = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED) if nbytes else None
        except BaseException:
            os.close(self._fd)
            raise
        self.mapped = nbytes
        # the mapping as a torch tensor, made when a copy or a registration first asks for it (:meth:`_view`):
        # a process that only checksums (no device snapshot, nothing pinned) never imports torch (~1 s)
        self._tensor: Any = None
        self._closed = False

    def _check_size(self, nbytes: int) -> None:
        size = self.size()
        if size != nbytes:
            raise StagingError(f"memory image {self.path} is {size} bytes, the save expects {nbytes}")

    def size(self) -> int:
        """The file's size now (the trainer may change it while no save of it is in flight)."""
        if self._fd < 0:
            raise StagingError(f"memory image {self.path} is no longer mapped in the copy process")
        return os.fstat(self._fd).st_size

    def removed(self) -> bool:
        """The file is gone from the RAM root (a reserved image no save claimed), or this mapping was closed: it
        must not stay here."""
        return self._fd < 0 or os.fstat(self._fd).st_nlink == 0

    def forget_past(self, intact: int) -> None:
        """The file was as small as ``intact`` since these registrations were made: drop those past it."""
        self._unregister(pinning.stale(self._regs, None, intact))

    def fit(self, nbytes: int, segment: int, pin: bool, budget: int | None = None) -> tuple[int, int, int]:
        """The file is ``nbytes`` now (at most :attr:`mapped`): registrations of other segments go, and with
        ``pin`` the missing ones are made, at most ``budget`` of them. Returns (segments registered now, segments
        still missing, segments of the file). Raises ``StagingError`` when the file is not that size."""
        self._check_size(nbytes)
        self.nbytes = nbytes
        wanted = pinning.segments(nbytes, segment, self.mapped)
        self._unregister(pinning.stale(self._regs, wanted, nbytes))
        registering = pin and not self._pin_failed and _cuda_available()  # torch only where it may pin
        made = self._register(wanted, budget) if registering else 0
        missing = sum(1 for off, n in wanted if self._regs.get(off) != n)
        self.pinned = bool(wanted) and not missing
        if not registering or self._pin_failed:
            return 0, 0, len(wanted)  # nothing (more) to register here
        return made, missing, len(wanted)

    def _register(self, wanted: list[tuple[int, int]], budget: int | None) -> int:
        """Register the missing ``wanted`` segments (at most ``budget``); returns how many were."""
        import torch

        from cpuckpt.transfer.staging import consume_cuda_error

        cudart = torch.cuda.cudart()
        base = self._view().data_ptr()
        made = 0
        for off, n in wanted:
            if self._regs.get(off) == n:
                continue
            if budget is not None and made >= budget:
                break
            if self._prefault is not None:
                self._prefault(base + off, n)
            if int(cudart.cudaHostRegister(base + off, n, 0)) != 0:
                consume_cuda_error()
                size = self.size()
                if size != self.nbytes:  # resized under a prepare: the next message describes the new size
                    logger.info("%s was resized while it was being pinned; pinned at its next message", self.path)
                    self._unregister(pinning.stale(self._regs, None, size))
                    return made
                logger.warning("cudaHostRegister of %d bytes of %s failed; copying into it unpinned", n, self.path)
                self._unregister(list(self._regs))
                self._pin_failed = True
                return made
            self._regs[off] = n
            made += 1
        return made

    def _unregister(self, offsets: list[int]) -> None:
        if not offsets:
            return
        import torch

        base = self._view().data_ptr()
        for off in offsets:
            del self._regs[off]
            if torch.cuda.is_available():  # registrations exist only there
                torch.cuda.cudart().cudaHostUnregister(base + off)
        self.pinned = False

    def _view(self) -> Any:
        """The whole mapping as a uint8 tensor (made once)."""
        if self._closed:
            raise StagingError(f"memory image {self.path} is no longer mapped in the copy process")
        if self._tensor is None:
            import torch

            self._tensor = (torch.frombuffer(self._mmap, dtype=torch.uint8) if self._mmap is not None
                            else torch.empty(0, dtype=torch.uint8))
        return self._tensor

    def tensor(self) -> Any:
        return self._view()[: self.nbytes]

    def view(self) -> memoryview:
        if self._closed:  # never a checksum of nothing
            raise StagingError(f"memory image {self.path} is no longer mapped in the copy process")
        if self._mmap is not None:
            return memoryview(self._mmap)[: self.nbytes]
        return memoryview(b"")

    def close(self) -> None:
        self._unregister(list(self._regs))
        self._closed = True
        self._tensor = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                logger.debug("%s: views still referenced; unmapped when collected", self.path)
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Worker:
    """The copy process's state: opened snapshot buffers, mapped images, its stream and checksum threads."""

    def __init__(self, conn: Connection, threads: int) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.pool = cf.ThreadPoolExecutor(max(1, threads), thread_name_prefix="cpuckpt-copy-crc")
        # a segment's pages faulted in before it is pinned, on threads of their own (the checksum threads may be
        # waiting for a save's copies; threads start at the first registration)
        prefaulting = pinning.prefault_threads()
        self.prefault_pool = cf.ThreadPoolExecutor(prefaulting, thread_name_prefix="cpuckpt-copy-prefault")
        self.prefault = functools.partial(pinning.populate, pool=self.prefault_pool, parts=prefaulting)
        self.waiters = cf.ThreadPoolExecutor(1, thread_name_prefix="cpuckpt-copy-wait")
        self.buffers: dict[int, Any] = {}
        self.images: dict[str, _Mapped] = {}
        # images to pin ahead: [path, owner, chunk bytes, device, segments registered so far]
        self.to_prepare: collections.deque[list[Any]] = collections.deque()
        self.ready_waits: list[int] = []  # tokens of the trainer's wait_prepared, answered once to_prepare is empty
        self.stream: Any = None

    def reply(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send_bytes(_dumps(msg))

    def forget(self, files: Sequence[ImageDesc]) -> None:
        """First, whatever else a message does: registrations whose pages may have left the file since they
        were made (a description's ``intact``) are dropped, even when the rest of the message then fails; and
        images removed from the RAM root are let go of (their RAM is freed only once nothing maps them)."""
        for path, owner, _, intact in files:
            held = self.images.get(path)
            if held is not None and held.owner == owner:
                held.forget_past(intact)
        for path, held in list(self.images.items()):
            if held.removed():
                held.close()
                del self.images[path]

    def use_device(self, device: int | None) -> None:
        """Registrations and copies under the trainer's CUDA device (one copy process per rank, each its own)."""
        if device is None:
            return
        import torch

        if torch.cuda.is_available() and torch.cuda.current_device() != device:
            torch.cuda.set_device(device)

    def image(self, path: str, owner: str, nbytes: int, chunk_bytes: int, pin: bool) -> _Mapped:
        """``path`` mapped (and pinned, for copies) as the trainer last shaped it. A file of another owner (a new
        object of the trainer's) or larger than this mapping is mapped anew; segments still in the file stay
        registered (a first save smaller than its image's reservation re-registers only the last one)."""
        held = self._mapping(path, owner, nbytes)
        made, _, total = held.fit(nbytes, pinning.segment_bytes(chunk_bytes), pin)
        if made:
            logger.info("%s: %d of %d segments registered (%d bytes)", path, made, total, nbytes)
        return held

    def _mapping(self, path: str, owner: str, nbytes: int) -> _Mapped:
        """``owner``'s mapping of ``path`` covering ``nbytes``: the one held, or a new one when none is, another
        owner's is, or it is smaller (the old one leaves the set before it closes: a failed map leaves none)."""
        held = self.images.get(path)
        if held is not None and held.owner == owner and nbytes <= held.mapped:
            return held
        if held is not None:
            del self.images[path]
            held.close()
        held = _Mapped(path, owner, nbytes, self.prefault)
        self.images[path] = held
        return held

    def prepare(self, files: Sequence[ImageDesc], chunk_bytes: int, device: int | None) -> None:
        """Images to map and pin ahead of their saves, a segment at a time when nothing else is asked of the
        process (:meth:`prepare_next`): a message waits behind one segment's pinning at most, not an image's
        (seconds for 5 GB). What the descriptions report is applied now, in message order."""
        self.forget(files)  # a failure ends the process: a registration must not outlive what it reports
        self.to_prepare.extend([path, owner, chunk_bytes, device, 0] for path, owner, _, _ in files)

    def prepare_next(self) -> None:
        """Pin one more segment of the next image asked for, at the size the file has now: the trainer may have
        resized it since it described it (a first save right after the reservation), and whatever it changes after
        this is in its next message's ``intact``. An image of another owner by now (a new object of the trainer's,
        maybe in a save's use) or removed is skipped: only a save's own message maps an image anew."""
        entry = self.to_prepare[0]
        path, owner, chunk_bytes, device, made = entry
        held = self.images.get(path)
        try:
            if held is not None and (held.owner != owner or held.removed()):
                self.to_prepare.popleft()
                return
            self.use_device(device)
            size = os.stat(path).st_size
            held = self._mapping(path, owner, size)
            now, missing, total = held.fit(size, pinning.segment_bytes(chunk_bytes), pin=True, budget=1)
            entry[4] = made = made + now
            if missing:
                return
            self.to_prepare.popleft()
            if made:
                logger.info("%s: %d of %d segments registered (%d bytes)", path, min(made, total), total, size)
        except Exception as e:  # the save that uses it reports it
            self.to_prepare.popleft()
            logger.warning("preparing %s failed: %r", path, e)

    def save(self, save_id: int, files: list, chunks: list, chunk_bytes: int, checksum: str,
             copy: tuple | None, host_share: bool) -> None:
        try:
            self.forget(files)
            if copy is not None:
                self.use_device(copy[3])
            images = [self.image(p, o, n, chunk_bytes, pin=copy is not None) for p, o, n, _ in files]
            copied: list[list[tuple[int, int]]] = [[] for _ in chunks]  # per chunk: (file offset, bytes) copied
            if copy is None:
                events: list[Any] = [None] * len(chunks)
            else:
                events = self.enqueue(images, chunks, copy, copied)
            if checksum not in ("", *KINDS):
                raise ValueError(f"unknown checksum kind {checksum!r}")
        except BaseException as e:
            self.drain()  # no copy of it still lands: the trainer may reuse the snapshot buffer
            self.reply(("error", save_id, f"failed: {type(e).__name__}: {e}"))
            return
        skip = copied if host_share and checksum == BLOCKSUM32 else None
        self.waiters.submit(self.finish, save_id, images, chunks, checksum, events, copy is not None, skip)

    def enqueue(self, images: list, chunks: list, copy: tuple, copied: list[list[tuple[int, int]]]) -> list[Any]:
        """All of a save's copies on this process's stream, an event after each chunk's; each copy's file range is
        added to ``copied`` under its chunk."""
        import torch

        from cpuckpt.transfer.sinks import OP_FIELDS

        key, desc, ready_handle, device, ops_bytes = copy
        if desc is not None:
            self.buffers[key] = _open_shared(desc)
        buffer = self.buffers.get(key)
        if buffer is None:
            raise StagingError(f"snapshot buffer {key} was never shared with the copy process")
        dev = torch.device("cuda", device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=dev)
        ops = array("q")
        ops.frombytes(ops_bytes)
        n = len(ops) // OP_FIELDS
        tensors = [img.tensor() for img in images]
        by_chunk: list[tuple[list[Any], list[Any]]] = [([], []) for _ in chunks]
        size = buffer.numel()
        for i in range(n):
            k, src, f, dst, nb = ops[i * OP_FIELDS : (i + 1) * OP_FIELDS]
            if not (0 <= src and src + nb <= size and 0 <= f < len(tensors) and 0 <= dst
                    and dst + nb <= tensors[f].numel() and 0 <= k < len(chunks)):
                raise StagingError(f"copy {i} out of bounds: buffer [{src}, {src + nb}) of {size}, file {f} "
                                   f"[{dst}, {dst + nb})")
            dsts, srcs = by_chunk[k]
            copied[k].append((dst, nb))
            dsts.append(tensors[f][dst : dst + nb])
            srcs.append(buffer[src : src + nb])
        ready = torch.cuda.Event.from_ipc_handle(dev, ready_handle)
        events = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for dsts, srcs in by_chunk:
                if dsts:
                    torch._foreach_copy_(dsts, srcs, non_blocking=True)
                # blocking: the checksum threads and the finisher sleep until their chunk is copied; a default
                # event's synchronize spins, a core each for as long as the copies run (~0.1 s of every save)
                ev = torch.cuda.Event(blocking=True)
                ev.record(self.stream)
                events.append(ev)
        return events

    def finish(self, save_id: int, images: list, chunks: list, checksum: str, events: list[Any],
               copies: bool, skip: list[list[tuple[int, int]]] | None) -> None:
        """Checksums as each chunk's copy completes; ``copied`` after the last copy, then ``done``. ``skip``
        (blocksum32's host share): per chunk the file ranges whose bytes are left out of its sum."""

        def crc(k: int) -> int:
            if events[k] is not None:
                events[k].synchronize()
            if not checksum:
                return 0
            f, off, nb = chunks[k]
            with images[f].view()[off : off + nb] as view:
                if skip is None:
                    return chunk_checksum(checksum, view)
                return blocksum32_except(view, off, skip[k])

        try:
            futures = [self.pool.submit(crc, k) for k in range(len(chunks))]
            if copies:
                if events:
                    events[-1].synchronize()
                self.reply(("copied", save_id))
            values = [fut.result() for fut in futures]
            out: list[list[int]] = [[] for _ in images]
            if checksum:
                for (f, _, _), v in zip(chunks, values):
                    out[f].append(v)
            self.reply(("done", save_id, out))
        except BaseException as e:
            self.drain()
            self.reply(("error", save_id, f"failed: {type(e).__name__}: {e}"))

    def drain(self) -> None:
        """Wait for every copy enqueued (after a failure); an error here is the one already reported."""
        if self.stream is not None:
            try:
                self.stream.synchronize()
            except Exception as e:
                logger.error("waiting for the copies failed: %r", e)

    def close(self) -> None:
        self.waiters.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        self.prefault_pool.shutdown(wait=True)
        for img in self.images.values():
            img.close()
        self.images.clear()
        self.buffers.clear()


def _exit_late(close_s: float) -> None:
    logger.error("its saves did not end within %.0f s of the last message; exiting", close_s)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    """``python -m cpuckpt.tier.copier --fd N``: serve one trainer until it closes the connection."""
    ap = argparse.ArgumentParser(prog="python -m cpuckpt.tier.copier")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--close-s", type=float, default=600.0, help="bound on the exit after the last message")
    ap.add_argument("--warm-device", type=int, default=None, help="import torch and make this CUDA device's context "
                    "at once (-1: import torch only), beside the first messages")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s copier %(process)d %(levelname)s %(message)s")
    conn = Connection(a.fd)
    worker = _Worker(conn, a.threads)
    # Messages are read as they come, so the trainer's send never waits for this process (its socket buffer
    # filled while a pin took seconds: the trainer blocked in a save's submit), and pinning ahead fills the time
    # no message waits.
    inbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                inbox.put(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        except BaseException as e:  # e.g. a malformed length: this process is not trusted further
            logger.error("reading the trainer's messages failed: %r", e)
        finally:
            inbox.put(None)

    threading.Thread(target=read, name="cpuckpt-copy-inbox", daemon=True).start()
    warm = None
    if a.warm_device is not None:
        warm = threading.Thread(target=_warm, args=(a.warm_device,), name="cpuckpt-copy-warm", daemon=True)
    try:
        if warm is not None:
            warm.start()
        while True:
            if worker.to_prepare and inbox.empty():
                worker.prepare_next()
                continue
            if worker.ready_waits and not worker.to_prepare:
                for token in worker.ready_waits:
                    worker.reply(("ready", token))
                worker.ready_waits.clear()
            data = inbox.get()
            if data is None:
                break
            msg = _loads(data)
            kind = msg[0]
            if kind == "save":
                worker.save(*msg[1:])
            elif kind == "prepare":
                worker.prepare(*msg[1:])
            elif kind == "ready":
                worker.ready_waits.append(msg[1])
            elif kind == "drop":
                worker.buffers.pop(msg[1], None)
            elif kind == "close":
                break
    finally:
        # bounded: copies waiting on a dead trainer's event may never end, and this process (a session of its own)
        # would keep the images pinned
        # on this thread (its CUDA device: registrations are undone by the context that made them)
        watchdog = threading.Timer(a.close_s, _exit_late, (a.close_s,))
        watchdog.daemon = True
        watchdog.start()
        if warm is not None:  # an import or a CUDA init cut short by the interpreter's exit could abort it
            warm.join(min(a.close_s, 60.0))
        worker.close()
        watchdog.cancel()
        conn.close()
    if warm is not None and warm.is_alive():  # still in torch's import or CUDA's init: no finalization beside it
        logger.warning("warm: not done at the exit; leaving without the interpreter's finalization")
        logging.shutdown()
        os._exit(0)
    return 0


def _warm(device: int) -> None:
    """Import torch and make ``device``'s CUDA context (``device`` < 0: import only) before a message needs them; a
    message that comes first waits for the same import and context (Python's import lock, torch's lazy init). A
    failure is only logged: the message that needs them reports its own."""
    t0 = time.monotonic()
    try:
        import torch

        imported = time.monotonic() - t0
        if device >= 0 and torch.cuda.is_available():
            torch.cuda.set_device(device)
            torch.cuda.synchronize(device)  # the context exists from here on
        logger.info("warm: torch imported in %.2f s, device %s ready %.2f s after the start", imported,
                    device if device >= 0 else "none", time.monotonic() - t0)
    except Exception as e:
        logger.warning("warm: making torch and device %d ready failed: %r", device, e)


if __name__ == "__main__":
    sys.exit(main())
