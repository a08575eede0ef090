"""Checkpoint roots: find_latest, list_checkpoints, the `latest` pointer, retention, cleaning.

Real saves into ``tmp_path`` (one process, no torch.distributed); damage is done with real file
operations. Crash points inside these operations are covered by tests/faults/test_kill_sweep.py.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cpuckpt
from cpuckpt import IntegrityError
from cpuckpt.config import Config
from cpuckpt.roots import LATEST_NAME, LOADING_PREFIX, after_commit, is_being_loaded, loading

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CFG = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 30}


def _sd(k: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(7, generator=g), "step": k}


def _save(root: Path, k: int, **checkpoint) -> Path:
    path = root / f"step_{k:04d}"
    cfg = dict(CFG, checkpoint=checkpoint) if checkpoint else CFG
    cpuckpt.save(_sd(k), path, cfg, step=k)
    return path


def _loads_as(path: Path, k: int) -> bool:
    want = _sd(k)
    out = {"w": torch.zeros(64, 64), "b": torch.zeros(7), "step": None}
    cpuckpt.load(out, path, CFG)
    return torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"]) and out["step"] == k


def _names(paths) -> list[str]:
    return sorted(Path(p).name for p in paths)


# ------------------------------------------------------------------------------------- find_latest


def test_find_latest_of_empty_or_missing_root_is_none(tmp_path):
    assert cpuckpt.find_latest(tmp_path) is None
    assert cpuckpt.find_latest(tmp_path / "nope") is None
    assert cpuckpt.list_checkpoints(tmp_path / "nope") == []


def test_find_latest_orders_by_step_not_name_or_time(tmp_path):
    for k in (3, 10, 2):  # step_0010 is written second, step_0002 last
        _save(tmp_path, k)
    assert cpuckpt.find_latest(tmp_path) == tmp_path / "step_0010"
    infos = cpuckpt.list_checkpoints(tmp_path)
    assert [i.step for i in infos] == [2, 3, 10] and all(i.complete for i in infos)


@pytest.mark.parametrize("damage", ["no-metadata", "empty-metadata", "garbage-metadata", "truncated-data",
                                    "missing-data", "garbage-manifest"])
def test_torn_newest_checkpoint_is_never_returned(tmp_path, damage):
    _save(tmp_path, 1)
    new = _save(tmp_path, 2)
    data = new / "__0_0.distcp"
    if damage == "no-metadata":
        (new / ".metadata").unlink()
    elif damage == "empty-metadata":
        (new / ".metadata").write_bytes(b"")
    elif damage == "garbage-metadata":
        (new / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    elif damage == "truncated-data":
        os.truncate(data, data.stat().st_size - 1)
    elif damage == "missing-data":
        data.unlink()
    else:
        (new / ".cpuckpt.json").write_text("{not json")
    assert cpuckpt.find_latest(tmp_path) == tmp_path / "step_0001"
    info = {i.path.name: i for i in cpuckpt.list_checkpoints(tmp_path)}["step_0002"]
    assert not info.complete and info.reason
    assert _loads_as(tmp_path / "step_0001", 1)


def test_stock_dcp_checkpoints_are_listed_and_unrelated_dirs_are_not(tmp_path):
    dcp.save({"a": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    (tmp_path / "empty").mkdir()
    infos = cpuckpt.list_checkpoints(tmp_path)
    assert [i.path.name for i in infos] == ["stock"] and infos[0].complete and infos[0].step is None
    assert cpuckpt.find_latest(tmp_path) == tmp_path / "stock"
    _save(tmp_path, 5)
    assert cpuckpt.find_latest(tmp_path) == tmp_path / "step_0005"  # stepped ones sort after stock ones
    cpuckpt.clean_incomplete(tmp_path)
    assert (tmp_path / "notes" / "todo.txt").exists() and (tmp_path / "empty").is_dir()


# ---------------------------------------------------------------------------------- latest pointer


def test_update_latest_writes_the_name_atomically(tmp_path):
    a, b = _save(tmp_path, 1), _save(tmp_path, 2)
    cpuckpt.update_latest(tmp_path, a)
    assert (tmp_path / LATEST_NAME).read_text() == "step_0001\n"
    cpuckpt.update_latest(tmp_path, b)
    assert (tmp_path / LATEST_NAME).read_text() == "step_0002\n"
    assert cpuckpt.read_latest(tmp_path) == b
    assert not (tmp_path / "latest.tmp").exists()


def test_update_latest_refuses_incomplete_and_foreign_paths(tmp_path):
    a = _save(tmp_path, 1)
    other = _save(tmp_path / "elsewhere", 2)
    with pytest.raises(IntegrityError, match="not directly under"):
        cpuckpt.update_latest(tmp_path, other)
    (a / ".metadata").unlink()
    with pytest.raises(IntegrityError, match="incomplete"):
        cpuckpt.update_latest(tmp_path, a)
    assert not (tmp_path / LATEST_NAME).exists()


def test_read_latest_ignores_a_pointer_to_a_torn_checkpoint(tmp_path):
    a = _save(tmp_path, 1)
    cpuckpt.update_latest(tmp_path, a)
    (a / ".metadata").unlink()
    assert cpuckpt.read_latest(tmp_path) is None
    (tmp_path / LATEST_NAME).write_text("../../etc\n")
    assert cpuckpt.read_latest(tmp_path) is None


def test_latest_that_is_a_directory_is_not_clobbered(tmp_path, caplog):
    """A user checkpoint called `latest` must survive; the save still succeeds (a warning is logged)."""
    (tmp_path / LATEST_NAME).mkdir()
    (tmp_path / LATEST_NAME / "mine.txt").write_text("x")
    _save(tmp_path, 1, update_latest=True)
    assert (tmp_path / LATEST_NAME / "mine.txt").exists()
    assert "not a file" in caplog.text


def test_save_with_update_latest_moves_the_pointer(tmp_path):
    for k in (1, 2):
        _save(tmp_path, k, update_latest=True)
        assert cpuckpt.read_latest(tmp_path) == tmp_path / f"step_{k:04d}"


def test_async_save_with_update_latest_moves_the_pointer(tmp_path):
    cfg = dict(CFG, checkpoint={"update_latest": True, "keep_last": 1})
    for k in (1, 2):
        cpuckpt.async_save(_sd(k), tmp_path / f"step_{k:04d}", cfg, step=k).wait()
    assert cpuckpt.read_latest(tmp_path) == tmp_path / "step_0002"
    assert _names(i.path for i in cpuckpt.list_checkpoints(tmp_path)) == ["step_0002"]


# --------------------------------------------------------------------------------------- retention


def test_keep_last_and_keep_every(tmp_path):
    for k in range(1, 8):
        _save(tmp_path, k, keep_last=2, keep_every=3)
    assert _names(i.path for i in cpuckpt.list_checkpoints(tmp_path)) == ["step_0003", "step_0006", "step_0007"]
    assert _loads_as(tmp_path / "step_0007", 7) and _loads_as(tmp_path / "step_0003", 3)


def test_retention_keeps_the_newest_complete_even_when_newer_ones_are_torn(tmp_path):
    for k in (1, 2):
        _save(tmp_path, k)
    torn = _save(tmp_path, 3)
    (torn / ".metadata").unlink()
    removed = cpuckpt.apply_retention(tmp_path, keep_last=1)
    assert _names(removed) == ["step_0001"]
    assert cpuckpt.find_latest(tmp_path) == tmp_path / "step_0002"
    assert torn.is_dir(), "retention must leave incomplete directories to clean_incomplete"


def test_retention_never_deletes_a_checkpoint_being_loaded(tmp_path):
    for k in (1, 2, 3):
        _save(tmp_path, k)
    old = tmp_path / "step_0001"
    with loading(old):
        assert is_being_loaded(old)
        assert any(n.startswith(LOADING_PREFIX) for n in os.listdir(old))
        assert _names(cpuckpt.apply_retention(tmp_path, keep_last=1)) == ["step_0002"]
        assert _loads_as(old, 1)  # cpuckpt.load nests fine inside loading()
    assert not any(n.startswith(LOADING_PREFIX) for n in os.listdir(old)), "marker left behind"
    assert _names(cpuckpt.apply_retention(tmp_path, keep_last=1)) == ["step_0001"]


def test_loading_markers_of_other_processes(tmp_path):
    """A marker of a live process (or another host) protects; one of a dead local process does not."""
    for k in (1, 2):
        _save(tmp_path, k)
    old = tmp_path / "step_0001"
    host = socket.gethostname()
    live = old / f"{LOADING_PREFIX}{host}-{os.getppid()}-abcd1234"
    live.touch()
    assert is_being_loaded(old) and cpuckpt.apply_retention(tmp_path, keep_last=1) == []
    live.unlink()
    remote = old / f"{LOADING_PREFIX}some-other-host-1-abcd1234"
    remote.touch()
    assert cpuckpt.apply_retention(tmp_path, keep_last=1) == []
    remote.unlink()
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    (old / f"{LOADING_PREFIX}{host}-{dead_pid}-abcd1234").touch()
    assert not is_being_loaded(old)
    assert _names(cpuckpt.apply_retention(tmp_path, keep_last=1)) == ["step_0001"]


# ---------------------------------------------------------------------------------------- cleaning


def test_clean_incomplete_removes_leftovers_only(tmp_path):
    good = _save(tmp_path, 1)
    torn = _save(tmp_path, 2)
    (torn / ".metadata").unlink()
    writing = _save(tmp_path, 3)
    (writing / ".metadata").unlink()
    (good / "__0_.cpuckpt-part.json").write_text("{}")
    (good / ".metadata.tmp").write_bytes(b"x")
    (tmp_path / "latest.tmp").write_text("step_0002\n")
    removed = cpuckpt.clean_incomplete(tmp_path, keep=[writing])
    assert _names(removed) == [".metadata.tmp", "__0_.cpuckpt-part.json", "latest.tmp", "step_0002"]
    assert not torn.exists() and writing.is_dir()
    assert _loads_as(good, 1)
    # younger than min_age_s: a commit's own temporary files, about to be renamed (the pointer's, a part's)
    (tmp_path / "latest.tmp").write_text("step_0001\n")
    (good / "__0_.cpuckpt-part.json").write_text("{}")
    assert cpuckpt.clean_incomplete(tmp_path, min_age_s=600) == []
    assert (tmp_path / "latest.tmp").exists() and (good / "__0_.cpuckpt-part.json").exists()


@pytest.mark.parametrize("what", [".metadata", "data file"])
def test_a_checkpoint_that_cannot_be_read_is_never_deleted_nor_the_latest(tmp_path, monkeypatch, caplog, what):
    """An I/O error (EACCES, EIO, a stale NFS handle) reading a committed checkpoint made it "incomplete", and
    ``clean_incomplete`` deleted it. It is now unreadable: listed so, not loaded as the latest, never deleted."""
    import errno

    import cpuckpt.backend.committed as committed

    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    if what == ".metadata":
        real = committed.read_metadata_bytes

        def fail(path):
            if Path(path) == newest:
                raise cpuckpt.StorageIOError("cannot read", path=str(path / ".metadata"), errno_=errno.EIO)
            return real(path)

        monkeypatch.setattr(committed, "read_metadata_bytes", fail)
    else:
        real_stat = Path.stat

        def stat(self, *a, **k):
            if self.parent == newest and self.name.endswith(".distcp"):
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real_stat(self, *a, **k)

        monkeypatch.setattr(Path, "stat", stat)
    info = {c.path.name: c for c in cpuckpt.list_checkpoints(tmp_path)}["step_0002"]
    assert (info.complete, info.unreadable) == (False, True) and "cannot be read" in info.reason
    with caplog.at_level("WARNING"):
        assert cpuckpt.find_latest(tmp_path) == tmp_path / "step_0001"
        assert cpuckpt.clean_incomplete(tmp_path) == []
    assert "not removing" in caplog.text and "not a candidate" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):  # a restart loads the older one, and says why (every rank: one broadcast)
        assert cpuckpt.load_latest(_sd(0), tmp_path, CFG) == tmp_path / "step_0001"
    assert "skipping" in caplog.text and "cannot be read" in caplog.text
    monkeypatch.undo()
    assert _loads_as(newest, 2)


def _age(path: Path, seconds: float) -> None:
    t = os.stat(path).st_mtime - seconds
    for p in [path, *path.iterdir()]:
        os.utime(p, (t, t))


def test_clean_incomplete_after_commit_when_configured(tmp_path):
    """After a commit, only leftovers untouched for timeout_s go: a younger one may be a live save."""
    _save(tmp_path, 1)
    old, young = _save(tmp_path, 2), _save(tmp_path, 3)
    (old / ".metadata").unlink()
    (young / ".metadata").unlink()
    _age(old, 31)  # CFG's timeout_s is 30
    _save(tmp_path, 4, clean_incomplete=True)
    assert _names(i.path for i in cpuckpt.list_checkpoints(tmp_path)) == ["step_0001", "step_0003", "step_0004"]
    assert cpuckpt.clean_incomplete(tmp_path, min_age_s=3600) == []
    assert _names(cpuckpt.clean_incomplete(tmp_path)) == ["step_0003"]


def test_after_commit_does_nothing_by_default(tmp_path):
    a = _save(tmp_path, 1)
    torn = _save(tmp_path, 2)
    (torn / ".metadata").unlink()
    after_commit(a, Config())
    assert not (tmp_path / LATEST_NAME).exists() and torn.is_dir()


def test_stock_save_over_a_cpuckpt_checkpoint_is_complete(tmp_path):
    """The stale manifest of the earlier cpuckpt save is ignored, as the reader ignores it."""
    path = _save(tmp_path, 1)
    dcp.save({"w": torch.ones(64, 64), "b": torch.ones(7)}, storage_writer=dcp.FileSystemWriter(str(path)))
    info = cpuckpt.list_checkpoints(tmp_path)[0]
    assert info.complete and info.step is None
    assert cpuckpt.find_latest(tmp_path) == path


def test_latest_only_moves_forward_when_an_older_step_commits_late(tmp_path):
    cfg = {"checkpoint": {"update_latest": True}}
    cpuckpt.save({"w": torch.ones(3)}, tmp_path / "step_10", cfg, step=10)
    cpuckpt.save({"w": torch.ones(3)}, tmp_path / "step_5", cfg, step=5)  # e.g. a late persist from memory
    assert cpuckpt.read_latest(tmp_path).name == "step_10"
    cpuckpt.save({"w": torch.ones(3)}, tmp_path / "step_12", cfg, step=12)
    assert cpuckpt.read_latest(tmp_path).name == "step_12"


# ---------------------------------------------------------------------- one ordering, URLs refused


def _commit_time(path: Path, t: float) -> None:
    """Pretend ``path`` was committed at ``t`` (its ``.metadata``, written last, carries the commit time)."""
    os.utime(path / ".metadata", (t, t))


def _stepless(path: Path, k: int) -> Path:
    """A ``dcp.save`` through cpuckpt's ``StorageWriter`` given no step: a manifest with ``step: null``."""
    dcp.save(_sd(k), storage_writer=cpuckpt.StorageWriter(path, CFG))
    return path


def test_a_stepless_save_newer_than_a_stepped_one_is_the_latest(tmp_path):
    import time

    now = time.time()
    _commit_time(_save(tmp_path, 1), now - 100)
    newer = _stepless(tmp_path / "step_0002", 2)
    _commit_time(newer, now - 50)
    assert cpuckpt.list_checkpoints(tmp_path)[-1].step is None
    assert cpuckpt.find_latest(tmp_path) == newer
    _commit_time(newer, now - 200)  # committed before the stepped one: that one is newer
    assert cpuckpt.find_latest(tmp_path) == tmp_path / "step_0001"


def test_ls_and_find_latest_share_one_order(tmp_path):
    """Stock (old), step 5, a step-less save after it, then a late persist of step 3: the step-less one
    ranks above everything committed before it; the late older step does not outrank it."""
    import time

    from cpuckpt.tools.catalog import scan_root

    now = time.time()
    dcp.save(_sd(0), storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")))
    _commit_time(tmp_path / "stock", now - 300)
    _commit_time(_save(tmp_path, 5), now - 200)
    _commit_time(_stepless(tmp_path / "plain", 6), now - 100)
    _commit_time(_save(tmp_path, 3), now - 50)
    want = ["stock", "step_0003", "step_0005", "plain"]
    assert [c.path.name for c in cpuckpt.list_checkpoints(tmp_path)] == want
    listed = scan_root(tmp_path)
    assert [i.path.name for i in listed] == want
    assert [i.path.name for i in listed if i.latest] == ["plain"] == [cpuckpt.find_latest(tmp_path).name]


def test_every_root_entry_point_refuses_a_url(tmp_path):
    """Any URL but s3:// (object-storage roots are tests/s3/test_s3_roots.py's)."""
    from cpuckpt.roots import inspect_checkpoint

    url = "gs://bucket/run"
    calls = [lambda: cpuckpt.find_latest(url), lambda: cpuckpt.list_checkpoints(url),
             lambda: cpuckpt.read_latest(url), lambda: cpuckpt.update_latest(url, f"{url}/step_1"),
             lambda: cpuckpt.update_latest(tmp_path, "gs://bucket/run/step_1"),
             lambda: cpuckpt.clean_incomplete(url), lambda: cpuckpt.apply_retention(url, 2),
             lambda: inspect_checkpoint(f"{url}/step_1"), lambda: cpuckpt.load_latest({}, url)]
    for call in calls:
        with pytest.raises(cpuckpt.ConfigError, match=r"gs://.*not supported"):
            call()
    assert not (Path.cwd() / "gs:").exists()


def test_committed_once_is_the_verdict_of_the_inspection_not_a_second_look(tmp_path):
    """Committed once is what the inspection that said "incomplete" saw: a save that commits after it (a writer of
    the previous run committing while a restart lists) is not damage; the second look it took (a ``stat`` of
    ``.metadata``) called it "committed, but incomplete now", so a restart raised over a sound checkpoint."""
    import cpuckpt
    from cpuckpt.roots import committed_once, inspect_checkpoint

    d = tmp_path / "step_1"
    cpuckpt.save({"w": torch.arange(64.0)}, d, step=1)
    meta = d / ".metadata"
    held = meta.read_bytes()
    meta.unlink()  # the moment before the commit: data and manifest there, no .metadata
    before = inspect_checkpoint(d)
    meta.write_bytes(held)  # the commit lands
    assert not before.complete and not committed_once(before), before
    assert inspect_checkpoint(d).complete
    meta.write_bytes(b"")  # renamed without its bytes: no commit either
    assert not committed_once(inspect_checkpoint(d))
    meta.write_bytes(held)
    data = next(d.glob("*.distcp"))
    os.truncate(data, data.stat().st_size // 2)  # damaged after the commit
    after = inspect_checkpoint(d)
    assert not after.complete and committed_once(after), after
