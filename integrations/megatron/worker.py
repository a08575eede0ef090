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

:func:`wait_for_commit` never raises (an exception would kill Megatron's persistent worker and
leave the trainer waiting forever); its own failures travel in the ``.worker`` file.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

from cpuckpt import faultpoint
from cpuckpt.roots import pid_alive
from cpuckpt.transfer.files import write_atomic

__all__ = ["Channel", "new_channel", "wait_for_commit"]

logger = logging.getLogger(__name__)

POLL_S = 0.005
OK = "ok"


def _channel_dir() -> Path:
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return root


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

    def remove(self) -> None:
        """Trainer: delete both files; a later ``post_status`` writes nothing."""
        with self._lock:
            self._closed = True
            for p in (self.status_path, self.report_path):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass

    # -- caller side ----------------------------------------------------------------------------
    def wait_status(self, timeout_s: float, parent_pid: int) -> str:
        """Caller: block until the trainer posts the outcome; returns it ('' = committed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.status_path.read_text()
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no outcome from the trainer after {timeout_s:.0f} s ({self.status_path})")
            if parent_pid and not pid_alive(parent_pid):
                raise RuntimeError(f"the trainer process {parent_pid} is gone")
            time.sleep(POLL_S)

    def report(self, text: str) -> None:
        _write(self.report_path, text)


def new_channel(rank: int) -> Channel:
    return Channel(str(_channel_dir() / f"cpuckpt-megatron-{os.getpid()}-r{rank}-{uuid.uuid4().hex[:12]}"))


def wait_for_commit(base: str, rank: int, timeout_s: float, trainer_pid: int,
                    fault_handler: faultpoint.Handler | None = None) -> None:
    """Megatron's ``async_fn``: wait until the trainer reports the save's outcome. Never raises.

    ``fault_handler`` is the trainer's :func:`cpuckpt.faultpoint.get_handler` (None unless a test
    installed one): a spawned persistent worker does not inherit it, so it travels with the request.
    """
    channel = Channel(base)
    try:
        if fault_handler is not None:
            faultpoint.set_handler(fault_handler)
        faultpoint.hit(f"megatron-worker:rank{rank}")
        channel.wait_status(timeout_s, trainer_pid)
        channel.report(OK)
    except BaseException as e:
        text = f"checkpoint worker of rank {rank} (pid {os.getpid()}): {e!r}"
        logger.error("%s\n%s", text, traceback.format_exc())
        try:
            channel.report(text)
        except BaseException:  # noqa: S110 - nothing left to tell; finalize reports a missing report
            pass


def _write(path: Path, text: str) -> None:
    write_atomic(path, text.encode(), fsync=False)  # a reader never sees a partial file

