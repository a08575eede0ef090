"""run_parallel: ordered results, first error re-raised on the caller, cancellation, timeouts, names."""

from __future__ import annotations

import concurrent.futures as cf
import random
import threading
import time
import traceback

import pytest

from cpuckpt import CheckpointTimeoutError, CpuckptError
from cpuckpt.transfer.threads import Cancelled, run_parallel


def _alive(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def _wait_threads_gone(prefix: str, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while _alive(prefix) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _alive(prefix)


@pytest.mark.parametrize("threads", [1, 2, 4, 16])
def test_results_in_task_order(threads):
    rng = random.Random(threads)
    delays = [rng.random() * 0.01 for _ in range(40)]

    def fn(i, cancel):
        time.sleep(delays[i])  # finish out of order
        return i * i

    assert run_parallel(fn, range(40), threads=threads, timeout_s=30, name="t-order") == [i * i for i in range(40)]


def test_no_tasks():
    assert run_parallel(lambda t, c: 1 / 0, [], threads=4, timeout_s=1, name="t-empty") == []


def test_accepts_any_iterable_and_passes_cancel_event():
    seen = []

    def fn(task, cancel):
        seen.append(isinstance(cancel, threading.Event) and not cancel.is_set())
        return task.upper()

    assert run_parallel(fn, (s for s in "abc"), threads=2, timeout_s=5, name="t-gen") == ["A", "B", "C"]
    assert seen == [True, True, True]


class _Boom(Exception):
    pass


def _failing_worker_function(task, cancel):
    if task == 3:
        raise _Boom(f"task {task} failed")
    return task


def test_first_worker_exception_reraised_with_original_type_and_traceback():
    with pytest.raises(_Boom, match="task 3 failed") as ei:
        run_parallel(_failing_worker_function, range(8), threads=3, timeout_s=10, name="t-raise")
    frames = [f.name for f in traceback.extract_tb(ei.value.__traceback__)]
    assert "_failing_worker_function" in frames, frames  # the worker's frames are kept
    assert "test_first_worker_exception_reraised_with_original_type_and_traceback" in frames  # raised on the caller


def test_error_raised_on_the_caller_thread():
    caller = threading.current_thread()
    worker_names = []

    def fn(task, cancel):
        worker_names.append(threading.current_thread().name)
        raise KeyError(task)

    try:
        run_parallel(fn, [1], threads=1, timeout_s=5, name="t-caller")
    except KeyError as e:
        assert threading.current_thread() is caller
        assert e.args == (1,)
    else:
        pytest.fail("no exception")
    assert worker_names and worker_names[0] != caller.name


def test_first_error_wins_over_later_ones(monkeypatch):
    # The second task fails only once the caller has seen the first failure: run_parallel then cancels the tasks
    # still pending (test_pending_tasks_cancelled_after_failure), this one among them (running: not cancelled).
    first_seen = threading.Event()
    cancel_future = cf.Future.cancel

    def cancel_seen(self):
        first_seen.set()
        return cancel_future(self)

    monkeypatch.setattr(cf.Future, "cancel", cancel_seen)
    second_runs = threading.Event()  # both tasks run: the second is not just cancelled before it starts

    def fn(task, cancel):
        if task == 0:
            assert second_runs.wait(10)
            raise ValueError("first")
        second_runs.set()
        assert first_seen.wait(10)  # fails only after the first one failed
        raise RuntimeError("second")

    with pytest.raises(ValueError, match="first"):
        run_parallel(fn, [0, 1], threads=2, timeout_s=10, name="t-first")


def test_pending_tasks_cancelled_after_failure():
    ran = []
    lock = threading.Lock()

    def fn(task, cancel):
        with lock:
            ran.append(task)
        if task == 0:
            raise OSError("disk on fire")
        time.sleep(0.01)
        return task

    with pytest.raises(OSError, match="disk on fire"):
        run_parallel(fn, range(50), threads=1, timeout_s=10, name="t-cancel")
    assert ran == [0], f"tasks ran after the failure: {ran}"


def test_running_tasks_see_cancel_event():
    observed = threading.Event()
    started = threading.Event()

    def fn(task, cancel):
        if task == 0:
            started.wait(5)
            raise RuntimeError("boom")
        started.set()
        if cancel.wait(5):
            observed.set()
        return task

    with pytest.raises(RuntimeError, match="boom"):
        run_parallel(fn, [0, 1], threads=2, timeout_s=10, name="t-seen")
    assert observed.wait(5), "the running task never saw the cancel event"


def test_cancelled_tasks_do_not_mask_the_real_error():
    def fn(task, cancel):
        if task == 5:
            raise ZeroDivisionError("real")
        time.sleep(0.005)
        return task

    with pytest.raises(ZeroDivisionError):
        run_parallel(fn, range(60), threads=4, timeout_s=10, name="t-mask")


def test_timeout_raises_checkpoint_timeout_error():
    release = threading.Event()
    started = threading.Event()

    def fn(task, cancel):
        if task == 1:
            started.set()
            release.wait(30)  # hangs until the test lets it go
        return task

    t0 = time.monotonic()
    try:
        with pytest.raises(CheckpointTimeoutError) as ei:
            run_parallel(fn, [0, 1, 2], threads=2, timeout_s=0.3, name="t-hang")
        elapsed = time.monotonic() - t0
    finally:
        release.set()
    assert started.is_set()
    assert 0.25 <= elapsed < 3.0, elapsed
    assert "t-hang" in str(ei.value)
    assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, CpuckptError)
    assert _wait_threads_gone("t-hang") == [], "worker threads outlived the released task"


def test_timeout_sets_cancel_for_the_hung_task():
    saw_cancel = threading.Event()
    release = threading.Event()

    def fn(task, cancel):
        while not release.is_set():
            if cancel.is_set():
                saw_cancel.set()
                return None
            time.sleep(0.01)
        return task

    try:
        with pytest.raises(CheckpointTimeoutError):
            run_parallel(fn, [0], threads=1, timeout_s=0.2, name="t-hang2")
        assert saw_cancel.wait(5)
    finally:
        release.set()


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_names_start_with_given_name(threads):
    names = set()
    lock = threading.Lock()
    main = threading.current_thread().name

    def fn(task, cancel):
        with lock:
            names.add(threading.current_thread().name)
        time.sleep(0.002)
        return task

    run_parallel(fn, range(20), threads=threads, timeout_s=10, name="cpuckpt-io-7")
    assert names and all(n.startswith("cpuckpt-io-7") for n in names), names
    assert main not in names  # even with one thread the work runs on a worker
    assert len(names) <= threads


def test_threads_do_not_leak():
    for _ in range(5):
        run_parallel(lambda t, c: t, range(10), threads=4, timeout_s=5, name="t-leak")
        with pytest.raises(ValueError):
            run_parallel(lambda t, c: int("x"), range(10), threads=4, timeout_s=5, name="t-leak")
    assert _wait_threads_gone("t-leak") == []


def test_cancelled_is_a_cpuckpt_error():
    assert issubclass(Cancelled, CpuckptError)


def test_release_runs_once_after_the_last_task_even_when_the_call_timed_out():
    """What the tasks use (a load's file descriptors) is released when no task runs any more: at once when they all
    ended; after a timeout, by the straggler as it ends, never under it."""
    released: list[str] = []
    assert run_parallel(lambda t, c: t, [1, 2], threads=2, timeout_s=5, name="t",
                        release=lambda: released.append("ok")) == [1, 2]
    assert released == ["ok"]
    assert run_parallel(lambda t, c: t, [], threads=2, timeout_s=5, name="t",
                        release=lambda: released.append("none")) == []
    assert released == ["ok", "none"]

    go = threading.Event()
    ended: list[str] = []

    def straggler(task, cancel):
        go.wait(10)
        ended.append("straggler")

    with pytest.raises(CheckpointTimeoutError):
        run_parallel(straggler, [0], threads=1, timeout_s=0.2, name="t",
                     release=lambda: released.append(f"late after {ended}"))
    assert released == ["ok", "none"]  # the straggler still runs: nothing released under it
    go.set()
    deadline = time.monotonic() + 10
    while len(released) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert released == ["ok", "none", "late after ['straggler']"]
