"""The function Megatron's async caller runs, and the small file channel between it and the trainer.

Design (see docs/ARCHITECTURE.md, "Megatron adapter"): staging *and* writing happen in the trainer,
in cpuckpt's own threads (the same single-copy path as :func:`cpuckpt.async_save`). Megatron's
caller process -- forked per save (temporal caller) or spawned once (persistent worker) -- runs
:func:`wait_for_commit`, which only waits for the trainer to report that the checkpoint is committed
on every rank. Megatron runs its finalize functions once every rank's caller has returned, so
finalization, ``metadata.json`` and the tracker file still come only after the data is durable.

Nothing but a file name crosses the process boundary: no tensors, no pool memory, no pickled
writer. That removes the fork hazard (a forked child reading a pool the trainer reuses) and the
spawn cost (shared-memory names, re-opened mappings) at once.

The channel is two files per save in a temporary directory:

- ``<base>.status``: written atomically by the trainer when the save ended (empty: committed;
  otherwise the error text, for logs only). The caller waits for it. The error finalize raises is
  not read from here: it is the save handle's, built from every rank's ``FailureReport``.
- ``<base>.worker``: written by the caller before it returns (``ok`` or its own error). A missing
  report at finalize time means the caller process died.
``<base>`` is a :mod:`cpuckpt.runfiles` name
(``cpuckpt-megatron-p<trainer pid>-b<boot>-h<host>-n<pid namespace>-r<rank>-<id>``):
a trainer killed with SIGKILL leaves its files behind, and the next trainer's first channel (or
``cpuckpt clean --ram``) removes those whose trainer is gone (another host's once untouched for a day).
The caller process exits when the trainer that started it is gone (:func:`_watch_parent`): Megatron's
persistent worker would otherwise block in its queue forever, an orphan holding its interpreter's memory.

- ``<base>.alive``: written by the caller when it takes the request (its pid); its mtime is a
  heartbeat, renewed about every second while the caller waits. The trainer's watchdog
  (:mod:`.guard`) reads it through :meth:`Channel.worker_gone`: a pid that no longer runs (or is a
  zombie) or a stale beat, with no report, means the caller died holding this save. This needs no
  knowledge of Megatron's caller classes; a caller that dies *before* taking the request never
  writes the file, and only the queue side (:mod:`.compat`) can see that.

:func:`wait_for_commit` never raises (an exception would kill Megatron's persistent worker and
leave the trainer waiting forever), except ``SystemExit`` (an exit someone asked for, e.g.
nvidia-resiliency-ext's SIGTERM handler when its caller is closed with ``abort=True``); its own
failures travel in the ``.worker`` file.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from cpuckpt import faultpoint, runfiles
from cpuckpt.roots import pid_alive
from cpuckpt.transfer.files import write_atomic

__all__ = ["Channel", "PersistWait", "PersistWatch", "new_channel", "process_alive", "wait_for_commit",
           "wait_for_persist"]

logger = logging.getLogger(__name__)

POLL_S = 0.005
HEARTBEAT_S = 1.0
OK = "ok"


PARENT_POLL_S = 0.5
# Per (worker) process: stale channel files are cleaned once, and the worker watches its one parent.
_cleaned_stale = False
_watching: int | None = None  # the trainer pid this worker process's watchdog thread follows
_watch_lock = threading.Lock()


class Channel:
    """The status/report file pair of one save on one rank.

    On the trainer side, :meth:`post_status` (the committer thread) and :meth:`remove` (finalize, or a
    failed ``async_save``) may race; a lock and a closed flag make sure no file outlives ``remove``.
    """

    def __init__(self, base: str) -> None:
        self.base = base
        self._lock = threading.Lock()
        self._closed = False

    @property
    def status_path(self) -> Path:
        return Path(self.base + ".status")

    @property
    def report_path(self) -> Path:
        return Path(self.base + ".worker")

    @property
    def alive_path(self) -> Path:
        return Path(self.base + ".alive")

    # -- trainer side ---------------------------------------------------------------------------
    def post_status(self, error: str | None) -> None:
        """Trainer: the save ended (``error`` None: committed on every rank). No-op once removed."""
        with self._lock:
            if not self._closed:
                _write(self.status_path, error or "")

    def take_report(self) -> str | None:
        """Trainer, at finalize: the caller's report; None if it never wrote one (it died)."""
        try:
            text = self.report_path.read_text()
        except FileNotFoundError:
            return None
        return text

    def worker_gone(self, stale_s: float) -> str | None:
        """Trainer: why the caller that took this save is gone without a report, else None.

        None also when no caller has taken the request yet (no ``.alive`` file): the queue side
        must judge that case.
        """
        if self.report_path.exists():
            return None
        try:
            mtime = self.alive_path.stat().st_mtime
            pid = int(self.alive_path.read_text())
        except (FileNotFoundError, ValueError):
            return None
        if not process_alive(pid):
            reason = f"pid {pid} is gone"
        elif (age := time.time() - mtime) > stale_s:
            reason = f"pid {pid} silent for {age:.0f} s"
        else:
            return None
        return None if self.report_path.exists() else reason  # it may have reported just before it ended

    def remove(self) -> None:
        """Trainer: delete both files; a later ``post_status`` writes nothing."""
        with self._lock:
            self._closed = True
            for p in (self.status_path, self.report_path, self.alive_path):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass

    # -- caller side ----------------------------------------------------------------------------
    def announce(self) -> None:
        """Caller: it took the request (its pid; the file's mtime is the heartbeat)."""
        _write(self.alive_path, str(os.getpid()))

    def beat(self) -> None:
        try:
            os.utime(self.alive_path)
        except FileNotFoundError:  # the trainer removed the channel
            pass

    def wait_status(self, timeout_s: float, parent_pid: int) -> str:
        """Caller: block until the trainer posts the outcome; returns it ('' = committed). Beats meanwhile."""
        deadline = time.monotonic() + timeout_s
        last_beat = time.monotonic()
        while True:
            try:
                return self.status_path.read_text()
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no outcome from the trainer after {timeout_s:.0f} s ({self.status_path})")
            if parent_pid and not pid_alive(parent_pid):
                raise RuntimeError(f"the trainer process {parent_pid} is gone")
            if time.monotonic() - last_beat >= HEARTBEAT_S:
                self.beat()
                last_beat = time.monotonic()
            time.sleep(POLL_S)

    def report(self, text: str) -> None:
        _write(self.report_path, text)


def _channel_dir() -> Path:
    """Where channels live: /dev/shm where it is writable, else the temp directory."""
    return runfiles.run_dir()


def new_channel(rank: int) -> Channel:
    """A fresh channel of this trainer; the first one of a process also removes stale channels of dead trainers."""
    global _cleaned_stale
    if not _cleaned_stale:
        _cleaned_stale = True
        try:
            runfiles.clean_stale()
        except OSError as e:  # never fail a save over someone else's leftovers
            logger.warning("could not remove stale channel files: %s", e)
    return Channel(runfiles.run_file_base("megatron", f"r{rank}"))


def _watch_parent(trainer_pid: int) -> None:
    """In a caller process started by ``trainer_pid``: exit as soon as that trainer is gone.

    A trainer killed with SIGKILL cannot stop Megatron's persistent worker, which then blocks in
    its request queue forever (reparented to init). A daemon thread polls the parent pid: when it
    changes, the trainer has died and nothing will ever be asked of this process again.
    """
    global _watching
    with _watch_lock:
        if _watching == trainer_pid or os.getpid() == trainer_pid or os.getppid() != trainer_pid:
            return  # already watching, the trainer itself (a synchronous call), or not its child
        _watching = trainer_pid

    def watch() -> None:
        while os.getppid() == trainer_pid:
            time.sleep(PARENT_POLL_S)
        logger.warning("checkpoint worker (pid %d): the trainer %d is gone; exiting", os.getpid(), trainer_pid)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="cpuckpt-parent-watch", daemon=True).start()


@dataclass(frozen=True)
class PersistWait:
    """What a worker waits for after the memory commit of a persistent save (the memory tier's persist)."""

    queue: str  # the rank's persist queue directory
    seq: int  # the request's sequence number there
    writer_lock: str  # the rank's writer lock: free means the writer process is gone


WRITER_GONE_GRACE_S = 5.0


def wait_for_commit(base: str, rank: int, timeout_s: float, trainer_pid: int,
                    fault_handler: faultpoint.Handler | None = None, persist: PersistWait | None = None) -> None:
    """Megatron's ``async_fn``: wait until the trainer reports the save's outcome. Raises only ``SystemExit``.

    ``fault_handler`` is the trainer's :func:`cpuckpt.faultpoint.get_handler` (None unless a test
    installed one): a spawned persistent worker does not inherit it, so it travels with the request
    (and replaces the one an earlier request left in the worker).
    With ``persist`` (a persistent save through the memory tier), the memory commit is followed by a
    wait for the writer process's outcome: Megatron finalizes (``metadata.json``, the tracker) only
    once the checkpoint is durable.
    """
    channel = Channel(base)
    try:
        _freeze_imports()
        _watch_parent(trainer_pid)
        faultpoint.set_handler(fault_handler)  # the trainer's, as of this request (a persistent worker keeps it)
        channel.announce()  # from here on the trainer's watchdog sees this process's death
        faultpoint.hit(f"megatron-worker:rank{rank}")
        deadline = time.monotonic() + timeout_s
        status = channel.wait_status(timeout_s, trainer_pid)
        if persist is not None and not status:  # a failed memory save cancels its persist: nothing to wait for
            wait_for_persist(channel, persist, max(1.0, deadline - time.monotonic()))
        channel.report(OK)
    except BaseException as e:
        text = f"checkpoint worker of rank {rank} (pid {os.getpid()}): {e!r}"
        if isinstance(e, SystemExit):  # stopped on purpose (e.g. the watchdog replacing the workers)
            logger.info("%s", text)
        else:
            logger.error("%s\n%s", text, traceback.format_exc())
        try:
            channel.report(text)
        except BaseException:  # noqa: S110 - nothing left to tell; finalize reports a missing report
            pass
        if isinstance(e, SystemExit):
            raise


def _freeze_imports() -> None:
    """Exempt what the worker process holds before its first request (its imports) from garbage collection.

    megatron-core's persistent worker (and nvidia-resiliency-ext's) runs a full ``gc.collect()`` after every
    request, before it takes the next one: with torch and megatron-core imported that is 0.1-0.2 s per save,
    so with a save every iteration the worker fell behind the trainer and every save into the memory tier's
    ring waited for it (BENCHMARKS.md, goodput). Frozen objects are never scanned; what a request allocates
    is not frozen and is still collected. Once per process (``gc.get_freeze_count`` says whether it ran; a process
    forked from a trainer that froze its own, ``megatron.freeze_gc``, has its imports frozen already).
    """
    if gc.get_freeze_count() == 0:
        gc.freeze()


class PersistWatch:
    """What is known now of a persist's outcome, without waiting: the trainer's probe of a persistent save on a queue
    the adapter watches, and the worker's wait (:func:`wait_for_persist`)."""

    def __init__(self, persist: PersistWait) -> None:
        from cpuckpt.tier.queue import PersistQueue

        self.persist = persist
        self._queue = PersistQueue(persist.queue)
        self._gone_since: float | None = None

    def poll(self) -> tuple[bool, str | None]:
        """(ended, error): ended once the writer reported an outcome, or has been gone for
        :data:`WRITER_GONE_GRACE_S` without one (a writer being respawned may take the request over meanwhile)."""
        from cpuckpt.tier.ramroot import lock_holder

        outcome = self._queue.outcome(self.persist.seq)
        if outcome is not None:
            return True, None if outcome.ok else f"persist to the durable root failed: {outcome.error}"
        now = time.monotonic()
        if lock_holder(self.persist.writer_lock) is None:
            self._gone_since = self._gone_since or now
            if now - self._gone_since > WRITER_GONE_GRACE_S:
                return True, (f"the memory tier's writer process is gone, owing persist {self.persist.seq} "
                              f"({self.persist.queue})")
        else:
            self._gone_since = None
        return False, None


def wait_for_persist(channel: Channel, persist: PersistWait, timeout_s: float) -> None:
    """Caller: block until the rank's writer process finished the persist (beats meanwhile).

    Raises:
        RuntimeError: the persist failed, or the writer process is gone without an outcome.
        TimeoutError: no outcome within ``timeout_s``.
    """
    watch = PersistWatch(persist)
    deadline = time.monotonic() + timeout_s
    last_beat = time.monotonic()
    while not (polled := watch.poll())[0]:
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"persist {persist.seq} of {persist.queue} not done after {timeout_s:.0f} s")
        if now - last_beat >= HEARTBEAT_S:
            channel.beat()
            last_beat = now
        time.sleep(POLL_S)
    if polled[1] is not None:
        raise RuntimeError(polled[1])


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs: exists (:func:`cpuckpt.roots.pid_alive`) and is not a zombie.

    A killed persistent worker stays a zombie until its parent (the trainer) reaps it, which
    megatron-core does not do while it waits; ``kill(pid, 0)`` alone would call it alive.
    """
    if not pid_alive(pid):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no procfs (or it ended just now): trust pid_alive
        return True
    fields = stat.rpartition(")")[2].split()
    return not fields or fields[0] not in ("Z", "X")


def _write(path: Path, text: str) -> None:
    write_atomic(path, text.encode(), fsync=False)  # a reader never sees a partial file

