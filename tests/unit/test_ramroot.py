"""The RAM root of the memory tier: private directories, owner record, rank and writer locks, space checks, clean."""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from cpuckpt.errors import CpuckptError
from cpuckpt.tier import ramroot
from cpuckpt.tier.ramroot import (
    TINY_BYTES,
    Owner,
    RamRoot,
    RamRootError,
    acquire_lock,
    clean_ram_roots,
    default_root,
    job_id_for,
    lock_holder,
)

UID = os.geteuid()
OTHER_UID = 12345

_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, str(os.getpid()).encode())
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /dev/shm (world-writable and sticky, like the real one)."""
    base = tmp_path / "shm"
    base.mkdir()
    os.chmod(base, 0o1777)
    monkeypatch.setattr(ramroot, "SHM_DIR", base)
    return base


@pytest.fixture
def hold_lock():
    """Start a process that flocks a file (writing its pid there) and sleeps; killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(path: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return path


def _fake_statvfs(monkeypatch: pytest.MonkeyPatch, under: Path, *, total: int, free: int) -> None:
    real = os.statvfs

    def fake(path):
        if str(path).startswith(str(under)):
            return types.SimpleNamespace(f_frsize=4096, f_blocks=total // 4096, f_bavail=free // 4096)
        return real(path)

    monkeypatch.setattr(ramroot.os, "statvfs", fake)


# ------------------------------------------------------------------------------------------ naming


def test_default_root_shape_creates_nothing():
    root = default_root("run-1.a_B", uid=4242)
    assert root.name == "run-1.a_B"
    assert root.parent.name == "cpuckpt-4242"
    if Path("/dev/shm").is_dir():
        assert root.parent.parent == Path("/dev/shm")
    assert not root.parent.exists()
    assert default_root("x").parent.name == f"cpuckpt-{UID}"


def test_default_root_makes_job_safe_and_unique():
    a, b = default_root("a/../b c", uid=1).name, default_root("a/../b_c", uid=1).name
    assert "/" not in a and " " not in a and a != b
    assert len({default_root(j, uid=1).name for j in ("..", ".", "a/b", "a_b")}) == 4
    assert default_root("..", uid=1).name not in ("..", ".")
    with pytest.raises(CpuckptError, match="job id"):
        default_root("")


def test_default_root_falls_back_to_tempdir(monkeypatch, tmp_path):
    monkeypatch.setattr(ramroot, "SHM_DIR", tmp_path / "absent")
    monkeypatch.setattr(ramroot.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert default_root("j", uid=7) == tmp_path / "tmp" / "cpuckpt-7" / "j"


def test_job_id_for(tmp_path, monkeypatch):
    a = job_id_for(tmp_path / "ckpt")
    assert a.startswith("ckpt-") and len(a) == len("ckpt-") + 12
    assert job_id_for(str(tmp_path / "ckpt") + "/") == a
    monkeypatch.chdir(tmp_path)
    assert job_id_for("ckpt") == a
    assert job_id_for(tmp_path / "other" / "ckpt") != a
    assert job_id_for("/").startswith("root-")


# -------------------------------------------------------------------------------------------- open


def test_open_creates_private_dirs_and_owner_record(shm):
    old = os.umask(0o777)  # the modes must not come from the umask
    try:
        r = RamRoot.open(None, "job1", 0, uid=UID)
    finally:
        os.umask(old)
    try:
        assert r.path == shm / f"cpuckpt-{UID}" / "job1"
        for d in (r.path, r.path.parent):
            st = os.lstat(d)
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == UID
        rec = r.path / ".owner.json"
        assert stat.S_IMODE(os.lstat(rec).st_mode) == 0o600
        data = json.loads(rec.read_text())
        assert data["job"] == "job1" and data["uid"] == UID
        assert data["host"] == socket.gethostname()
        assert data["boot_id"] == ramroot._boot_id() != ""
        assert r.owner == Owner(**data)
        assert r.fs_total >= TINY_BYTES and r.fs_free > 0
        assert r.rank_alive(0) == os.getpid()
        for name in (".rank-0.lock", ".open.lock"):
            assert stat.S_IMODE(os.lstat(r.path / name).st_mode) == 0o600
    finally:
        r.close()


def test_ranks_share_a_root_and_a_rank_is_exclusive(shm):
    r0 = RamRoot.open(None, "job", 0)
    r1 = RamRoot.open(None, "job", 1)
    assert r1.path == r0.path and r1.owner == r0.owner
    with pytest.raises(RamRootError) as e:
        RamRoot.open(None, "job", 0)
    assert f"process {os.getpid()}" in str(e.value) and ".rank-0.lock" in str(e.value)
    assert str(r0.path) in str(e.value) and e.value.path == str(r0.path)
    r0.close()
    r0.close()  # idempotent
    assert r0.rank_alive(0) is None and r0.rank_alive(1) == os.getpid()
    again = RamRoot.open(None, "job", 0)
    assert again.owner == r0.owner  # joined, not recreated
    again.close()
    r1.close()


def test_same_rank_in_another_process_is_refused(tmp_path, hold_lock):
    root = _private_dir(tmp_path / "root")
    RamRoot.open(root, "job", 0).close()
    child = hold_lock(root / ".rank-2.lock")
    with pytest.raises(RamRootError, match=rf"rank 2 of job 'job' is already open in process {child.pid}"):
        RamRoot.open(root, "job", 2)
    child.kill()
    child.wait()
    RamRoot.open(root, "job", 2).close()  # a dead holder's lock is free


def test_concurrent_opens_agree_on_one_owner(tmp_path):
    root = tmp_path / "root"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        owners = pool.starmap(_open_and_report, [(str(root), r) for r in range(8)])
    assert all(o == owners[0] for o in owners), owners
    assert Owner(**json.loads((root / ".owner.json").read_text())) == owners[0]


def test_open_starts_over_when_the_root_is_removed_meanwhile(tmp_path):
    root = tmp_path / "root"
    first = RamRoot.open(root, "job", 0)
    first.close()
    fd = os.open(root / ".open.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as clean_ram_roots does while it removes a root
    result: list = []
    opener = threading.Thread(target=lambda: result.append(RamRoot.open(root, "job", 1)))
    opener.start()
    time.sleep(0.2)
    assert opener.is_alive() and not result  # waits for the lock
    shutil.rmtree(root)
    os.close(fd)
    opener.join(5)
    (r,) = result
    try:
        assert r.owner.created_unix > first.owner.created_unix  # a fresh root, complete with record and lock
        assert Owner(**json.loads((root / ".owner.json").read_text())) == r.owner
        assert r.rank_alive(1) == os.getpid()
    finally:
        r.close()


def _open_and_report(path: str, rank: int) -> Owner:
    with RamRoot.open(path, "job", rank) as r:
        return r.owner


# ---------------------------------------------------------------------------------------- refusals


def test_root_of_another_user_refused(tmp_path):
    root = _private_dir(tmp_path / "root")
    os.chown(root, OTHER_UID, -1)
    with pytest.raises(RamRootError, match=rf"owned by uid {OTHER_UID}, not by uid {UID}") as e:
        RamRoot.open(root, "job", 0)
    assert str(root) in str(e.value) and "memory.root" in str(e.value)
    assert not (root / ".owner.json").exists()


def test_uid_parameter_is_the_owner_required(tmp_path):
    root = _private_dir(tmp_path / "root")
    with pytest.raises(RamRootError, match=rf"owned by uid {UID}, not by uid {OTHER_UID}"):
        RamRoot.open(root, "job", 0, uid=OTHER_UID)
    os.chown(root, OTHER_UID, -1)
    RamRoot.open(root, "job", 0, uid=OTHER_UID).close()
    assert json.loads((root / ".owner.json").read_text())["uid"] == OTHER_UID


def test_default_parent_of_another_user_refused(shm):
    parent = _private_dir(shm / f"cpuckpt-{UID}")
    os.chown(parent, OTHER_UID, -1)
    with pytest.raises(RamRootError, match=rf"per-user RAM directory {parent} is owned by uid {OTHER_UID}"):
        RamRoot.open(None, "job", 0)
    assert not (parent / "job").exists()


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o750, 0o701])
def test_group_or_other_access_refused(tmp_path, mode):
    root = _private_dir(tmp_path / "root")
    os.chmod(root, mode)
    with pytest.raises(RamRootError, match=rf"mode {mode:o}.*chmod 700 {root}"):
        RamRoot.open(root, "job", 0)


def test_symlinked_root_refused(tmp_path):
    real = _private_dir(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(RamRootError, match=rf"{link} is a symlink \(to {real}\)"):
        RamRoot.open(link, "job", 0)
    assert not (real / ".owner.json").exists()


def test_symlink_planted_in_shm_refused(shm, tmp_path):
    attacker = _private_dir(tmp_path / "attacker")
    (shm / f"cpuckpt-{UID}").symlink_to(attacker)
    with pytest.raises(RamRootError, match="is a symlink"):
        RamRoot.open(None, "job", 0)
    assert list(attacker.iterdir()) == []
    parent = shm / f"cpuckpt-{UID}"
    parent.unlink()
    _private_dir(parent)
    (parent / "job").symlink_to(attacker)
    with pytest.raises(RamRootError, match=rf"RAM root {parent / 'job'} is a symlink"):
        RamRoot.open(None, "job", 0)
    assert list(attacker.iterdir()) == []


def test_file_instead_of_root_refused(tmp_path):
    (tmp_path / "root").write_text("x")
    with pytest.raises(RamRootError, match="not a directory"):
        RamRoot.open(tmp_path / "root", "job", 0)


def test_root_of_another_job_refused(tmp_path):
    root = tmp_path / "root"
    RamRoot.open(root, "jobA", 0).close()
    with pytest.raises(RamRootError, match=r"belongs to job 'jobA'.*cpuckpt clean") as e:
        RamRoot.open(root, "jobB", 0)
    assert str(root) in str(e.value)
    assert json.loads((root / ".owner.json").read_text())["job"] == "jobA"
    assert lock_holder(root / ".rank-0.lock") is None


def test_bad_arguments():
    with pytest.raises(CpuckptError, match="job id"):
        RamRoot.open(None, "", 0)
    with pytest.raises(CpuckptError, match="rank"):
        RamRoot.open(None, "j", -1)


# ------------------------------------------------------------------------------------------- stale


def _write_owner(root: Path, **changes) -> None:
    data = {"job": "job", "uid": UID, "host": socket.gethostname(), "boot_id": ramroot._boot_id(),
            "created_unix": 1.0, **changes}
    (root / ".owner.json").write_text(json.dumps(data))


@pytest.mark.parametrize("field", ["boot_id", "host"])
def test_stale_root_is_taken_over(tmp_path, caplog, field):
    root = _private_dir(tmp_path / "root")
    _write_owner(root, **{field: "elsewhere"})
    (root / ".writer-0.lock").write_text("999999")  # lock files of the dead boot, not held
    (root / ".rank-0.lock").write_text("999999")
    with caplog.at_level(logging.WARNING, logger=ramroot.__name__):
        r = RamRoot.open(root, "job", 0)
    r.close()
    assert "elsewhere" in caplog.text and "taking it over as stale" in caplog.text
    data = json.loads((root / ".owner.json").read_text())
    assert data["boot_id"] == ramroot._boot_id() and data["host"] == socket.gethostname()
    assert data["created_unix"] > 1.0
    assert r.owner == Owner(**data)
    assert not (root / ".owner.json.tmp").exists()


def test_stale_root_with_a_held_lock_is_refused(tmp_path, hold_lock, caplog):
    root = _private_dir(tmp_path / "root")
    _write_owner(root, boot_id="another-boot")
    child = hold_lock(root / ".writer-3.lock")
    with pytest.raises(RamRootError, match=rf"boot another-boot.*still held \(.writer-3.lock by pid {child.pid}\)"):
        RamRoot.open(root, "job", 0)
    assert json.loads((root / ".owner.json").read_text())["boot_id"] == "another-boot"
    assert "taking it over" not in caplog.text


def test_owner_record_left_empty_by_a_dead_creator(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(ramroot, "_OWNER_READ_WAIT_S", 0.1)
    root = _private_dir(tmp_path / "root")
    (root / ".owner.json").write_text("")
    with caplog.at_level(logging.WARNING, logger=ramroot.__name__):
        RamRoot.open(root, "job", 0).close()
    assert "not a valid owner record" in caplog.text
    assert json.loads((root / ".owner.json").read_text())["job"] == "job"


def test_owner_record_symlink_refused(tmp_path):
    root = _private_dir(tmp_path / "root")
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    (root / ".owner.json").symlink_to(target)
    with pytest.raises(RamRootError, match=r"cannot read .*\.owner\.json"):
        RamRoot.open(root, "job", 0)
    assert target.read_text() == "{}"


# -------------------------------------------------------------------------------------- liveness


def test_writer_and_rank_liveness_with_a_real_process(tmp_path, hold_lock):
    with RamRoot.open(tmp_path / "root", "job", 0) as r:
        assert r.writer_lock_path(1) == r.path / ".writer-1.lock"
        assert r.writer_alive(1) is None and r.rank_alive(1) is None
        assert r.wait_writer_gone(1, 0.0) is True
        writer = hold_lock(r.writer_lock_path(1))
        trainer = hold_lock(r.path / ".rank-1.lock")
        assert r.writer_alive(1) == writer.pid
        assert r.rank_alive(1) == trainer.pid
        assert r.writer_alive(0) is None
        assert r.wait_writer_gone(1, 0.2) is False
        writer.kill()
        assert r.wait_writer_gone(1, 5.0) is True
        assert r.writer_alive(1) is None
        assert r.rank_alive(1) == trainer.pid


def test_acquire_lock_for_the_writer(tmp_path):
    path = tmp_path / ".writer-0.lock"
    fd = acquire_lock(path)
    assert fd is not None
    try:
        assert path.read_text().strip() == str(os.getpid())
        assert lock_holder(path) == os.getpid()
        assert acquire_lock(path, wait_s=0.05) is None
    finally:
        os.close(fd)
    assert lock_holder(path) is None
    assert lock_holder(tmp_path / "absent.lock") is None


# ------------------------------------------------------------------------------------------- space


def test_tiny_filesystem_refused(shm, monkeypatch):
    _fake_statvfs(monkeypatch, shm, total=64 * 1024**2, free=64 * 1024**2)
    with pytest.raises(RamRootError) as e:
        RamRoot.open(None, "job", 0)
    msg = str(e.value)
    assert "only 64 MiB" in msg and "--shm-size" in msg and "memory.root" in msg and "emptyDir" in msg
    assert str(shm / f"cpuckpt-{UID}" / "job") in msg
    assert not (shm / f"cpuckpt-{UID}" / "job").exists()  # created by the refused open, removed again


def test_filesystem_just_large_enough_is_accepted(tmp_path, monkeypatch):
    _fake_statvfs(monkeypatch, tmp_path, total=TINY_BYTES, free=TINY_BYTES)
    with RamRoot.open(tmp_path / "root", "job", 0) as r:
        assert r.fs_total == TINY_BYTES


def test_check_space(tmp_path, monkeypatch):
    gib = 1024**3
    _fake_statvfs(monkeypatch, tmp_path, total=16 * gib, free=10 * gib)
    with RamRoot.open(tmp_path / "root", "job", 0, headroom_bytes=gib) as r:
        r.check_space(9 * gib)  # exactly the headroom left
        r.check_space(9 * gib + gib // 2, already_reserved=gib)
        r.check_space(0, already_reserved=50 * gib)
        with pytest.raises(RamRootError) as e:
            r.check_space(9 * gib + 4096)
        msg = str(e.value)
        assert f"{9 * gib + 4096} bytes" in msg and f"{10 * gib} bytes" in msg
        assert "memory.headroom_bytes=1 GiB" in msg and str(r.path) in msg
        assert "memory.slots" in msg and "--shm-size" in msg
        assert r.fs_free == 10 * gib


def test_check_space_warns_about_the_cgroup_limit(tmp_path, monkeypatch, caplog):
    cg = tmp_path / "cgroup"
    (cg / "job.slice").mkdir(parents=True)
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("1\n")
    (cg / "job.slice" / "memory.max").write_text(f"{2 * 1024**3}\n")
    (cg / "job.slice" / "memory.current").write_text(f"{1024**3}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/job.slice\n")
    monkeypatch.setattr(ramroot, "CGROUP_DIR", cg)
    monkeypatch.setattr(ramroot, "PROC_SELF_CGROUP", proc)
    _fake_statvfs(monkeypatch, tmp_path, total=64 * 1024**3, free=64 * 1024**3)
    with RamRoot.open(tmp_path / "root", "job", 0, headroom_bytes=0) as r, \
            caplog.at_level(logging.WARNING, logger=ramroot.__name__):
        r.check_space(1024**3)  # fits exactly: no warning
        assert caplog.text == ""
        r.check_space(1024**3 + 1)
        assert "tmpfs pages count against that limit" in caplog.text and "1 GiB" in caplog.text
        caplog.clear()
        (cg / "job.slice" / "memory.max").write_text("max\n")
        r.check_space(8 * 1024**3)
        assert caplog.text == ""


# ------------------------------------------------------------------------------------ remove, clean


def test_remove(tmp_path):
    root = tmp_path / "root"
    r0, r1 = RamRoot.open(root, "job", 0), RamRoot.open(root, "job", 1)
    (root / "image-0").write_bytes(b"x" * 10)
    with pytest.raises(RamRootError, match=r"still in use \(.rank-1.lock by pid"):
        r0.remove()
    assert root.is_dir() and r0.rank_alive(0) is None  # closed all the same
    r1.close()
    r0.remove()
    assert not root.exists()
    r0.remove()  # already gone: nothing to do


def test_remove_unlinks_large_files_side_by_side_and_never_follows_a_link(tmp_path):
    """Large images go on threads (sparse here: their size is what counts), then the rest; a symbolic link inside
    is removed as a link, its target stays."""
    root = tmp_path / "root"
    outside = tmp_path / "outside.bin"
    with open(outside, "wb") as f:
        f.truncate(128 << 20)
    r = RamRoot.open(root, "job", 0)
    for k in range(3):
        (root / f"slot-{k}").mkdir()
        with open(root / f"slot-{k}" / "__0_0.distcp", "wb") as f:
            f.truncate(96 << 20)
        (root / f"slot-{k}" / ".manifest.json").write_text("{}")
    (root / "slot-0" / "link.bin").symlink_to(outside)
    r.remove()
    assert not root.exists() and outside.stat().st_size == 128 << 20


def test_remove_at_interpreter_exit_removes_everything(tmp_path):
    """An atexit handler's removal (no new thread can start then): the large files go one after the other."""
    root = tmp_path / "root"
    script = f"""
import atexit
from pathlib import Path
from cpuckpt.tier.ramroot import RamRoot
root = Path({str(root)!r})
r = RamRoot.open(root, "job", 0, headroom_bytes=0)
for k in range(2):
    (root / f"slot-{{k}}").mkdir()
    with open(root / f"slot-{{k}}" / "img", "wb") as f:
        f.truncate(96 << 20)
atexit.register(r.remove)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert not root.exists()


def test_clean_ram_roots(shm, hold_lock):
    base = shm / f"cpuckpt-{UID}"
    RamRoot.open(None, "stale", 0).close()
    RamRoot.open(None, "live-trainer", 0).close()
    RamRoot.open(None, "live-writer", 0).close()
    live_trainer = hold_lock(base / "live-trainer" / ".rank-5.lock")
    hold_lock(base / "live-writer" / ".writer-0.lock")
    _private_dir(base / "not-a-root")
    (base / "stray-file").write_text("x")

    assert clean_ram_roots(dry_run=True) == [base / "stale"]
    assert sorted(p.name for p in base.iterdir()) == ["live-trainer", "live-writer", "not-a-root", "stale",
                                                      "stray-file"]
    assert clean_ram_roots() == [base / "stale"]
    assert sorted(p.name for p in base.iterdir()) == ["live-trainer", "live-writer", "not-a-root", "stray-file"]

    live_trainer.kill()
    live_trainer.wait()
    assert clean_ram_roots(base) == [base / "live-trainer"]
    assert clean_ram_roots(base) == []
    assert (base / "live-writer" / ".owner.json").exists()


def test_clean_a_single_root_and_missing_base(tmp_path):
    root = tmp_path / "root"
    r = RamRoot.open(root, "job", 0)
    assert clean_ram_roots(root) == []
    r.close()
    assert clean_ram_roots(root, dry_run=True) == [root] and root.exists()
    assert clean_ram_roots(root) == [root] and not root.exists()
    assert clean_ram_roots(tmp_path / "absent") == []


def test_clean_skips_roots_of_others(tmp_path):
    base = _private_dir(tmp_path / "base")
    RamRoot.open(base / "theirs", "job", 0).close()
    os.chown(base / "theirs", OTHER_UID, -1)
    assert clean_ram_roots(base) == []
    assert (base / "theirs" / ".owner.json").exists()
    os.chmod(base, 0o777)
    with pytest.raises(RamRootError, match="group or others"):
        clean_ram_roots(base)


def test_error_pickles_with_its_path():
    import pickle

    e = pickle.loads(pickle.dumps(RamRootError("boom", path="/x")))
    assert isinstance(e, RamRootError) and str(e) == "boom" and e.path == "/x"


def test_removing_the_last_root_removes_the_per_user_directory_too(shm: Path) -> None:
    """Nothing stays in /dev/shm after a clean end: the per-user directory goes with the last job's root in it
    (another job's root keeps it)."""
    a = RamRoot.open(None, "job-a", 0, headroom_bytes=0)
    b = RamRoot.open(None, "job-b", 0, headroom_bytes=0)
    parent = shm / f"cpuckpt-{UID}"
    a.remove()
    assert sorted(p.name for p in parent.iterdir()) == [b.path.name]
    b.remove()
    assert list(shm.iterdir()) == []


def test_a_root_opens_when_another_jobs_removal_takes_the_per_user_directory_meanwhile(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-user directory is removed once empty: a job opening its root just then creates it again."""
    real = ramroot._mkdir_private
    removed = []

    def mkdir_then_lose_parent(path: Path) -> bool:
        made = real(path)
        if path.name == f"cpuckpt-{UID}" and not removed:
            os.rmdir(path)  # the other job's remove(), right after this one created it
            removed.append(path)
        return made

    monkeypatch.setattr(ramroot, "_mkdir_private", mkdir_then_lose_parent)
    root = RamRoot.open(None, "job-a", 0, headroom_bytes=0)
    try:
        assert removed and root.path.is_dir() and root.path.parent == shm / f"cpuckpt-{UID}"
    finally:
        root.remove()
