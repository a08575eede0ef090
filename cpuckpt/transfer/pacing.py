"""A save's device-to-host copies, enqueued one piece at a time from the trainer's own thread.

Copy engines run queued copies in order and ignore stream priority: a trainer's ``.item()`` waits for every
copy queued before it. Measured on the H200 (``tools/overlap_floor.py``, 4.7 GB in 1,168 tensors, a full
snapshot every 150 ms iteration): all copies enqueued at once cost 1.17x, a feeder thread keeping 64 MiB in
flight ~1.045x (its per-chunk Python competes with the trainer's interpreter), the same copies enqueued by the
trainer's own thread at its layer boundaries ~1.02x.

So a save with a window (``staging.d2h_window_bytes``) hands its copies to the process's :data:`PACER` as
pieces of that size. The pacer enqueues the next piece at a *tick* — the forward of any module, and the
gradient of the output of every module that owns parameters (backward runs on autograd's device thread while
the trainer's thread waits in ``backward()``) — and only once the piece before it has completed, so at most
one piece is ever queued ahead of the trainer's own reads and no thread of ours runs Python beside the
trainer's. The hooks are installed while copies are pending and removed when none are. Whatever is left is
enqueued at once by :meth:`Pacer.drain`: before the trainer writes the saved tensors (``CopyFence.order``, the
adapters' optimizer step) or waits for the save (``SaveJob.wait_staged``). A loop without modules calls
:func:`cpuckpt.tick` at its own natural points. A trainer that makes no tick for ``IDLE_S`` while copies are
pending is not training (it waits in a framework's own finalize, or evaluates without modules): a watch
thread then drains for it, so a save never waits for ticks that will not come.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Protocol

import torch

__all__ = ["PACER", "PacedCopies", "Pacer"]

logger = logging.getLogger(__name__)

IDLE_S = 0.1  # no tick this long while copies are pending: the watch thread drains


class PacedCopies(Protocol):
    """One save's device-to-host copies, piece by piece."""

    owner: int  # the thread that submitted it (set by :meth:`Pacer.submit`)

    def advance(self) -> Any:
        """Enqueue the next piece; returns the CUDA event after it, or None once no piece is left
        (the save then goes on to its writes)."""

    def abort(self, error: BaseException) -> None:
        """Enqueuing a piece raised ``error``: the save fails with it and enqueues nothing more."""


class Pacer:
    """Enqueues the pieces of pending saves at ticks, first come first served, one piece in flight."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._wake = threading.Condition()
        self._last_tick = 0.0  # monotonic time of the newest tick
        self._watch: threading.Thread | None = None
        self._jobs: collections.deque[PacedCopies] = collections.deque()
        self._owners: collections.Counter[int] = collections.Counter()  # threads that submitted pending jobs
        self._in_flight: Any = None  # the CUDA event after the newest piece
        self._hooks: Any = None  # the global module forward hook while copies are pending
        self.pieces = 0  # enqueued so far (for tests and telemetry)

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def submit(self, job: PacedCopies) -> None:
        """Queue ``job``'s copies; its first piece goes at once when nothing is in flight."""
        with self._lock:
            self._jobs.append(job)
            self._owners[threading.get_ident()] += 1
            job.owner = threading.get_ident()
            if self._hooks is None:
                self._hooks = torch.nn.modules.module.register_module_forward_hook(self._on_forward)
        self._last_tick = time.monotonic()
        self._start_watch()
        self.tick()

    def tick(self) -> None:
        """Enqueue the next piece if the one before it has completed; never blocks (a tick that finds
        another thread enqueuing returns at once)."""
        if not self._jobs:
            return
        self._last_tick = time.monotonic()
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._in_flight is not None and not self._in_flight.query():
                return
            self._in_flight = None
            while self._jobs and self._in_flight is None:
                self._advance()
        finally:
            self._lock.release()

    def drain(self) -> None:
        """Enqueue every piece still pending, on this thread (before the saved tensors change)."""
        if not self._jobs:
            return
        with self._lock:
            while self._jobs:
                self._advance()

    def drain_for_wait(self) -> None:
        """Before a host wait that may need pending copies: drains when this thread submitted any of them
        (the trainer, which would otherwise wait for ticks only it makes); any other thread waits for them."""
        if self._jobs and self._owners.get(threading.get_ident()):
            self.drain()

    def _advance(self) -> None:
        """One piece of the oldest job (a finished or failed job leaves the queue). Lock held."""
        job = self._jobs[0]
        try:
            event = job.advance()
        except Exception as e:
            event = None
            job.abort(e)
        if event is None:
            self._jobs.popleft()
            self._owners[job.owner] -= 1
            if not self._owners[job.owner]:
                del self._owners[job.owner]
            if not self._jobs and self._hooks is not None:
                self._hooks.remove()
                self._hooks = None
            return
        self._in_flight = event
        self.pieces += 1

    def _start_watch(self) -> None:
        with self._wake:
            if self._watch is None:
                self._watch = threading.Thread(target=self._watch_idle, name="cpuckpt-pace-watch", daemon=True)
                self._watch.start()
            self._wake.notify()

    def _watch_idle(self) -> None:
        """Drain when the trainer made no tick for ``idle_s`` while copies are pending (see the module doc)."""
        while True:
            with self._wake:
                while not self._jobs:
                    self._wake.wait()
            time.sleep(self.idle_s / 2)
            if self._jobs and time.monotonic() - self._last_tick > self.idle_s:
                logger.debug("no tick for %.0f ms with copies pending: enqueuing the rest", 1000 * self.idle_s)
                self.drain()

    def _on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.tick()
        if module._parameters and self._jobs and torch.is_grad_enabled():
            out = output[0] if isinstance(output, tuple | list) and output else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.tick()


# One per process: the invariant it keeps (one piece queued ahead of the trainer's reads) is the device
# link's, shared by every save stream of the process, and its module hook is process-wide.
PACER = Pacer()
