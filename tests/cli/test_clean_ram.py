"""``cpuckpt clean --ram``: stale process files in /dev/shm (owner pid + boot id + host + pid namespace), and /dev/shm
itself as ROOT.

Run in-process through click's ``CliRunner``; a world-writable sticky directory under ``tmp_path``
stands in for /dev/shm, except for a dry run on the real one (which removes nothing).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from cpuckpt import procs, runfiles
from cpuckpt.tier import ramroot
from cpuckpt.tier.ramroot import RamRoot
from cpuckpt.tools.cli import cli


def _run(*args: object) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def _shared_dir(tmp_path: Path) -> Path:
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o1777)
    return shm


def _dead_pid() -> int:
    """The pid of a process that ran and was reaped just now."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _pid_ns() -> str:
    """This process's pid namespace as a run file's name records it (hex inode of /proc/self/ns/pid), read here
    rather than through cpuckpt."""
    return format(os.stat("/proc/self/ns/pid").st_ino, "x")


def _btime() -> float:
    """This boot's start (``btime`` of /proc/stat), read here rather than through cpuckpt."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise AssertionError("no btime in /proc/stat")


def _other(tag: str) -> str:
    """A tag of the same shape that is not ``tag``."""
    return format(int(tag, 16) ^ 1, f"0{len(tag)}x")


def _plant(shm: Path) -> tuple[list[Path], list[Path]]:
    """Process files: (stale ones, ones that must stay)."""
    boot, host, ns = runfiles.boot_tag(), procs.host_tag(), _pid_ns()
    dead = _dead_pid()
    other_boot = "f" * 12 if boot != "f" * 12 else "e" * 12  # a live pid recorded on another boot says nothing
    other_host = "a" * 12 if host != "a" * 12 else "b" * 12
    me, here = os.getpid(), f"h{host}-n{ns}"
    stale = [shm / f"cpuckpt-megatron-p{dead}-b{boot}-{here}-r0-0123456789ab.alive",
             shm / f"cpuckpt-megatron-p{dead}-b{boot}-{here}-r0-0123456789ab.status",
             shm / f"cpuckpt-megatron-p{me}-b{other_boot}-{here}-r1-0123456789ab.alive",  # this host's earlier boot
             shm / f"cpuckpt-megatron-p{dead}-b{boot}-r2-0123456789ab.alive",  # an older name (no host), this boot, old
             shm / f"cpuckpt-megatron-p{dead}-b{boot}-h{host}-r7-0123456789ab.alive",  # an older name (no ns), old
             shm / f"cpuckpt-megatron-p{dead}-b{boot}-h{other_host}-r3-0123456789ab.alive",  # another host's, old
             shm / f"cpuckpt-megatron-p{dead}-b{other_boot}-r4-0123456789ab.alive"]  # no host, another boot, old
    keep = [shm / f"cpuckpt-megatron-p{me}-b{boot}-{here}-r0-0123456789ab.alive",  # its owner runs (this process)
            shm / f"cpuckpt-megatron-p{me}-b{boot}-r2-0123456789ab.alive",  # an older name's, fresh
            # a pid of another host (a shared directory) or of another pid namespace (a container sharing this
            # node's hostname, boot and /dev/shm) says nothing here: gone locally, yet it stays while fresh
            shm / f"cpuckpt-megatron-p{dead}-b{boot}-h{other_host}-n{ns}-r5-0123456789ab.alive",
            shm / f"cpuckpt-megatron-p{dead}-b{boot}-h{host}-n{_other(ns)}-r8-0123456789ab.alive",
            shm / f"cpuckpt-megatron-p{dead}-b{boot}-h{host}-r9-0123456789ab.alive",  # no ns recorded, fresh
            # another boot's, modified since this boot started: a node of the same hostname sharing the directory
            shm / f"cpuckpt-megatron-p{dead}-b{other_boot}-{here}-r10-0123456789ab.alive",
            shm / f"cpuckpt-megatron-p{dead}-b{other_boot}-r6-0123456789ab.alive",  # no host, another boot: may be
            shm / "cpuckpt-something-else",  # not a process file                 # another node's, fresh: stays
            shm / "unrelated.txt"]
    for p in stale + keep:
        p.write_text("1")
    before_boot = _btime() - runfiles.BOOT_MARGIN_S - 60
    os.utime(stale[2], (before_boot, before_boot))
    old = time.time() - runfiles.FOREIGN_MIN_AGE_S - 60
    for p in stale[-4:]:
        os.utime(p, (old, old))
    d = shm / f"cpuckpt-megatron-p{dead}-b{boot}-{here}-r0-aaaaaaaaaaaa.dir"  # a directory of that name: never touched
    d.mkdir()
    keep.append(d)
    return stale, keep


def test_clean_ram_given_the_shared_shm_dir_says_it_is_no_ram_root_and_never_advises_chmod(tmp_path):
    shm = _shared_dir(tmp_path)
    code, out, err = _run("clean", "--ram", "--dry-run", shm)
    assert code == 0, out + err
    assert "chmod" not in out + err
    assert err.splitlines() == [f"{shm} is a shared system directory, not a RAM root: cleaning "
                                f"{shm}/cpuckpt-{os.geteuid()} and stale cpuckpt process files in {shm}"], err
    assert out.splitlines() == [f"no stale RAM roots under {shm}/cpuckpt-{os.geteuid()}"], out


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_clean_ram_dry_run_on_the_real_dev_shm_is_no_error():
    code, out, err = _run("clean", "--ram", "--dry-run", "/dev/shm")
    assert code == 0, out + err
    assert "chmod" not in out + err and "not a RAM root" in err


def test_clean_ram_removes_stale_process_files_in_the_ram_filesystem(tmp_path, monkeypatch):
    shm = _shared_dir(tmp_path)
    monkeypatch.setattr(ramroot, "SHM_DIR", shm)
    stale, keep = _plant(shm)
    code, out, _ = _run("clean", "--ram", "--dry-run")
    assert code == 0, out
    assert out.splitlines() == [f"would remove stale process file {p}" for p in sorted(stale)], out
    assert all(p.exists() for p in stale + keep)
    code, out, _ = _run("clean", "--ram")
    assert code == 0, out
    assert out.splitlines() == [f"removed stale process file {p}" for p in sorted(stale)], out
    assert not any(p.exists() for p in stale) and all(p.exists() for p in keep)


def test_clean_ram_of_shared_dir_cleans_roots_and_process_files_json(tmp_path):
    shm = _shared_dir(tmp_path)
    base = shm / f"cpuckpt-{os.geteuid()}"
    base.mkdir(mode=0o700)
    RamRoot.open(base / "job1", "job1", 0).close()  # a trainer that ended: stale
    stale, keep = _plant(shm)
    code, out, _ = _run("clean", "--ram", "--json", shm)
    assert code == 0, out
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows == [{"path": str(base / "job1"), "kind": "ram-root", "removed": True}] + [
        {"path": str(p), "kind": "process-file", "removed": True} for p in sorted(stale)], rows
    assert not (base / "job1").exists() and all(p.exists() for p in keep)


def test_run_file_names_record_owner_pid_boot_host_and_pid_namespace(tmp_path):
    base = runfiles.run_file_base("megatron", "r3", tmp_path)
    name = Path(base).name
    ns = procs.pid_ns_tag()
    assert ns == _pid_ns()
    assert name.startswith(f"cpuckpt-megatron-p{os.getpid()}-b{runfiles.boot_tag()}-h{procs.host_tag()}-n{ns}-r3-")
    info = runfiles.parse(name + ".alive")
    assert (info.tag, info.pid, info.boot, info.host, info.pidns) == (
        "megatron", os.getpid(), runfiles.boot_tag(), procs.host_tag(), ns)
    assert info.owner_alive() is True and not info.owner_gone()
    assert runfiles.parse("cpuckpt-1000") is None and runfiles.parse("cpuckpt-megatron-123-r0-x.alive") is None
    # older names still read; their pid namespace is unknown, so their pid is not asked about
    old = runfiles.parse(f"cpuckpt-megatron-p{os.getpid()}-b{runfiles.boot_tag()}-r3-0123456789ab.alive")
    assert (old.pid, old.host, old.pidns) == (os.getpid(), None, None) and old.owner_alive() is None
    older = runfiles.parse(f"cpuckpt-megatron-p{os.getpid()}-b{runfiles.boot_tag()}-h{procs.host_tag()}-r3-"
                           "0123456789ab.alive")
    assert (older.pid, older.host, older.pidns) == (os.getpid(), procs.host_tag(), None)
    assert older.owner_alive() is None


def test_a_run_file_of_a_process_that_cannot_read_its_pid_namespace_records_none(tmp_path, monkeypatch):
    """No ``/proc/self/ns/pid``: the name records no namespace, and its pid is never asked about (age rule)."""
    monkeypatch.setattr(procs, "PID_NS_PATH", str(tmp_path / "no-such-ns"))
    assert procs.pid_ns_tag() is None
    name = Path(runfiles.run_file_base("megatron", "r3", tmp_path)).name
    assert name.startswith(f"cpuckpt-megatron-p{os.getpid()}-b{runfiles.boot_tag()}-h{procs.host_tag()}-r3-")
    info = runfiles.parse(name)
    assert info.pidns is None and info.owner_alive() is None
    dead = runfiles.parse(f"cpuckpt-x-p{_dead_pid()}-b{runfiles.boot_tag()}-h{procs.host_tag()}-n{_pid_ns()}-0a")
    assert dead.owner_alive() is None  # this cleaner cannot tell its own namespace: it asks no pid


def test_a_pid_is_asked_about_only_on_the_host_boot_and_pid_namespace_that_recorded_it():
    """Another host's or another pid namespace's pid says nothing about this process's: its owner cannot be judged
    here (None), whether that pid runs here or not; nor can an older name's (no namespace) or one of another boot
    modified since this boot started (a node of the same hostname). This host's earlier boot (modified before this
    boot started): gone."""
    boot, host, ns, dead, me = runfiles.boot_tag(), procs.host_tag(), _pid_ns(), _dead_pid(), os.getpid()
    other_boot = "f" * 12 if boot != "f" * 12 else "e" * 12
    other_host = "a" * 12 if host != "a" * 12 else "b" * 12
    before_boot, now = _btime() - runfiles.BOOT_MARGIN_S - 1, time.time()

    def alive(pid: int, b: str, h: str | None, n: str | None = ns, mtime: float | None = None) -> bool | None:
        name = f"cpuckpt-x-p{pid}-b{b}{f'-h{h}' if h else ''}{f'-n{n}' if h and n else ''}-0123456789ab"
        return runfiles.parse(name).owner_alive(mtime)

    assert alive(me, boot, host) is True and alive(dead, boot, host) is False
    assert alive(me, boot, other_host) is None and alive(dead, boot, other_host) is None
    assert alive(me, boot, host, _other(ns)) is None and alive(dead, boot, host, _other(ns)) is None
    assert alive(me, boot, host, None) is None and alive(dead, boot, host, None) is None  # older names, no ns
    assert alive(me, other_boot, other_host, mtime=before_boot) is None
    assert alive(me, other_boot, host, mtime=before_boot) is False  # this host's earlier boot: ended with it
    assert alive(me, other_boot, host, _other(ns), mtime=before_boot) is False
    assert alive(me, other_boot, host, mtime=now) is None  # modified since this boot started: not an earlier boot's
    assert alive(me, other_boot, host, mtime=_btime()) is None  # within BOOT_MARGIN_S of it: not sure either
    assert alive(me, other_boot, host) is None  # no mtime to compare
    assert alive(me, boot, None) is None and alive(dead, boot, None) is None  # older names, this boot
    assert alive(me, other_boot, None, mtime=before_boot) is None  # older name, another boot: maybe another node's


def test_clean_stale_removes_files_it_cannot_judge_only_by_age(tmp_path):
    """``min_age_s`` decides for another host's file; this host's files go by their owner alone, whatever age."""
    boot, host, dead = runfiles.boot_tag(), procs.host_tag(), _dead_pid()
    other_host = "a" * 12 if host != "a" * 12 else "b" * 12
    foreign = tmp_path / f"cpuckpt-x-p{dead}-b{boot}-h{other_host}-n{_pid_ns()}-0123456789ab.alive"
    mine = tmp_path / f"cpuckpt-x-p{dead}-b{boot}-h{host}-n{_pid_ns()}-0123456789ab.alive"
    for p in (foreign, mine):
        p.write_text("1")
    t = time.time() - 100
    os.utime(foreign, (t, t))
    assert runfiles.clean_stale(tmp_path, min_age_s=200, dry_run=True) == [mine]
    assert runfiles.clean_stale(tmp_path, min_age_s=200) == [mine]
    assert foreign.exists() and not mine.exists()
    assert runfiles.clean_stale(tmp_path) == []  # the default: a day
    assert runfiles.clean_stale(tmp_path, min_age_s=50) == [foreign]
    assert not foreign.exists()


# scenario A, in a child process of a new pid namespace: ``unshare --pid --fork`` (root), or with a user namespace
# of its own (``--user --map-root-user``, no root needed where unprivileged user namespaces are allowed)
_CHILD = """
import json, os, sys
from pathlib import Path
from cpuckpt import runfiles
removed = runfiles.clean_stale(sys.argv[1], min_age_s=float(sys.argv[2]))
print(json.dumps({"pid": os.getpid(), "ns": format(os.stat("/proc/self/ns/pid").st_ino, "x"),
                  "removed": sorted(p.name for p in removed)}))
"""


@functools.cache
def _unshare_pid() -> tuple[str, ...] | None:
    """A command prefix that runs a program in a new pid namespace here, or None."""
    if shutil.which("unshare") is None:
        return None
    for cmd in (("unshare", "--pid", "--fork"), ("unshare", "--user", "--map-root-user", "--pid", "--fork")):
        try:
            if subprocess.run([*cmd, sys.executable, "-c", "pass"], capture_output=True, timeout=60).returncode == 0:
                return cmd
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def _in_new_pid_ns(prefix: tuple[str, ...], directory: Path, min_age_s: float) -> dict:
    import cpuckpt

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(cpuckpt.__file__).parent.parent),
                                                      env.get("PYTHONPATH")]))
    res = subprocess.run([*prefix, sys.executable, "-c", _CHILD, str(directory), str(min_age_s)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_unshare_pid() is None, reason="unshare --pid --fork does not work here (simulated below)")
def test_a_cleaner_in_another_pid_namespace_keeps_a_live_owners_files(tmp_path):
    """Scenario A: two containers of one node with host network and host IPC share the hostname, the boot and
    /dev/shm, but count pids apart. A cleaner in the other pid namespace sees this live owner's pid free there; it
    must keep the owner's file until untouched for ``min_age_s``. The same file's owner is judged by its pid in its
    own namespace: a dead one's file goes at once there."""
    alive = Path(runfiles.run_file_base("megatron", "r0", tmp_path) + ".alive")  # this process's: it runs
    alive.write_text("1")
    dead = tmp_path / f"cpuckpt-megatron-p{_dead_pid()}-b{runfiles.boot_tag()}-h{procs.host_tag()}-n{_pid_ns()}" \
                      "-r1-0123456789ab.alive"
    dead.write_text("1")
    child = _in_new_pid_ns(_unshare_pid(), tmp_path, 3600)
    assert child["ns"] != _pid_ns() and child["pid"] != os.getpid()  # it ran in another pid namespace
    assert child["removed"] == [] and alive.exists() and dead.exists()  # neither pid means anything there
    assert runfiles.clean_stale(tmp_path) == [dead] and alive.exists()  # here, in their namespace: by the pid
    t = time.time() - 7200
    os.utime(alive, (t, t))
    child = _in_new_pid_ns(_unshare_pid(), tmp_path, 3600)
    assert child["removed"] == [alive.name] and not alive.exists()  # there, by its age alone


def test_a_pid_recorded_in_another_pid_namespace_is_judged_by_age(tmp_path):
    """Scenario A, simulated (needs no namespace): a name recording another pid namespace, with a pid that is free
    here (its owner runs in its own namespace) or one that runs here (another process), stays until untouched for
    ``min_age_s``, then goes."""
    boot, host, ns = runfiles.boot_tag(), procs.host_tag(), _other(_pid_ns())
    free = tmp_path / f"cpuckpt-megatron-p{_dead_pid()}-b{boot}-h{host}-n{ns}-r0-0123456789ab.alive"
    taken = tmp_path / f"cpuckpt-megatron-p{os.getpid()}-b{boot}-h{host}-n{ns}-r1-0123456789ab.alive"
    for p in (free, taken):
        p.write_text("1")
    t = time.time() - 100
    os.utime(free, (t, t))
    os.utime(taken, (t, t))
    assert runfiles.clean_stale(tmp_path, min_age_s=200) == [] and free.exists() and taken.exists()
    assert runfiles.clean_stale(tmp_path, min_age_s=50) == sorted([free, taken])
    assert not free.exists() and not taken.exists()


def test_another_boot_of_this_host_tag_is_an_earlier_boot_only_if_modified_before_this_boot_started(tmp_path):
    """Scenario B: nodes sharing a hostname and a directory ($TMPDIR on a shared file system) write names of the
    same host tag and different boots. Another boot's file modified since this boot started may be a live owner's
    on another node: it stays until untouched for ``min_age_s``; one modified before this boot started is this
    host's earlier boot's (or an owner silent since): removed at once."""
    boot, host, me = runfiles.boot_tag(), procs.host_tag(), os.getpid()
    other_boot = "f" * 12 if boot != "f" * 12 else "e" * 12
    fresh = tmp_path / f"cpuckpt-megatron-p{me}-b{other_boot}-h{host}-r0-0123456789ab.alive"
    before = tmp_path / f"cpuckpt-megatron-p{me}-b{other_boot}-h{host}-r1-0123456789ab.alive"
    for p in (fresh, before):
        p.write_text("1")
    t = _btime() - 3600
    os.utime(before, (t, t))
    assert runfiles.clean_stale(tmp_path) == [before]
    assert fresh.exists() and not before.exists()
    t = time.time() - 100
    os.utime(fresh, (t, t))
    assert runfiles.clean_stale(tmp_path, min_age_s=200) == [] and fresh.exists()
    assert runfiles.clean_stale(tmp_path, min_age_s=50) == [fresh] and not fresh.exists()


def test_megatron_channels_are_run_files_and_the_first_one_removes_stale_ones(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    from cpuckpt.integrations.megatron import worker

    shm = _shared_dir(tmp_path)
    monkeypatch.setattr(runfiles, "SHM_DIR", shm)
    monkeypatch.setattr(worker, "_cleaned_stale", False)
    stale, keep = _plant(shm)
    channel = worker.new_channel(0)
    assert channel.base.startswith(f"{shm}/cpuckpt-megatron-p{os.getpid()}-b{runfiles.boot_tag()}-h{procs.host_tag()}"
                                   f"-n{procs.pid_ns_tag()}-r0-")
    assert not any(p.exists() for p in stale) and all(p.exists() for p in keep)
