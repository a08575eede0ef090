"""The trainer's host reads: windowed device-to-host copies pause while the trainer holds the gate.

A device-to-host copy that the trainer itself enqueues (``loss.item()``, a pinned ``non_blocking``
copy) waits until a side stream's device-to-host copies are done. Measured on the H200 (8 GB of
copies, 32 MiB chunks): the trainer's ``.item()`` waited 122-129 ms, all that was left of the copies,
whether they were queued at once or fed by a thread keeping only 64 MiB in flight, because the copy
engine keeps serving the side stream while it has work. So a save whose copies overlap the next
training step made that step's optimizer wait on the host for the rest of the save (DeepSpeed's
``.item()`` calls in its ZeRO step: 0.14-0.21 s of a 0.136 s step).

The adapters hold the gate around the optimizer step (where trainers read device values on the
host: overflow checks, gradient norms); a :class:`~cpuckpt.transfer.staging.CopyWindow` enqueues no
new copy while another thread holds it, so the trainer's read waits for the copies already in flight
only: 0.9 ms for a 64 MiB window, 4.6 ms for 256 MiB (same machine). A plain training loop holds it
with :func:`cpuckpt.pause_copies`. Copies enqueued all at once (no window) cannot pause.

A hold never stalls a save for long: a feeder waits at most ``HOLD_LIMIT_S`` for one hold, then
feeds on until that hold ends (a trainer that holds the gate across its whole loop only loses the
pause, never its checkpoint). A holder that waits on the host for a save (a commit inside DeepSpeed's
step, ``staged.wait()``: :func:`cpuckpt.transfer.threads.wait_future`) lifts its hold meanwhile, so it
never waits for copies that its own hold keeps back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

__all__ = ["GATE", "HOLD_LIMIT_S", "CopyGate"]

logger = logging.getLogger(__name__)

HOLD_LIMIT_S = 2.0


class CopyGate:
    """Held by trainer threads (nested holds allowed); copy feeders wait while another thread holds it."""

    def __init__(self, hold_limit_s: float = HOLD_LIMIT_S) -> None:
        self.hold_limit_s = hold_limit_s
        self._cond = threading.Condition()
        self._holders: dict[int, int] = {}  # thread id -> depth of its nested holds
        self._lifted: dict[int, int] = {}  # holders waiting for the copies themselves (depth of lifts)
        self._hold = 0  # counts holds (the gate going from open to held)
        self._expired = -1  # the hold a feeder stopped waiting for

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Within the block, feeders on other threads enqueue no new device-to-host copy."""
        me = threading.get_ident()
        with self._cond:
            if not self._holders:
                self._hold += 1
            _enter(self._holders, me)
        try:
            yield
        finally:
            with self._cond:
                if _leave(self._holders, me):
                    self._cond.notify_all()

    @contextlib.contextmanager
    def lifted(self) -> Iterator[None]:
        """Within the block, this thread's hold (if any) keeps no copy back: it waits for them itself."""
        me = threading.get_ident()
        if me not in self._holders:
            yield
            return
        with self._cond:
            _enter(self._lifted, me)
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                _leave(self._lifted, me)

    @property
    def is_held(self) -> bool:
        return bool(self._holders)

    def _closed_for(self, me: int) -> bool:
        """Whether a feeder on thread ``me`` must wait: another thread holds the gate without lifting it."""
        return me not in self._holders and any(t not in self._lifted for t in self._holders)

    def wait_open(self) -> float:
        """Block while another thread holds the gate (at most ``hold_limit_s`` per hold); seconds waited.

        The holder's own thread never waits (it may enqueue copies itself), nor does a feeder once the
        current hold has outlasted the limit. Holds of several threads count as one while they overlap.
        """
        if not self._holders:  # the common case: no lock taken
            return 0.0
        me = threading.get_ident()
        t0 = time.monotonic()
        with self._cond:
            hold, start = self._hold, t0  # the limit counts per hold, not per call
            while self._closed_for(me) and self._hold != self._expired:
                if self._hold != hold:
                    hold, start = self._hold, time.monotonic()
                left = self.hold_limit_s - (time.monotonic() - start)
                if left <= 0:
                    self._expired = self._hold
                    self._cond.notify_all()  # every feeder waiting for this hold goes on
                    logger.debug("copies resume: the trainer held them back for %.1f s", self.hold_limit_s)
                    break
                self._cond.wait(left)
        return time.monotonic() - t0


def _enter(depths: dict[int, int], me: int) -> None:
    depths[me] = depths.get(me, 0) + 1


def _leave(depths: dict[int, int], me: int) -> bool:
    """One level of ``me``'s nesting ends; True when it was the outermost."""
    depth = depths.pop(me) - 1
    if depth:
        depths[me] = depth
    return not depth


# Per process: it orders copies on the device link the trainer's host reads share, whichever stream
# enqueued them. Must not be held while waiting on the host for a save, nor longer than HOLD_LIMIT_S.
GATE = CopyGate()
