"""Worker threads for the write/read pipeline. The only module that starts threads.

Tasks run on named threads (``cpuckpt-io-<rank>_<i>``). The first failure cancels the tasks not
yet started and is re-raised on the caller's thread, chained to the worker's traceback. Every wait
is bounded and polls in one-second slices, so Ctrl-C still reaches the caller. A ``KeyboardInterrupt``
(or ``SystemExit``) raised in a waiting thread is never converted: the work waited for is told to stop
(``cancel``), and the interrupt propagates as itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from cpuckpt.errors import CheckpointTimeoutError, CpuckptError, is_interrupt

__all__ = ["Cancelled", "new_executor", "run_parallel", "shared_executor", "stop_after_interrupt", "usable_cpus",
           "wait_future"]

T = TypeVar("T")
R = TypeVar("R")

logger = logging.getLogger(__name__)


class Cancelled(CpuckptError):
    """Raised inside a task when another task already failed."""


def run_parallel(
    fn: Callable[[T, threading.Event], R],
    tasks: Iterable[T],
    *,
    threads: int,
    timeout_s: float,
    name: str,
    release: Callable[[], None] | None = None,
) -> list[R]:
    """Run ``fn(task, cancel_event)`` for every task on ``threads`` threads; results in task order.

    ``fn`` should check ``cancel_event`` between slow steps. With one thread the tasks still run
    on a worker, so the caller's thread behaves identically either way.

    ``release``: called once, when no task runs any more: before this returns, or, when it raises (a failure,
    the timeout, Ctrl-C) while tasks still run, by the last of them as it ends. For what the tasks use (file
    descriptors, buffers): never freed under a task still in a system call.

    Raises:
        The first exception raised by a task (later ones are dropped, as they are usually
        consequences of the first).
        CheckpointTimeoutError: the tasks did not finish within ``timeout_s``.
    """
    task_list = list(tasks)
    if not task_list:
        if release is not None:
            release()
        return []
    cancel = threading.Event()
    lock = threading.Lock()
    running = [0]  # tasks started and not ended
    returned = [False]  # the caller has left: the last task to end releases

    def settle(*, ended: bool, leaving: bool = False) -> None:
        with lock:
            running[0] -= ended
            returned[0] = returned[0] or leaving
            last = returned[0] and running[0] == 0 and release is not None
            if last:
                returned[0] = False  # once
        if last and not ended:
            release()  # the caller's thread: an error here is the caller's
        elif last:
            try:
                release()
            except Exception:  # a straggler's thread: nobody reads its future any more
                logger.warning("%s: releasing what the tasks used failed", name, exc_info=True)

    def guarded(task: T) -> R:
        with lock:
            running[0] += 1
        try:
            if cancel.is_set():
                raise Cancelled(f"{name}: cancelled after an earlier failure")
            return fn(task, cancel)
        except BaseException:
            cancel.set()
            raise
        finally:
            settle(ended=True)

    deadline = time.monotonic() + timeout_s
    pool: cf.ThreadPoolExecutor | None = None
    try:
        pool = cf.ThreadPoolExecutor(max_workers=max(1, min(threads, len(task_list))), thread_name_prefix=name)
        futures = [pool.submit(guarded, t) for t in task_list]
        pending = set(futures)
        first_error: BaseException | None = None
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                cancel.set()
                raise CheckpointTimeoutError(
                    f"{name}: {len(pending)} of {len(futures)} tasks still running after {timeout_s:.0f} s"
                )
            done, pending = cf.wait(pending, timeout=min(1.0, remaining), return_when=cf.FIRST_EXCEPTION)
            for f in done:
                exc = f.exception()
                if exc is not None and not isinstance(exc, Cancelled) and first_error is None:
                    first_error = exc
            if first_error is not None:
                for f in pending:
                    f.cancel()
                cf.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
                raise first_error
        return [f.result() for f in futures]
    except BaseException as e:
        if is_interrupt(e):  # Ctrl-C on the caller's thread: running tasks stop at their next check
            cancel.set()
        raise
    finally:
        cancel.set()  # whatever is left (nothing, when all ended) stops at its next check
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        settle(ended=False, leaving=True)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity where the platform has one (a container's or a launcher's
    CPU set), else the machine's count. Sizes the pools that fault pages in."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def new_executor(threads: int, name: str) -> cf.ThreadPoolExecutor:
    """A pool of ``threads`` named worker threads (``<name>_<i>``)."""
    return cf.ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix=name)


# Per process: starting threads costs the trainer's stall, and every stream's tasks run FIFO on them. Must
# not run a task that waits for a later task, or that blocks unbounded (it would hold up other streams).
_SHARED: dict[tuple[str, int], cf.ThreadPoolExecutor] = {}
_SHARED_LOCK = threading.Lock()


def shared_executor(threads: int, name: str) -> cf.ThreadPoolExecutor:
    """A process-wide pool of named threads, created once and reused by every save and load.

    Starting threads per checkpoint costs milliseconds of the trainer's stall; these live until exit.
    Tasks of one save never wait for tasks of a later one (FIFO), so sharing cannot deadlock.
    """
    key = (name, max(1, threads))
    with _SHARED_LOCK:
        ex = _SHARED.get(key)
        if ex is None:
            ex = _SHARED[key] = new_executor(key[1], name)
        return ex


def wait_future(fut: cf.Future[R], timeout_s: float, what: str, *,
                on_interrupt: Callable[[BaseException], None] | None = None) -> R:
    """Wait for ``fut`` in one-second slices (Ctrl-C stays responsive); re-raise its exception.

    A ``KeyboardInterrupt``/``SystemExit`` raised in this (the waiting) thread propagates as itself,
    never converted, after ``on_interrupt(interrupt)`` has told the work behind ``fut`` to stop (so
    its threads end and the process can exit); a failure of ``on_interrupt`` is logged, not raised.

    Raises:
        CheckpointTimeoutError: not done within ``timeout_s``, naming ``what``.
    """
    if fut.done():
        return fut.result()
    try:
        pacing = sys.modules.get("cpuckpt.transfer.pacing")  # never imported (the writer process): nothing paced
        if pacing is not None:
            pacing.PACER.drain_for_wait()  # a trainer waiting here would wait for copies its own ticks enqueue
        return _wait(fut, timeout_s, what)
    except BaseException as e:
        if is_interrupt(e) and on_interrupt is not None:
            stop_after_interrupt(on_interrupt, e, what)
        raise


def stop_after_interrupt(stop: Callable[[BaseException], None], interrupt: BaseException, what: str) -> None:
    """Call ``stop(interrupt)`` (cancel background work after Ctrl-C); never raises, so the interrupt
    that is propagating is the one the caller sees."""
    try:
        stop(interrupt)
    except BaseException:  # the interrupt being raised is what the caller must see
        logger.warning("cpuckpt: stopping %s after %s failed", what, type(interrupt).__name__, exc_info=True)


def _wait(fut: cf.Future[R], timeout_s: float, what: str) -> R:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CheckpointTimeoutError(f"{what}: not finished after {timeout_s:.0f} s")
        try:
            return fut.result(timeout=min(1.0, remaining))
        except cf.TimeoutError:
            continue
