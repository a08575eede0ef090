"""The Megatron watchdog and settings in one process, without megatron-core or ranks.

Fakes stand for the ``AsyncCallsQueue`` shapes :mod:`cpuckpt.integrations.megatron.compat` knows
(instance attributes: megatron-core 0.16 and nvidia-resiliency-ext 0.7; class attributes:
megatron-core 0.17 to 0.20-dev; their real classes are exercised by tests/integrations/test_megatron.py
with the installed megatron-core), for a caller of an unknown shape, and for a queue that is not one.
The settings: ``configs/megatron.yaml``'s ``megatron:`` block, ``CPUCKPT_MEGATRON_<KEY>``, strict errors.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
from cpuckpt.integrations.megatron.guard import WorkerDiedError, watch_async_queue
from cpuckpt.integrations.megatron.settings import MegatronOptions, split_config
from cpuckpt.integrations.megatron.worker import new_channel, wait_for_commit

from cpuckpt.config import Config
from cpuckpt.errors import CheckpointTimeoutError, ConfigError, CpuckptError

REPO = Path(__file__).resolve().parents[2]
GUARD_LOG = "cpuckpt.integrations.megatron.guard"


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CPUCKPT_"):
            monkeypatch.delenv(name)


# ------------------------------------------------------------------------------------------ fakes
class FakeProcess:
    def __init__(self, exitcode: int | None = None) -> None:
        self.exitcode = exitcode
        self.pid = 4242
        self.killed = False

    def kill(self) -> None:
        self.killed = True
        if self.exitcode is None:
            self.exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        pass


class FakeMpQueue:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel_join_thread(self) -> None:
        self.cancelled = True


class InstanceCaller:
    """megatron-core 0.16 / nvidia-resiliency-ext 0.7: process and queues on the instance."""

    def __init__(self, process: FakeProcess) -> None:
        self.process = process
        self.queue, self.preload_q, self.comp_q = FakeMpQueue(), FakeMpQueue(), FakeMpQueue()
        self.closed: list[bool] = []

    def close(self, abort: bool = False) -> None:
        self.closed.append(abort)
        if self.process and abort:
            self.process.kill()
        self.process = None


class InstanceQueue:
    def __init__(self, caller: Any) -> None:
        self.async_calls: deque = deque()
        self.persistent_caller = caller
        self.finalize_calls = 0

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        self.finalize_calls += 1
        return []  # the worker never reports: megatron-core would answer "not done" forever


class ClassCaller:
    """megatron-core 0.17+: one worker per process, on the class."""

    _persistent_process: FakeProcess | None = None
    _persistent_queue: FakeMpQueue | None = None
    _persistent_preload_q: FakeMpQueue | None = None
    _persistent_comp_q: FakeMpQueue | None = None

    def __init__(self) -> None:
        self.process: FakeProcess | None = None
        self.closed: list[bool] = []

    def close(self, abort: bool = False) -> None:
        self.closed.append(abort)
        if self.process:
            if abort:
                self.process.kill()
            self.process = None
            for name in ("_persistent_process", "_persistent_queue", "_persistent_preload_q", "_persistent_comp_q"):
                setattr(ClassCaller, name, None)


class ClassQueue(InstanceQueue):
    _persistent_caller: ClassCaller | None = None

    def __init__(self) -> None:
        self.async_calls = deque()
        self.finalize_calls = 0


class Call(NamedTuple):
    idx: int
    async_caller: Any
    async_request: Any


def _a_worker_fn(*args: Any) -> None:
    """A call's worker function (a call without one is the watchdog's own to finalize: guard.DONE_MARK)."""


def _request(finalized: list[Any], async_fn: Any = _a_worker_fn, args: tuple = ()) -> SimpleNamespace:
    def ours(abandoned: bool = False) -> None:
        finalized.append(("cpuckpt", abandoned))

    ours.cpuckpt_finalize = True

    def megatrons() -> None:  # e.g. the one that writes metadata.json
        finalized.append("metadata.json")

    return SimpleNamespace(async_fn=async_fn, async_fn_args=args, finalize_fns=[ours, megatrons])


def _instance_shape(process: FakeProcess, finalized: list) -> tuple[InstanceQueue, InstanceCaller]:
    caller = InstanceCaller(process)
    queue = InstanceQueue(caller)
    queue.async_calls.append(Call(0, caller, _request(finalized)))
    return queue, caller


@pytest.fixture
def class_shape():
    def make(process: FakeProcess, finalized: list) -> tuple[ClassQueue, ClassCaller]:
        caller = ClassCaller()
        caller.process = process
        ClassCaller._persistent_process = process
        ClassCaller._persistent_queue, ClassCaller._persistent_comp_q = FakeMpQueue(), FakeMpQueue()
        ClassQueue._persistent_caller = caller
        queue = ClassQueue()
        queue.async_calls.append(Call(0, caller, _request(finalized)))
        return queue, caller

    yield make
    for name in ("_persistent_process", "_persistent_queue", "_persistent_preload_q", "_persistent_comp_q"):
        setattr(ClassCaller, name, None)
    ClassQueue._persistent_caller = None


# ----------------------------------------------------------------------------- the queue side
@pytest.mark.parametrize("shape", ["instance", "class"])
def test_dead_persistent_worker_raises_drops_the_calls_and_forgets_the_worker(shape, class_shape):
    finalized: list = []
    process = FakeProcess(exitcode=-9)
    queue, caller = _instance_shape(process, finalized) if shape == "instance" else class_shape(process, finalized)
    watch_async_queue(queue, timeout_s=60)
    with pytest.raises(WorkerDiedError, match=r"rank 0's persistent checkpoint worker ended \(pid 4242, exit code -9"):
        queue.maybe_finalize_async_calls(blocking=False)
    assert not queue.async_calls
    assert finalized == [("cpuckpt", True)], "only cpuckpt's own finalize step may run for a dropped call"
    assert caller.closed == [True]
    if shape == "instance":  # 0.16 / nvrx: the queue builds a new caller (new mp queues) at the next save
        assert queue.persistent_caller is None and caller.comp_q.cancelled
    else:  # 0.17+: the class attributes are cleared, so the next save spawns a new process
        assert ClassQueue._persistent_caller is None
        assert ClassCaller._persistent_process is None and ClassCaller._persistent_comp_q is None


@pytest.mark.parametrize("shape", ["instance", "class"])
def test_live_persistent_worker_is_left_alone(shape, class_shape):
    finalized: list = []
    queue, caller = _instance_shape(FakeProcess(), finalized) if shape == "instance" else \
        class_shape(FakeProcess(), finalized)
    watch_async_queue(queue, timeout_s=60)
    assert queue.maybe_finalize_async_calls(blocking=False) == []
    assert queue.finalize_calls == 1 and len(queue.async_calls) == 1 and caller.closed == []


def _own_request(finalized: list[Any], name: str, ended: list[bool] | None) -> SimpleNamespace:
    """A call the trainer completes: no worker function; ``ended`` (None: no probe at all, as when Megatron-LM's
    logits saver moved its finalize functions away) says whether its save ended."""
    def ours(abandoned: bool = False) -> None:
        finalized.append((name, abandoned))

    ours.cpuckpt_finalize = True
    fns = []
    if ended is not None:
        ours.cpuckpt_done = lambda: ended[0]
        fns = [ours, lambda: finalized.append(f"{name} metadata.json")]
    return SimpleNamespace(async_fn=None, async_fn_args=(), finalize_fns=fns)


def test_calls_without_a_worker_are_finalized_in_order_by_their_probe_and_never_shown_to_megatron():
    """Own calls (no async_fn) around one of Megatron's: finalized in queue order as their probes say ended; megatron-
    core's finalize sees only its own call (a persistent caller would credit an own call with a worker's completion);
    a dead persistent worker does not fail own calls while none of Megatron's is pending."""
    finalized: list = []
    process = FakeProcess()
    queue, caller = _instance_shape(process, finalized)  # call 0: Megatron's (a worker's), never done here
    queue.async_calls.clear()
    first, second = [False], [True]
    queue.async_calls.extend([Call(0, caller, _own_request(finalized, "m0", first)),
                              Call(1, caller, _own_request(finalized, "moved", None)),
                              Call(2, caller, _request(finalized)),
                              Call(3, caller, _own_request(finalized, "m3", second))])
    seen: list[int] = []
    queue.maybe_finalize_async_calls = lambda blocking=False, no_dist=False: seen.append(len(queue.async_calls)) or []
    watch_async_queue(queue, timeout_s=60)
    assert queue.maybe_finalize_async_calls() == [] and seen == []  # m0 has not ended: nothing, nobody asked
    first[0] = True
    assert queue.maybe_finalize_async_calls() == [0, 1]  # m0, then the probe-less one; Megatron's call 2 is not done
    assert seen == [1], "megatron-core's finalize must see only its own call, not m3 behind it"
    assert [c[0] for c in queue.async_calls] == [2, 3] and finalized == [("m0", False), "m0 metadata.json"]
    queue.async_calls.popleft()  # Megatron's call ends (its worker reported)
    process.exitcode = -9  # and then its worker dies: own calls need none
    assert queue.maybe_finalize_async_calls() == [3] and not queue.async_calls
    assert finalized[-2:] == [("m3", False), "m3 metadata.json"] and caller.closed == []


def test_an_urgent_call_behind_one_of_megatrons_that_ends_is_waited_for_in_the_same_look(monkeypatch):
    """Urgency is decided after the look's non-blocking finalize: Megatron's call at the head ends in this look, so the
    urgent call behind it (memory.max_uncommitted: 1) is waited for (0.3 s) and finalized in the same look."""
    from cpuckpt.integrations.megatron import guard
    from cpuckpt.integrations.megatron.guard import URGENT_MARK

    monkeypatch.setattr(guard, "_LOG_LOOKS", [False])  # no log has looked in this process (another test's may have)

    finalized: list = []
    queue, caller = _instance_shape(FakeProcess(), finalized)
    queue.async_calls.clear()
    ended = [False]
    urgent = _own_request(finalized, "m1", ended)
    setattr(urgent.finalize_fns[0].cpuckpt_done, URGENT_MARK, True)
    queue.async_calls.extend([Call(0, caller, _request(finalized)), Call(1, caller, urgent)])

    def megatron_finalize(blocking: bool = False, no_dist: bool = False) -> list[int]:  # its worker has reported
        call = queue.async_calls.popleft()
        for fn in call.async_request.finalize_fns:
            fn()
        return [call[0]]

    queue.maybe_finalize_async_calls = megatron_finalize
    watch_async_queue(queue, timeout_s=60)
    timer = threading.Timer(0.3, lambda: ended.__setitem__(0, True))
    timer.start()
    try:
        assert queue.maybe_finalize_async_calls() == [0, 1]
    finally:
        timer.cancel()
    assert finalized == [("cpuckpt", False), "metadata.json", ("m1", False), "m1 metadata.json"]
    assert not queue.async_calls


@pytest.mark.parametrize("shape", ["instance", "class"])
def test_a_dead_worker_fails_no_blocking_wait_for_calls_without_one(shape, class_shape):
    """Only calls the trainer completes are pending and the persistent worker is dead: a blocking finalize (as the
    ring's wait before a slot is refilled, or close) finalizes them; the dead worker is no one's to raise."""
    finalized: list = []
    process = FakeProcess(exitcode=-9)
    queue, caller = _instance_shape(process, finalized) if shape == "instance" else class_shape(process, finalized)
    queue.async_calls.clear()
    queue.async_calls.append(Call(0, caller, _own_request(finalized, "m0", [True])))
    watch_async_queue(queue, timeout_s=60)
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert finalized == [("m0", False), "m0 metadata.json"] and caller.closed == []


def test_warm_worker_on_the_class_counts_before_the_caller_scheduled(class_shape):
    # 0.17+ warmup_persistent_caller: the class holds a process the caller has not recorded yet
    finalized: list = []
    queue, caller = class_shape(FakeProcess(exitcode=-9), finalized)
    caller.process = None
    watch_async_queue(queue, timeout_s=60)
    with pytest.raises(WorkerDiedError, match="exit code -9"):
        queue.maybe_finalize_async_calls()
    assert ClassCaller._persistent_process is None


def test_on_failure_continue_logs_and_goes_on(caplog):
    finalized: list = []
    queue, _ = _instance_shape(FakeProcess(exitcode=-9), finalized)
    watch_async_queue(queue, timeout_s=60, config={"megatron": {"on_failure": "continue"}})
    with caplog.at_level(logging.ERROR, logger=GUARD_LOG):
        assert queue.maybe_finalize_async_calls(blocking=True) == []
    assert not queue.async_calls and queue.persistent_caller is None
    assert finalized == [("cpuckpt", True)]
    [record] = [r for r in caplog.records if r.name == GUARD_LOG]
    assert "training continues" in record.getMessage() and "exit code -9" in record.getMessage()


def test_on_failure_argument_overrides_config_and_is_checked():
    queue, _ = _instance_shape(FakeProcess(), [])
    with pytest.raises(ConfigError, match="on_failure"):
        watch_async_queue(queue, on_failure="ignore")
    queue, _ = _instance_shape(FakeProcess(exitcode=1), [])
    watch_async_queue(queue, config={"megatron": {"on_failure": "raise"}}, on_failure="continue")
    assert queue.maybe_finalize_async_calls() == []


def test_agreed_save_error_is_continued_and_any_other_raised(caplog):
    def failing(error: BaseException):
        queue = InstanceQueue(InstanceCaller(FakeProcess()))
        queue.async_calls.append(Call(0, queue.persistent_caller, _request([])))

        def finalize(blocking: bool = False, no_dist: bool = False) -> list[int]:
            queue.async_calls.clear()  # megatron-core pops the call, then its finalize function raises
            raise error

        queue.maybe_finalize_async_calls = finalize
        return queue

    agreed = CpuckptError("async save of x failed on rank 1: No space left")
    agreed.rank, agreed.failures = 1, {1: "No space left"}  # as errors.rank_error builds it on every rank
    queue = watch_async_queue(failing(agreed), config={"megatron": {"on_failure": "continue"}})
    with caplog.at_level(logging.ERROR, logger=GUARD_LOG):
        assert queue.maybe_finalize_async_calls(blocking=True) == []
    assert any("No space left" in r.getMessage() for r in caplog.records)
    local = CpuckptError("this rank only")  # not known to be the same on every rank: never continued
    with pytest.raises(CpuckptError, match="this rank only"):
        watch_async_queue(failing(local), config={"megatron": {"on_failure": "continue"}}).maybe_finalize_async_calls()
    with pytest.raises(CpuckptError, match="No space left"):
        watch_async_queue(failing(agreed)).maybe_finalize_async_calls()  # default: raise


# ------------------------------------------------------------------------------ cpuckpt's channel
class TemporalAsyncCaller:
    def __init__(self) -> None:
        self.process = FakeProcess()  # still "running" as far as the queue can tell
        self.closed: list[bool] = []

    def close(self, abort: bool = False) -> None:
        self.closed.append(abort)


def test_channel_sees_a_dead_worker_whatever_the_caller(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    channel = new_channel(0)
    try:
        channel.alive_path.write_text(str(gone.pid))  # what wait_for_commit wrote when it took the save
        finalized: list = []
        caller = TemporalAsyncCaller()
        queue = InstanceQueue(None)
        queue.async_calls.append(Call(0, caller, _request(finalized, wait_for_commit, (channel.base, 0, 60, 1, None))))
        watch_async_queue(queue, timeout_s=60)
        with pytest.raises(WorkerDiedError, match=rf"checkpoint worker \(pid {gone.pid} is gone\) ended without"):
            queue.maybe_finalize_async_calls()
        assert caller.closed == [True] and finalized == [("cpuckpt", True)]
    finally:
        channel.remove()


def test_channel_heartbeat_and_report():
    channel = new_channel(0)
    try:
        assert channel.worker_gone(60) is None  # nobody took the save yet: the queue side's case
        channel.announce()  # this process, alive and beating
        assert channel.worker_gone(60) is None
        old = channel.alive_path.stat().st_mtime - 100
        os.utime(channel.alive_path, (old, old))
        assert "silent for" in channel.worker_gone(60)
        channel.beat()
        assert channel.worker_gone(60) is None
        os.utime(channel.alive_path, (old, old))
        channel.report("ok")
        assert channel.worker_gone(60) is None  # it reported: finalize judges it
    finally:
        channel.remove()
    assert not channel.alive_path.exists()


def test_a_worker_process_freezes_its_imports_at_its_first_request(tmp_path):
    """megatron-core's persistent worker runs a full gc.collect() after every request: with its imports
    unfrozen that took 0.1-0.2 s per save, and with a save every iteration the worker fell behind the trainer
    (every memory-tier save then waited for it to finalize the save whose slot it reuses)."""
    code = (
        "import gc, sys\n"
        "from cpuckpt.integrations.megatron.worker import new_channel, wait_for_commit\n"
        "assert gc.get_freeze_count() == 0\n"
        "ch = new_channel(0)\n"
        "ch.post_status(None)\n"  # the trainer's "committed"
        "wait_for_commit(ch.base, 0, 30, 0, None)\n"
        "assert ch.take_report() == 'ok'\n"
        "frozen = gc.get_freeze_count()\n"
        "ch.remove()\n"
        "garbage = [[] for _ in range(10)]; garbage.append(garbage); del garbage\n"  # a request's own garbage
        "print(frozen, gc.collect())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    frozen, collected = map(int, out.stdout.split())
    assert frozen > 10_000  # the imports (torch and cpuckpt: far more objects than that)
    assert collected >= 11  # what is allocated after the freeze is still collected


# ------------------------------------------------------------------------------ never silent
def test_unknown_caller_shape_is_a_warning_and_the_wait_still_ends(caplog):
    class OddCaller:
        process = None

        def close(self, abort: bool = False) -> None:
            pass

    queue = InstanceQueue(None)
    queue.async_calls.append(Call(0, OddCaller(), _request([])))
    watch_async_queue(queue, timeout_s=0.3)
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointTimeoutError, match="not finalized after"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert any("OddCaller" in r.getMessage() and "not watched" in r.getMessage() for r in caplog.records)
    assert not queue.async_calls


def test_not_a_queue_is_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        thing = object()
        assert watch_async_queue(thing) is thing
    assert any("not watched" in r.getMessage() for r in caplog.records)


def test_watching_twice_is_a_no_op():
    queue, _ = _instance_shape(FakeProcess(), [])
    watch_async_queue(queue)
    wrapped = queue.maybe_finalize_async_calls
    watch_async_queue(queue, on_failure="continue")
    assert queue.maybe_finalize_async_calls is wrapped


# ---------------------------------------------------------------------------------- settings
def test_shipped_yaml_has_both_halves():
    core, options = split_config(REPO / "configs" / "megatron.yaml")
    assert isinstance(core, Config) and core.io.threads == 8
    assert options == MegatronOptions(on_failure="raise", heartbeat_timeout_s=60.0)


def test_settings_sources_and_errors(monkeypatch, tmp_path):
    assert split_config(None)[1] == MegatronOptions()
    core = Config.from_dict({"io": {"threads": 2}})
    assert split_config(core) == (core, MegatronOptions())
    cfg = tmp_path / "m.yaml"
    cfg.write_text("megatron:\n  on_failure: continue\nio:\n  threads: 3\n")
    core, options = split_config(cfg)
    assert core.io.threads == 3 and options.on_failure == "continue"
    monkeypatch.setenv("CPUCKPT_MEGATRON_ON_FAILURE", "raise")
    monkeypatch.setenv("CPUCKPT_MEGATRON_HEARTBEAT_TIMEOUT_S", "5")
    assert split_config(cfg)[1] == MegatronOptions(on_failure="raise", heartbeat_timeout_s=5.0)
    monkeypatch.setenv("CPUCKPT_MEGATRON_ON_FAILURE", "retry")
    with pytest.raises(ConfigError, match=r"CPUCKPT_MEGATRON_ON_FAILURE: megatron\.on_failure must be one of"):
        split_config(cfg)
    monkeypatch.delenv("CPUCKPT_MEGATRON_ON_FAILURE")
    monkeypatch.delenv("CPUCKPT_MEGATRON_HEARTBEAT_TIMEOUT_S")
    with pytest.raises(ConfigError, match=r"unknown key 'megatron.retries'"):
        split_config({"megatron": {"retries": 3}})
    with pytest.raises(ConfigError, match=r"unknown key 'on_failure'.*'megatron:' block"):
        split_config({"on_failure": "continue"})
    with pytest.raises(ConfigError, match=r"megatron\.heartbeat_timeout_s must be >= 2"):
        split_config({"megatron": {"heartbeat_timeout_s": 0.5}})


class ClosingQueue(InstanceQueue):
    def close(self, abort: bool = False) -> None:
        caller = self.persistent_caller
        if caller is not None and not abort:
            assert caller.process is None or caller.process.exitcode is None, "megatron-core would wait forever here"
            caller.close(abort)


def test_close_forgets_a_worker_that_died_while_idle(caplog):
    caller = InstanceCaller(FakeProcess(exitcode=-9))  # killed between two saves: nothing pending
    queue = watch_async_queue(ClosingQueue(caller))
    with caplog.at_level(logging.WARNING, logger=GUARD_LOG):
        queue.close()
    assert caller.closed == [True] and queue.persistent_caller is None
    assert any("died while idle" in r.getMessage() for r in caplog.records)
    live = InstanceCaller(FakeProcess())
    watch_async_queue(ClosingQueue(live)).close()
    assert live.closed == [False], "a live worker is closed the ordinary way"
