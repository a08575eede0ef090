"""The Megatron-LM hook's command-line handling, and the strategy classes it hands Megatron-LM.

Megatron-LM itself (``megatron.training``) is not on PyPI: CI checks the argument rewriting and that
the classes it installs are torch_dist strategies Megatron-LM can construct with its own keyword
arguments; the device run drives Megatron-LM's real ``pretrain_gpt.py`` through the launcher.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
from cpuckpt.integrations.megatron.hook import Selection, install, rewrite_argv

from cpuckpt.errors import ConfigError


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--ckpt-format", "cpuckpt", "--save", "d"],
         Selection(True, None, ["--ckpt-format", "torch_dist", "--save", "d"])),
        (["--ckpt-format=cpuckpt"], Selection(True, None, ["--ckpt-format", "torch_dist"])),
        (["--dist-ckpt-format", "cpuckpt"], Selection(True, None, ["--ckpt-format", "torch_dist"])),
        (["--ckpt-format", "cpuckpt", "--cpuckpt-config", "c.yaml", "--async-save"],
         Selection(True, "c.yaml", ["--ckpt-format", "torch_dist", "--async-save"])),
        (["--cpuckpt-config=c.yaml", "--ckpt-format", "cpuckpt"],
         Selection(True, "c.yaml", ["--ckpt-format", "torch_dist"])),
        (["--ckpt-format", "torch_dist", "--lr", "1e-4"],
         Selection(False, None, ["--ckpt-format", "torch_dist", "--lr", "1e-4"])),
        (["--ckpt-format", "torch"], Selection(False, None, ["--ckpt-format", "torch"])),
        (["--ckpt-format"], Selection(False, None, ["--ckpt-format"])),  # Megatron's parser reports it
        ([], Selection(False, None, [])),
    ],
)
def test_rewrite_argv(argv, want):
    assert rewrite_argv(argv) == want


def test_config_without_cpuckpt_format_is_an_error():
    with pytest.raises(ConfigError, match="--ckpt-format is not cpuckpt"):
        rewrite_argv(["--ckpt-format", "torch_dist", "--cpuckpt-config", "c.yaml"])
    with pytest.raises(ConfigError, match="needs a path"):
        rewrite_argv(["--ckpt-format", "cpuckpt", "--cpuckpt-config"])


def test_install_leaves_other_formats_alone():
    argv = ["pretrain_gpt.py", "--ckpt-format", "torch_dist"]
    assert install(argv=argv) is False
    assert argv == ["pretrain_gpt.py", "--ckpt-format", "torch_dist"]


def test_install_checks_config_before_training(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("io:\n  threads: many\n")
    argv = ["pretrain_gpt.py", "--ckpt-format", "cpuckpt", "--cpuckpt-config", str(bad)]
    with pytest.raises(ConfigError, match="threads"):
        install(argv=argv)
    assert argv[2] == "cpuckpt", "argv rewritten although the hook failed"


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is not None, reason="Megatron-LM is importable here")
def test_install_without_megatron_lm_says_what_is_missing():
    argv = ["pretrain_gpt.py", "--ckpt-format", "cpuckpt"]
    with pytest.raises(ImportError, match="Megatron-LM"):
        install(argv=argv)


def test_classes_megatron_lm_constructs_are_torch_dist_strategies(tmp_path):
    pytest.importorskip("megatron.core")
    from cpuckpt.integrations.megatron.hook import _training_classes
    from cpuckpt.integrations.megatron.settings import MegatronOptions
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    from cpuckpt.config import Config

    cfg = Config.from_dict({"io": {"threads": 3}})
    save_cls, load_cls = _training_classes(cfg, MegatronOptions())
    save = save_cls(cpu_shm_mode=False)  # exactly how megatron.training.checkpointing builds them
    load = load_cls(cache_metadata=True, stream_ckpt_dequant=False)
    assert isinstance(save, TorchDistSaveShardedStrategy) and isinstance(load, TorchDistLoadShardedStrategy)
    assert save.backend == "torch_dist" and save.config.io.threads == 3 and save.reuse_plan is True
    no_reuse, _ = _training_classes(cfg, MegatronOptions(reuse_plan=False))
    assert no_reuse(cpu_shm_mode=False).reuse_plan is False  # megatron: {reuse_plan: false}
    assert load.cache_metadata is True and load.config.io.threads == 3


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None, reason="needs Megatron-LM (device run)")
def test_install_patches_megatron_training(tmp_path):
    import megatron.training.checkpointing as mlm
    from cpuckpt.integrations.megatron.strategy import CpuckptLoadStrategy, CpuckptSaveStrategy

    originals = (mlm.TorchDistSaveShardedStrategy, mlm.TorchDistLoadShardedStrategy, mlm.load_checkpoint,
                 mlm.FullyParallelSaveStrategyWrapper)
    argv = ["pretrain_gpt.py", "--ckpt-format", "cpuckpt"]
    try:
        assert install(argv=argv) is True
        assert issubclass(mlm.TorchDistSaveShardedStrategy, CpuckptSaveStrategy)
        assert issubclass(mlm.TorchDistLoadShardedStrategy, CpuckptLoadStrategy)
        assert issubclass(mlm.FullyParallelSaveStrategyWrapper, originals[3])  # validates a constant structure once
    finally:
        (mlm.TorchDistSaveShardedStrategy, mlm.TorchDistLoadShardedStrategy, mlm.load_checkpoint,
         mlm.FullyParallelSaveStrategyWrapper) = originals
        training = sys.modules.get("megatron.training.training")  # imported load_checkpoint by name: wrapped too
        if training is not None and hasattr(training, "load_checkpoint"):
            training.load_checkpoint = originals[2]


def _fake_async_utils(with_init: bool = True):
    """A stand-in for Megatron-LM's ``megatron.training.async_utils``: the module global
    ``_async_calls_queue``, built by ``_get_async_calls_queue`` (every scheduled save) and by
    ``init_persistent_async_worker`` (``--use-persistent-ckpt-worker``), as on Megatron-LM main."""
    import types
    from collections import deque

    class Queue:
        def __init__(self) -> None:
            self.async_calls = deque()

        def maybe_finalize_async_calls(self, blocking=False, no_dist=False):
            return []

    fake = types.ModuleType("fake_megatron_training_async_utils")
    fake._async_calls_queue = None

    def _get_async_calls_queue():
        if fake._async_calls_queue is None:
            fake._async_calls_queue = Queue()
        return fake._async_calls_queue

    def init_persistent_async_worker(rank, mp_mode="spawn"):
        fake._async_calls_queue = Queue()

    fake._get_async_calls_queue = _get_async_calls_queue
    if with_init:
        fake.init_persistent_async_worker = init_persistent_async_worker
    return fake


def _watched(queue) -> bool:
    return bool(getattr(queue.maybe_finalize_async_calls, "_cpuckpt_watchdog", False))


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is not None,
                    reason="Megatron-LM is importable here: test_install_watches_megatron_lm_queue covers it")
def test_hook_watches_every_queue_megatron_lm_builds():
    import types

    from cpuckpt.integrations.megatron.hook import watch_megatron_lm_queue
    from cpuckpt.integrations.megatron.settings import MegatronOptions

    fake = _fake_async_utils()
    original_init = fake.init_persistent_async_worker
    initialize = types.ModuleType("fake_initialize")  # `from .async_utils import init_persistent_async_worker`
    initialize.init_persistent_async_worker = original_init
    names = watch_megatron_lm_queue(60, MegatronOptions(on_failure="continue"), module=fake, importers=[initialize])
    assert names == ["_get_async_calls_queue", "init_persistent_async_worker"]
    assert initialize.init_persistent_async_worker is fake.init_persistent_async_worker is not original_init
    initialize.init_persistent_async_worker(0, "forkserver")  # initialize_megatron, before any save
    assert _watched(fake._async_calls_queue)
    fake._async_calls_queue = None  # reset_persistent_async_worker (in-process restart)
    assert _watched(fake._get_async_calls_queue())  # schedule_async_save
    assert fake._async_calls_queue.maybe_finalize_async_calls(blocking=True) == []
    wrapped = fake._get_async_calls_queue
    watch_megatron_lm_queue(60, MegatronOptions(), module=fake, importers=[])  # a second install: no double wrap
    assert fake._get_async_calls_queue is wrapped


def test_hook_warns_when_megatron_lm_builds_its_queue_elsewhere(caplog):
    import logging

    from cpuckpt.integrations.megatron.hook import watch_megatron_lm_queue
    from cpuckpt.integrations.megatron.settings import MegatronOptions

    fake = _fake_async_utils(with_init=False)
    with caplog.at_level(logging.WARNING):
        assert watch_megatron_lm_queue(60, MegatronOptions(), module=fake, importers=[]) == ["_get_async_calls_queue"]
    assert any("init_persistent_async_worker" in r.getMessage() and "not watched" in r.getMessage()
               for r in caplog.records)
    assert _watched(fake._get_async_calls_queue())


def test_install_checks_megatron_block_before_training(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("megatron:\n  on_failure: ignore\n")
    argv = ["pretrain_gpt.py", "--ckpt-format", "cpuckpt", "--cpuckpt-config", str(bad)]
    with pytest.raises(ConfigError, match="on_failure"):
        install(argv=argv)
    assert argv[2] == "cpuckpt", "argv rewritten although the hook failed"


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None, reason="needs Megatron-LM (device run)")
def test_install_watches_megatron_lm_queue(tmp_path):
    import megatron.training.async_utils as au
    import megatron.training.checkpointing as mlm
    import megatron.training.initialize as init

    originals = (mlm.TorchDistSaveShardedStrategy, mlm.TorchDistLoadShardedStrategy, au._get_async_calls_queue,
                 au.init_persistent_async_worker, init.init_persistent_async_worker)
    argv = ["pretrain_gpt.py", "--ckpt-format", "cpuckpt"]
    try:
        assert install(argv=argv) is True
        for fn in (au._get_async_calls_queue, au.init_persistent_async_worker, init.init_persistent_async_worker):
            assert getattr(fn, "_cpuckpt_watching", False), fn
        assert init.init_persistent_async_worker is au.init_persistent_async_worker
    finally:
        (mlm.TorchDistSaveShardedStrategy, mlm.TorchDistLoadShardedStrategy, au._get_async_calls_queue,
         au.init_persistent_async_worker, init.init_persistent_async_worker) = originals


def test_the_tier_stays_open_for_megatron_lms_final_save_and_closes_at_the_next_terminate(monkeypatch):
    """train()'s terminate is followed by pretrain()'s final save when the last iteration is not a multiple of
    --save-interval: the tier stays open for it (a new one costs a fresh slot and a writer) and closes at the next
    terminate; otherwise it closes at once."""
    from types import SimpleNamespace

    import cpuckpt.integrations.megatron.hook as hook
    from cpuckpt.integrations.megatron.hook import Training, final_save_follows

    from cpuckpt.config import Config

    def args(iters, interval, save="ckpt"):
        return SimpleNamespace(train_iters=iters, save_interval=interval, save=save)

    assert final_save_follows(args(100, 64)) and not final_save_follows(args(128, 64))
    assert not final_save_follows(args(100, 64, save=None)) and not final_save_follows(args(100, None))
    # no train(), or a train() that may end the process itself
    for off in ({"skip_train": True}, {"do_train": False}, {"exit_interval": 50}, {"exit_duration_in_mins": 30},
                {"exit_signal_handler": True}, {"phase_transition_iterations": [50]}):
        assert not final_save_follows(SimpleNamespace(**vars(args(100, 64)), **off)), off

    class Tier:  # stands for the run's MegatronMemory: what the hook asks of it is close()
        closes = 0

        def close(self):
            self.closes += 1

    at_exit: list = []  # the hook's exit handlers (a module imported meanwhile registers its own for real)
    register, unregister = hook.atexit.register, hook.atexit.unregister

    def ours(fn) -> bool:
        return getattr(fn, "__func__", None) is Training._close_at_exit

    monkeypatch.setattr(hook.atexit, "register", lambda fn, *a, **k: at_exit.append(fn) if ours(fn)
                        else register(fn, *a, **k))
    monkeypatch.setattr(hook.atexit, "unregister", lambda fn: (at_exit.remove(fn) if fn in at_exit else None)
                        if ours(fn) else unregister(fn))
    run = Training(Config())
    run._memory = tier = Tier()
    run.end_of_training(args(100, 64))  # train()'s terminate: the final save follows
    assert tier.closes == 0 and at_exit == [run._close_at_exit]  # closed at exit if pretrain()'s terminate never comes
    run._close_at_exit()  # an exit without a process group (or after an uncaught exception): no collective close
    assert tier.closes == 0
    run.end_of_training(args(100, 64))  # pretrain()'s terminate, after the final save
    assert tier.closes == 1 and at_exit == []

    run = Training(Config())
    run._memory = tier = Tier()
    run.end_of_training(args(128, 64))  # the last iteration was saved: no final save, closed now
    assert tier.closes == 1

    run = Training(Config())  # no tier at train()'s terminate: the final save makes it, pretrain()'s closes it
    run.end_of_training(args(100, 64))
    run._memory = tier = Tier()
    run.end_of_training(args(100, 64))
    assert tier.closes == 1 and at_exit == []


def test_freeze_gc_freezes_what_setup_left_alive_once():
    """megatron.freeze_gc: once setup returns, garbage is collected and the rest frozen (a later full collection
    does not look at it); a second install does not wrap twice."""
    import gc
    import types

    from cpuckpt.integrations.megatron.hook import freeze_collector_after_setup
    from cpuckpt.integrations.megatron.settings import split_config

    class Node:
        def __init__(self) -> None:
            self.me = self  # a cycle: only the collector frees it

    training = types.ModuleType("training")  # stands in for megatron.training.training
    made: dict[str, object] = {}

    def setup_model_and_optimizer(*args, **kwargs):
        made["kept"] = Node()
        Node()  # garbage by the time setup returns
        return "model", "optimizer", "scheduler"

    training.setup_model_and_optimizer = setup_model_and_optimizer
    assert gc.get_freeze_count() == 0
    try:
        assert freeze_collector_after_setup(training) and freeze_collector_after_setup(training)
        wrapped = training.setup_model_and_optimizer
        assert wrapped.__wrapped__ is setup_model_and_optimizer  # wrapped once
        assert wrapped() == ("model", "optimizer", "scheduler")
        assert gc.get_freeze_count() > 0
        assert not any(isinstance(o, Node) for o in gc.get_objects()), "frozen objects are not tracked any more"
        assert isinstance(made["kept"], Node)
    finally:
        gc.unfreeze()
    assert split_config({"megatron": {"freeze_gc": True}})[1].freeze_gc and not split_config(None)[1].freeze_gc
    assert not freeze_collector_after_setup(types.ModuleType("training"))  # no setup_model_and_optimizer: a warning


@pytest.fixture
def no_log_looked(monkeypatch):
    """A look before a log marks the process (guard._LOG_LOOKS: tops no longer wait for urgent saves): only this
    test's."""
    from cpuckpt.integrations.megatron import guard

    monkeypatch.setattr(guard, "_LOG_LOOKS", [False])


def test_the_look_before_the_log_wraps_training_log_once_and_leaves_unwatched_queues_alone(caplog, no_log_looked):
    """With the memory tier, Megatron-LM's ``training_log`` first looks at the async queue (the dist test
    test_megatron_memory.py::test_a_kill_after_the_log_of_n... shows what it finalizes); installed twice it wraps once,
    the log's own arguments and result pass through, a queue cpuckpt does not watch is not touched (nothing of ours
    finalizes there), and a Megatron-LM without ``training_log`` gets a warning, not an error."""
    import collections
    import types

    from cpuckpt.integrations.megatron.hook import finalize_before_log

    training = types.ModuleType("training")  # stands in for megatron.training.training
    logged: list[tuple] = []

    def training_log(*args, **kwargs):
        logged.append((args, kwargs))
        return "report_memory_flag"

    training.training_log = training_log

    class Unwatched:  # megatron-core's queue shape, not watched
        def __init__(self) -> None:
            self.async_calls = collections.deque(["a pending call"])

        def maybe_finalize_async_calls(self, blocking=False, no_dist=False):
            raise AssertionError("an unwatched queue is not finalized by the look")

    queue = Unwatched()
    assert finalize_before_log(training, queue_of=lambda: queue)
    assert finalize_before_log(training, queue_of=lambda: queue)
    assert training.training_log.__wrapped__ is training_log  # wrapped once
    assert training.training_log(1, 2, iteration=3) == "report_memory_flag"
    assert logged == [((1, 2), {"iteration": 3})] and list(queue.async_calls) == ["a pending call"]
    queue = None  # no queue yet (before the first async save)
    assert training.training_log(4) == "report_memory_flag"
    with caplog.at_level("WARNING", logger="cpuckpt"):
        assert not finalize_before_log(types.ModuleType("training"))
    assert "has no training_log()" in caplog.text


def test_the_look_waits_for_the_commits_before_the_lines_megatron_lm_prints(no_log_looked):
    """The look before a line Megatron-LM prints (``iteration % --log-interval == 0``, the interval above one) waits for
    the memory saves' commits (guard.finalize_before_log's ``printed``; the dist test in test_megatron_memory.py shows
    what it finalizes); its iteration is read by name or by its place in ``training_log``'s signature; with
    ``--log-interval 1`` (every line printed) or no Megatron-LM arguments it does not wait."""
    import collections
    import types

    from cpuckpt.integrations.megatron.hook import finalize_before_log

    training = types.ModuleType("training")

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, *rest, **kwargs):
        return iteration

    training.training_log = training_log
    looks: list[bool] = []

    class Dog:  # a watched queue's watchdog
        def look(self, no_dist: bool, urgent: bool, printed: bool = False) -> list[int]:
            looks.append(printed)
            return []

    queue = types.SimpleNamespace(async_calls=collections.deque(["a memory save"]), _cpuckpt_dog=Dog())
    interval: list = [10]
    assert finalize_before_log(training, queue_of=lambda: queue, log_interval_of=lambda: interval[0])
    assert [training.training_log({}, {}, 0.1, it, 1.0) for it in (20, 21)] == [20, 21]
    assert training.training_log({}, {}, 0.1, iteration=30, loss_scale=1.0) == 30
    interval[0] = 1
    training.training_log({}, {}, 0.1, 40, 1.0)
    interval[0] = None
    training.training_log({}, {}, 0.1, 50, 1.0)
    assert looks == [True, False, True, False, False]


class _Call(NamedTuple):
    """megatron-core's ``_ActiveAsyncRequest`` as the watchdog reads it."""

    idx: int
    async_caller: Any
    async_request: Any


class _Queue:
    """An ``AsyncCallsQueue`` holding only calls the trainer completes (the watchdog finalizes them itself)."""

    def __init__(self) -> None:
        self.async_calls: deque = deque()

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        return []


def _megatron_lm_cleanup(save_dir, leave_ckpt_num=1, do_async=False) -> None:
    """Megatron-LM's ``cleanup_old_non_persistent_checkpoint`` (megatron/training/checkpointing.py, not on PyPI):
    every ``iter_*`` entry (found recursively) but the newest ``leave_ckpt_num`` goes, pending saves or not."""
    import shutil

    found = sorted(Path(save_dir).rglob("iter_*"), key=lambda p: int(p.name[len("iter_"):]))
    for p in found[:-leave_ckpt_num]:
        shutil.rmtree(p)


def _pending_save(np_dir: Path, iteration: int, ended: Callable[[], bool]) -> _Call:
    """A cpuckpt save into ``np_dir/iter_<iteration>`` as the strategy schedules it: cpuckpt's finalize function,
    then Megatron's (``metadata.json``, then Megatron-LM's tracker)."""
    from cpuckpt.integrations.megatron.guard import DIR_MARK, DONE_MARK, FINALIZE_MARK

    directory = np_dir / f"iter_{iteration:07d}"
    directory.mkdir()

    def ours(abandoned: bool = False) -> None:
        pass

    setattr(ours, FINALIZE_MARK, True)
    setattr(ours, DIR_MARK, str(directory))
    setattr(ours, DONE_MARK, ended)

    def megatrons() -> None:
        (directory / "metadata.json").write_text("{}")
        (np_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))

    return _Call(iteration, None, SimpleNamespace(async_fn=None, async_fn_args=(), finalize_fns=[ours, megatrons]))


def _tracked(np_dir: Path) -> tuple[int, bool]:
    """The iteration the tracker names, and whether its directory is complete (exists, with ``metadata.json``)."""
    iteration = int((np_dir / "latest_checkpointed_iteration.txt").read_text())
    return iteration, (np_dir / f"iter_{iteration:07d}" / "metadata.json").is_file()


@pytest.mark.parametrize("case", ["ended", "still-writing", "two-ended", "failed-earlier"])
def test_cleanup_never_removes_the_directory_the_tracker_names(tmp_path, case):
    """Megatron-LM's cleanup before a non-persistent save keeps only the newest ``iter_*`` on disk; the tracker names
    the newest *finalized* save. The hook finalizes every pending save there first (the tracker moves to the newest)
    and never lets the cleanup remove what the tracker names (a crash then restarts from a missing directory)."""
    import types

    from cpuckpt.integrations.megatron import hook
    from cpuckpt.integrations.megatron.guard import watch_async_queue

    from cpuckpt.errors import CheckpointTimeoutError

    np_dir = tmp_path / "non_persistent"
    np_dir.mkdir()
    queue = _Queue()
    ended = [True]
    if case == "two-ended":  # saves 8 and 16 ended, neither finalized; the save of 24 starts
        for iteration in (8, 16):
            queue.async_calls.append(_pending_save(np_dir, iteration, lambda: True))
    else:  # save 10 finalized (the tracker names it); save 20 pending; the save of 30 starts
        queue.async_calls.append(_pending_save(np_dir, 10, lambda: True))
        queue.async_calls[0].async_request.finalize_fns[1]()
        queue.async_calls.clear()
        if case == "failed-earlier":  # save 20 failed and was dropped (on_failure: continue): never finalized
            (np_dir / "iter_0000020").mkdir()
        else:
            ended[0] = case == "ended"
            queue.async_calls.append(_pending_save(np_dir, 20, lambda: ended[0]))
    watch_async_queue(queue, timeout_s=1 if case == "still-writing" else 30, on_failure="raise")
    module = types.SimpleNamespace(cleanup_old_non_persistent_checkpoint=_megatron_lm_cleanup)
    hook._finalize_before_cleanup(module, queue_of=lambda: queue)

    if case == "still-writing":  # not finalized within the bound: an error, and nothing removed
        with pytest.raises(CheckpointTimeoutError):
            module.cleanup_old_non_persistent_checkpoint(str(np_dir), leave_ckpt_num=1, do_async=False)
        assert _tracked(np_dir) == (10, True)
        assert sorted(p.name for p in np_dir.glob("iter_*")) == ["iter_0000010", "iter_0000020"]
        return
    module.cleanup_old_non_persistent_checkpoint(str(np_dir), leave_ckpt_num=1, do_async=False)
    iteration, complete = _tracked(np_dir)
    assert complete, f"the tracker names iter_{iteration:07d}, which the cleanup removed"
    dirs = sorted(p.name for p in np_dir.glob("iter_*"))
    if case == "failed-earlier":  # the tracker's directory stays (and the newer one, until the tracker moves on)
        assert (iteration, dirs) == (10, ["iter_0000010", "iter_0000020"])
    else:  # every pending save finalized: the tracker names the newest, the one directory Megatron-LM keeps
        newest = 16 if case == "two-ended" else 20
        assert (iteration, dirs, list(queue.async_calls)) == (newest, [f"iter_{newest:07d}"], [])
