"""The error contract: one rank's failure becomes the same error on every rank (FailureReport, rank_error)."""

from __future__ import annotations

import errno
import os
import pickle
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
