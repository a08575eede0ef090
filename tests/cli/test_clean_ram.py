"""``cpuckpt clean --ram``: stale process files in /dev/shm (owner pid + boot id + host), and /dev/shm itself as ROOT.

Run in-process through click's ``CliRunner``; a world-writable sticky directory under ``tmp_path``
stands in for /dev/shm, except for a dry run on the real one (which removes nothing).
"""

from __future__ import annotations

import json
import os
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


def _plant(shm: Path) -> tuple[list[Path], list[Path]]:
    """Process files: (stale ones, ones that must stay)."""
    boot, host = runfiles.boot_tag(), procs.host_tag()
    dead = _dead_pid()
    other_boot = "f" * 12 if boot != "f" * 12 else "e" * 12  # a live pid recorded on another boot says nothing
    other_host = "a" * 12 if host != "a" * 12 else "b" * 12
    me = os.getpid()
    stale = [shm / f"cpuckpt-megatron-p{dead}-b{boot}-h{host}-r0-0123456789ab.alive",
             shm / f"cpuckpt-megatron-p{dead}-b{boot}-h{host}-r0-0123456789ab.status",
             shm / f"cpuckpt-megatron-p{me}-b{other_boot}-h{host}-r1-0123456789ab.alive",  # this host's earlier boot
             shm / f"cpuckpt-megatron-p{dead}-b{boot}-r2-0123456789ab.alive",  # an older name (no host), this boot
             shm / f"cpuckpt-megatron-p{dead}-b{boot}-h{other_host}-r3-0123456789ab.alive",  # another host's, old
             shm / f"cpuckpt-megatron-p{dead}-b{other_boot}-r4-0123456789ab.alive"]  # no host, another boot, old
    keep = [shm / f"cpuckpt-megatron-p{me}-b{boot}-h{host}-r0-0123456789ab.alive",  # its owner runs (this process)
            shm / f"cpuckpt-megatron-p{me}-b{boot}-r2-0123456789ab.alive",  # so does an older name's
            # another host's pid (a shared directory) says nothing here: gone locally, yet it stays while fresh
            shm / f"cpuckpt-megatron-p{dead}-b{boot}-h{other_host}-r5-0123456789ab.alive",
            shm / f"cpuckpt-megatron-p{dead}-b{other_boot}-r6-0123456789ab.alive",  # no host, another boot: may be
            shm / "cpuckpt-something-else",  # not a process file                 # another node's, fresh: stays
            shm / "unrelated.txt"]
    for p in stale + keep:
        p.write_text("1")
    old = time.time() - runfiles.FOREIGN_MIN_AGE_S - 60
    for p in stale[-2:]:
        os.utime(p, (old, old))
    d = shm / f"cpuckpt-megatron-p{dead}-b{boot}-h{host}-r0-aaaaaaaaaaaa.dir"  # a directory of that name: never touched
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


def test_run_file_names_record_owner_pid_boot_and_host(tmp_path):
    base = runfiles.run_file_base("megatron", "r3", tmp_path)
    name = Path(base).name
    assert name.startswith(f"cpuckpt-megatron-p{os.getpid()}-b{runfiles.boot_tag()}-h{procs.host_tag()}-r3-")
    info = runfiles.parse(name + ".alive")
    assert (info.tag, info.pid, info.boot, info.host) == ("megatron", os.getpid(), runfiles.boot_tag(),
                                                          procs.host_tag())
    assert info.owner_alive() is True and not info.owner_gone()
    assert runfiles.parse("cpuckpt-1000") is None and runfiles.parse("cpuckpt-megatron-123-r0-x.alive") is None
    old = runfiles.parse(f"cpuckpt-megatron-p{os.getpid()}-b{runfiles.boot_tag()}-r3-0123456789ab.alive")
    assert (old.pid, old.host) == (os.getpid(), None) and old.owner_alive() is True  # an older name still reads


def test_a_pid_is_asked_about_only_on_the_host_and_boot_that_recorded_it():
    """Another host's pid says nothing about this host's processes: its owner cannot be judged here (None),
    whether that pid runs here or not; nor can an older name's (no host) of another boot, which may be another
    node's. This host's earlier boot: gone."""
    boot, host, dead, me = runfiles.boot_tag(), procs.host_tag(), _dead_pid(), os.getpid()
    other_boot = "f" * 12 if boot != "f" * 12 else "e" * 12
    other_host = "a" * 12 if host != "a" * 12 else "b" * 12

    def alive(pid: int, b: str, h: str | None) -> bool | None:
        return runfiles.parse(f"cpuckpt-x-p{pid}-b{b}{f'-h{h}' if h else ''}-0123456789ab").owner_alive()

    assert alive(me, boot, host) is True and alive(dead, boot, host) is False
    assert alive(me, boot, other_host) is None and alive(dead, boot, other_host) is None
    assert alive(me, other_boot, other_host) is None
    assert alive(me, other_boot, host) is False  # this host's earlier boot: its processes ended with it
    assert alive(me, boot, None) is True and alive(dead, boot, None) is False  # older names, this boot
    assert alive(me, other_boot, None) is None  # older name, another boot: maybe another node's


def test_clean_stale_removes_files_it_cannot_judge_only_by_age(tmp_path):
    """``min_age_s`` decides for another host's file; this host's files go by their owner alone, whatever age."""
    boot, host, dead = runfiles.boot_tag(), procs.host_tag(), _dead_pid()
    other_host = "a" * 12 if host != "a" * 12 else "b" * 12
    foreign = tmp_path / f"cpuckpt-x-p{dead}-b{boot}-h{other_host}-0123456789ab.alive"
    mine = tmp_path / f"cpuckpt-x-p{dead}-b{boot}-h{host}-0123456789ab.alive"
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


def test_megatron_channels_are_run_files_and_the_first_one_removes_stale_ones(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    from cpuckpt.integrations.megatron import worker

    shm = _shared_dir(tmp_path)
    monkeypatch.setattr(runfiles, "SHM_DIR", shm)
    monkeypatch.setattr(worker, "_cleaned_stale", False)
    stale, keep = _plant(shm)
    channel = worker.new_channel(0)
    assert channel.base.startswith(f"{shm}/cpuckpt-megatron-p{os.getpid()}-b{runfiles.boot_tag()}-h{procs.host_tag()}"
                                   "-r0-")
    assert not any(p.exists() for p in stale) and all(p.exists() for p in keep)
