"""The error contract: one rank's failure becomes the same error on every rank (FailureReport, rank_error)."""

from __future__ import annotations

import errno
import os
import pickle
import signal
import threading

import pytest

from cpuckpt.backend.collectives import gather_failures, raise_if_failed
from cpuckpt.errors import (
    CheckpointCorrupt,
    CheckpointTimeoutError,
    ConfigError,
    CpuckptError,
    FailureReport,
    IntegrityError,
    StagingError,
    StorageIOError,
    rank_error,
)

PATH = "/ckpt/step_1/__1_0.distcp"


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), PATH)


def _reports(world: int, failures: dict[int, BaseException]) -> list[FailureReport | None]:
    return [FailureReport.of(failures[r], r) if r in failures else None for r in range(world)]


def test_no_failure_is_no_error():
    assert rank_error([None, None], "save") is None
    assert rank_error([], "save") is None
    raise_if_failed([None, None], "save")  # does not raise


def test_oserror_becomes_storage_io_error_with_errno_path_rank():
    report = FailureReport.of(_enospc(), 1)
    assert (report.rank, report.error_class, report.errno, report.path) == (1, "StorageIOError", errno.ENOSPC, PATH)
    err = rank_error([None, report], "save of /ckpt/step_1")
    assert type(err) is StorageIOError
    assert isinstance(err, OSError) and isinstance(err, CpuckptError)
    assert err.errno == errno.ENOSPC
    assert err.path == PATH and err.filename == PATH
    assert err.rank == 1
    assert err.failures == {1: report.message}
    assert str(err).startswith("save of /ckpt/step_1 failed on rank 1: ")
    assert os.strerror(errno.ENOSPC) in str(err) and PATH in str(err)


def test_storage_io_error_keeps_offset_and_length():
    original = StorageIOError("pwrite failed", path=PATH, offset=4096, nbytes=65536, errno_=errno.EIO)
    err = rank_error([FailureReport.of(original, 0)], "save")
    assert type(err) is StorageIOError
    assert (err.errno, err.path, err.offset, err.nbytes, err.rank) == (errno.EIO, PATH, 4096, 65536, 0)


@pytest.mark.parametrize("original", [
    ConfigError("io.threads: must be positive"),
    CheckpointCorrupt("checksum mismatch in /ckpt/x at offset 12"),
    CheckpointTimeoutError("writer threads did not finish"),
    StagingError("pool exhausted"),
    IntegrityError("no .metadata"),
])
def test_cpuckpt_classes_are_kept(original):
    err = rank_error(_reports(2, {0: original}), "load of /ckpt/x")
    assert type(err) is type(original)
    assert err.rank == 0
    assert str(original) in str(err)


def test_builtin_timeout_becomes_checkpoint_timeout_error():
    err = rank_error(_reports(2, {1: TimeoutError("no outcome after 60 s")}), "save")
    assert type(err) is CheckpointTimeoutError
    assert isinstance(err, TimeoutError)
    assert err.rank == 1 and "no outcome after 60 s" in str(err)


def test_generic_exception_becomes_cpuckpt_error():
    err = rank_error(_reports(2, {0: RuntimeError("boom")}), "save")
    assert type(err) is CpuckptError
    assert not isinstance(err, OSError)
    assert err.rank == 0 and "boom" in str(err)
    empty = rank_error(_reports(1, {0: KeyError()}), "save")  # no message: the class name stands in
    assert "KeyError" in str(empty)


def test_unknown_cpuckpt_subclass_maps_to_nearest_known_class():
    class MyCorrupt(CheckpointCorrupt):
        pass

    class MyTimeout(CheckpointTimeoutError):
        pass

    assert type(rank_error([FailureReport.of(MyCorrupt("bad"), 0)], "load")) is CheckpointCorrupt
    assert type(rank_error([FailureReport.of(MyTimeout("late"), 0)], "load")) is CheckpointTimeoutError


def test_several_failing_ranks_lowest_wins_others_listed():
    failures = {3: RuntimeError("rank three broke"), 1: _enospc(), 2: CheckpointTimeoutError("rank two late")}
    reports = _reports(4, failures)
    err = rank_error(reports, "save")
    assert type(err) is StorageIOError  # rank 1's class, not rank 2's or 3's
    assert err.rank == 1 and err.errno == errno.ENOSPC and err.path == PATH
    assert sorted(err.failures) == [1, 2, 3]
    assert err.failures[2] == "rank two late" and err.failures[3] == "rank three broke"
    msg = str(err)
    assert msg.startswith("save failed on rank 1: ")
    assert "also failed: rank 2: rank two late; rank 3: rank three broke" in msg
    # The order in which reports arrive does not matter: every rank builds the same error.
    again = rank_error(list(reversed(reports)), "save")
    assert (type(again), str(again), again.rank, again.failures) == (type(err), msg, err.rank, err.failures)


def test_long_messages_of_other_ranks_are_shortened():
    err = rank_error(_reports(2, {0: RuntimeError("first"), 1: RuntimeError("x" * 1000)}), "save")
    assert len(str(err)) < 400
    assert err.failures[1] == "x" * 1000  # the full message is kept in failures


class _Unpicklable(OSError):
    """Holds a lambda and a lock: neither pickles."""

    def __init__(self) -> None:
        super().__init__(errno.EIO, "device went away", PATH)
        self.callback = lambda: None
        self.lock = threading.Lock()


def test_unpicklable_original_still_gives_picklable_report_and_error():
    original = _Unpicklable()
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        pickle.dumps(original)
    report = FailureReport.of(original, 1)
    assert pickle.loads(pickle.dumps(report)) == report
    err = rank_error([None, report], "save")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is StorageIOError
    assert (back.rank, back.errno, back.path) == (1, errno.EIO, PATH)
    assert str(back) == str(err)


def test_built_error_pickle_round_trip_keeps_attributes():
    err = rank_error(_reports(3, {1: _enospc(), 2: RuntimeError("later")}), "async save of /ckpt/step_1")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is StorageIOError and isinstance(back, OSError)
    assert str(back) == str(err)
    assert (back.rank, back.errno, back.path, back.filename) == (1, errno.ENOSPC, PATH, PATH)
    assert back.failures == err.failures and sorted(back.failures) == [1, 2]
    plain = rank_error(_reports(2, {0: ConfigError("bad key")}), "save")
    back = pickle.loads(pickle.dumps(plain))
    assert type(back) is ConfigError and (back.rank, back.failures) == (0, plain.failures)


def test_group_error_reported_again_keeps_its_rank():
    """A rank that re-reports a group error (e.g. from a handle) describes the failing rank, not itself."""
    group = rank_error(_reports(2, {1: _enospc()}), "async save of /ckpt/step_1")
    again = FailureReport.of(group, 0)
    assert again.rank == 1 and again.errno == errno.ENOSPC and again.path == PATH
    assert again.message == group.failures[1]


def test_raise_if_failed_chains_the_local_original():
    original = _enospc()
    reports = gather_failures(original, 0, None)  # no group: only this rank's report
    with pytest.raises(StorageIOError) as info:
        raise_if_failed(reports, "save of /ckpt/step_1", original)
    assert info.value.__cause__ is original
    assert info.value.rank == 0 and info.value.errno == errno.ENOSPC
    with pytest.raises(StorageIOError) as info:
        raise_if_failed([None, FailureReport.of(original, 1)], "save")  # no local original on this rank
    assert info.value.__cause__ is None


def test_every_rank_builds_the_same_error():
    reports = _reports(3, {2: CheckpointCorrupt("bad crc"), 1: RuntimeError("gone")})
    # Each rank unpickles its own copy of the gathered reports.
    errors = [rank_error(pickle.loads(pickle.dumps(reports)), "load") for _ in range(3)]
    assert {(type(e), str(e), e.rank) for e in errors} == {(CpuckptError, str(errors[0]), 1)}


# ------------------------------------------------------- every entry point keeps the contract (issue 27.2)


def _blocked(tmp_path, how: str):
    """A checkpoint path that cannot be created: it is a file, or its parent is one."""
    f = tmp_path / "a_file"
    f.write_bytes(b"x")
    return f if how == "is_a_file" else f / "ckpt"


@pytest.mark.parametrize("how", ["is_a_file", "parent_is_a_file"])
@pytest.mark.parametrize("entry", ["save", "async_save", "dcp_save"])
def test_uncreatable_directory_is_storage_io_error_on_every_entry_point(tmp_path, how, entry):
    import torch
    import torch.distributed.checkpoint as dcp

    import cpuckpt

    path = _blocked(tmp_path, how)
    sd = {"w": torch.ones(3)}
    if entry == "dcp_save":  # DCP wraps every rank's failure: the rank's own must be the contract's class
        with pytest.raises(dcp.api.CheckpointException) as info:
            dcp.save(sd, storage_writer=cpuckpt.StorageWriter(path))
        (failure,) = info.value.failures.values()
        err = failure[0] if isinstance(failure, tuple) else failure
    else:
        with pytest.raises(StorageIOError) as caught:
            if entry == "save":
                cpuckpt.save(sd, path)
            else:
                cpuckpt.async_save(sd, path).wait()
        err = caught.value
    assert type(err) is StorageIOError, repr(err)
    assert isinstance(err, OSError) and isinstance(err, CpuckptError)
    assert err.errno in (errno.EEXIST, errno.ENOTDIR), err.errno
    assert err.path and str(tmp_path / "a_file") in err.path and err.filename == err.path
    assert str(path) in str(err)
    assert (tmp_path / "a_file").read_bytes() == b"x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_parent_is_storage_io_error(tmp_path):
    import torch

    import cpuckpt

    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        for save in (cpuckpt.save, lambda sd, p: cpuckpt.async_save(sd, p).wait()):
            with pytest.raises(StorageIOError) as info:
                save({"w": torch.ones(3)}, parent / "ckpt")
            assert info.value.errno == errno.EACCES and str(parent / "ckpt") in str(info.value)
    finally:
        parent.chmod(0o700)


@pytest.mark.parametrize("how", ["parent_is_a_file", "metadata_is_a_directory"])
def test_unreadable_metadata_is_storage_io_error_on_load(tmp_path, how):
    import torch

    import cpuckpt

    if how == "parent_is_a_file":
        path = _blocked(tmp_path, how)
        want = errno.ENOTDIR
    else:
        path = tmp_path / "ckpt"
        (path / ".metadata").mkdir(parents=True)
        want = errno.EISDIR
    with pytest.raises(StorageIOError) as info:
        cpuckpt.load({"w": torch.zeros(3)}, path)
    assert info.value.errno == want and str(path / ".metadata") == info.value.path
    assert str(path) in str(info.value)


# -------------------------------------------------------------- a URL is not a directory name (issue 27.9)


def _url_entry_points(url: str):
    import torch
    import torch.distributed.checkpoint as dcp

    import cpuckpt

    sd = {"w": torch.ones(3)}
    return {
        "save": lambda: cpuckpt.save(sd, url),
        "load": lambda: cpuckpt.load({"w": torch.zeros(3)}, url),
        "async_save": lambda: cpuckpt.async_save(sd, url).wait(),
        "StorageWriter": lambda: cpuckpt.StorageWriter(url),
        "StorageWriter.reset": lambda: cpuckpt.StorageWriter("local").reset(url),
        "StorageReader": lambda: cpuckpt.StorageReader(url),
        "StorageReader.reset": lambda: cpuckpt.StorageReader("local").reset(url),
        "dcp.save(checkpoint_id)": lambda: dcp.save(sd, checkpoint_id=url,
                                                    storage_writer=cpuckpt.StorageWriter("local")),
        "dcp.load(checkpoint_id)": lambda: dcp.load({"w": torch.zeros(3)}, checkpoint_id=url,
                                                    storage_reader=cpuckpt.StorageReader("local")),
    }


@pytest.mark.parametrize("entry", ["save", "load", "async_save", "StorageWriter", "StorageWriter.reset",
                                   "StorageReader", "StorageReader.reset", "dcp.save(checkpoint_id)",
                                   "dcp.load(checkpoint_id)"])
@pytest.mark.parametrize(("url", "message"), [
    ("gs://bucket/x", r"gs://bucket/x.*URLs \(gs://\) are not supported"),  # a scheme cpuckpt does not write
    ("s3://b/x", r"s3://b/x.*'b' is not a valid S3 bucket name"),  # s3:// is supported (issue 31), but checked
])
def test_url_is_refused_before_anything_is_created(tmp_path, monkeypatch, entry, url, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        _url_entry_points(url)[entry]()
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "something was created in the working directory"


# ------------------------------------------------------------------- Ctrl-C stays itself (issue 27.1)


def test_run_dcp_reraises_this_ranks_keyboard_interrupt():
    from torch.distributed.checkpoint.api import CheckpointException

    from cpuckpt.backend.collectives import run_dcp

    def interrupted():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:  # what DCP's _DistWrapper does with any BaseException
            raise CheckpointException("write", {0: (e, [])}) from None

    with pytest.raises(KeyboardInterrupt):
        run_dcp(interrupted, "save", "/ckpt/x", rank=0)
    with pytest.raises(KeyboardInterrupt):
        run_dcp(interrupted, "save", "/ckpt/x")  # no rank given: the failure raised in this process
    # A peer's interrupt (arrived pickled) is an ordinary failure here: the contract's error, naming it.
    peer = pickle.loads(pickle.dumps(KeyboardInterrupt()))
    with pytest.raises(CpuckptError, match="failed on rank 1: KeyboardInterrupt") as info:
        run_dcp(lambda: (_ for _ in ()).throw(CheckpointException("write", {1: (peer, [])})), "save", "/ckpt/x",
                rank=0)
    assert info.value.rank == 1


def test_wait_future_keeps_keyboard_interrupt_and_cancels():
    import _thread
    import concurrent.futures as cf

    from cpuckpt.transfer.threads import wait_future

    waiting = threading.Event()  # this (the main) thread waits in fut.result(), inside wait_future
    ended = threading.Event()
    lock = threading.Lock()

    class Watched(cf.Future):
        def result(self, timeout=None):
            waiting.set()
            return super().result(timeout)

    def interrupt_once_waiting() -> None:  # a real KeyboardInterrupt in the main thread, only while it waits
        if waiting.wait(30):
            with lock:
                if not ended.is_set():
                    _thread.interrupt_main()

    fut: cf.Future[None] = Watched()
    stopped: list[BaseException] = []
    interrupter = threading.Thread(target=interrupt_once_waiting, daemon=True)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # interrupt_main does nothing unless handled
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            wait_future(fut, 30, "a save", on_interrupt=stopped.append)
    finally:
        with lock:
            ended.set()
        waiting.set()
        interrupter.join(10)
        signal.signal(signal.SIGINT, before)
    assert len(stopped) == 1 and isinstance(stopped[0], KeyboardInterrupt)
