"""The DeepSpeed tag listing (``cpuckpt.tier.tagmarker.complete_tags``), on hand-made tags: no DeepSpeed needed."""

from __future__ import annotations

import logging
from pathlib import Path

from cpuckpt.tier.tagmarker import TagFile, complete_tags, new_marker, write_marker

FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def _tag(root: Path, tag: str, step: int, nbytes: int = 100) -> Path:
    d = root / tag
    d.mkdir(parents=True)
    for name in FILES:
        (d / name).write_bytes(b"x" * nbytes)
    write_marker(d, new_marker(tag, 1, {n: TagFile(0, nbytes, 0) for n in FILES}, step), fsync=False)
    return d


def test_a_torn_tag_that_latest_names_is_skipped_with_a_warning(tmp_path, caplog):
    """A file of the tag ``latest`` names is truncated: the listing falls back to the newest complete tag and says
    why (it was silent; find_latest warned), calling it committed, not torn (scan_tags gives it to a restart)."""
    _tag(tmp_path, "global_step1", 1)
    torn = _tag(tmp_path, "global_step2", 2)
    (torn / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    (tmp_path / "latest").write_text("global_step2")
    with caplog.at_level(logging.WARNING, logger="cpuckpt.tier.tagmarker"):
        assert [t.tag for t in complete_tags(tmp_path)] == ["global_step1"]
    assert f"{torn}: committed, but incomplete now (" in caplog.text and "10 bytes on disk" in caplog.text


def test_the_stock_tag_latest_names_comes_first(tmp_path):
    """A tag stock DeepSpeed wrote (no marker) counts when ``latest`` names it, first and with no marker."""
    _tag(tmp_path, "global_step1", 1)
    (tmp_path / "global_step9").mkdir()
    (tmp_path / "global_step9" / "mp_rank_00_model_states.pt").write_bytes(b"y" * 50)
    (tmp_path / "latest").write_text("global_step9")
    tags = complete_tags(tmp_path)
    assert [(t.tag, t.marker is None) for t in tags] == [("global_step9", True), ("global_step1", False)]
    (tmp_path / "latest").write_text("global_step1")  # not named: not a candidate (nothing says it is complete)
    assert [t.tag for t in complete_tags(tmp_path)] == ["global_step1"]


def test_a_tag_of_ours_saved_again_by_stock_deepspeed_is_stock_not_torn(tmp_path):
    """Every file rewritten after our marker, sizes changed: stock DeepSpeed saved the tag again (its marker is
    stale), so it is listed as stock's when ``latest`` names it; the same sizes (a copy) keep the marker's word."""
    import os
    import time

    d = _tag(tmp_path, "global_step1", 1)
    (tmp_path / "latest").write_text("global_step1")
    marker_ns = (d / ".cpuckpt-complete.json").stat().st_mtime_ns
    for name in FILES:
        (d / name).write_bytes(b"z" * 70)
        os.utime(d / name, ns=(time.time_ns(), marker_ns + 1_000_000))
    assert [(t.tag, t.marker is None) for t in complete_tags(tmp_path)] == [("global_step1", True)]
    for name in FILES:
        (d / name).write_bytes(b"z" * 100)  # the marker's sizes: a copy, not a rewrite
        os.utime(d / name, ns=(time.time_ns(), marker_ns + 1_000_000))
    assert [(t.tag, t.marker is None) for t in complete_tags(tmp_path)] == [("global_step1", False)]


def test_a_tag_of_ours_with_a_file_missing_stays_torn_however_new_the_rest(tmp_path):
    """An interrupted copy (the marker first, one file short, one missing): newer files and wrong sizes, but a
    file missing is no re-save (a save writes them all): torn, never loaded unverified as stock's."""
    import os
    import time

    more = (*FILES, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    d = tmp_path / "global_step2"
    d.mkdir()
    for name in more:
        (d / name).write_bytes(b"x" * 100)
    write_marker(d, new_marker("global_step2", 2, {n: TagFile(0, 100, 0) for n in more}, 2), fsync=False)
    _tag(tmp_path, "global_step1", 1)
    (tmp_path / "latest").write_text("global_step2")
    marker_ns = (d / ".cpuckpt-complete.json").stat().st_mtime_ns
    (d / more[0]).write_bytes(b"x" * 37)
    os.utime(d / more[0], ns=(time.time_ns(), marker_ns + 1_000_000))
    os.utime(d / more[1], ns=(time.time_ns(), marker_ns + 1_000_000))
    (d / more[2]).unlink()
    assert [(t.tag, t.marker is None) for t in complete_tags(tmp_path)] == [("global_step1", False)]


def test_a_copy_interrupted_inside_its_last_file_stays_torn(tmp_path):
    """Every file there and newer than the marker, the last one short: a copy stopped midway (its finished files
    keep the marker's sizes), not a re-save: torn, never loaded unverified as stock's."""
    import os
    import time

    d = _tag(tmp_path, "global_step2", 2)
    _tag(tmp_path, "global_step1", 1)
    (tmp_path / "latest").write_text("global_step2")
    marker_ns = (d / ".cpuckpt-complete.json").stat().st_mtime_ns
    (d / FILES[1]).write_bytes(b"x" * 37)
    for name in FILES:
        os.utime(d / name, ns=(time.time_ns(), marker_ns + 1_000_000))
    assert [t.tag for t in complete_tags(tmp_path)] == ["global_step1"]


def test_a_garbled_marker_is_a_damaged_tag_and_an_unreadable_one_is_raised(tmp_path):
    """A marker with undecodable bytes makes its tag torn and committed once (its marker is written last): the
    listing restarts use goes on to the older complete tag (the UnicodeDecodeError raised out of it). A marker that
    cannot be read (here a directory in its place) is raised, not skipped: an older tag would not fix it."""
    import pytest

    from cpuckpt.tier.tagmarker import MARKER_NAME, check_dir

    _tag(tmp_path, "global_step1", 1)
    bad = _tag(tmp_path, "global_step2", 2)
    (bad / MARKER_NAME).write_bytes(b'{"tag": \xff\xfe')
    status = check_dir(bad)
    assert status.state == "torn" and status.committed and "not a valid" in status.problems[0], status
    assert [t.tag for t in complete_tags(tmp_path)] == ["global_step1"]
    (bad / MARKER_NAME).unlink()
    (bad / MARKER_NAME).mkdir()
    with pytest.raises(OSError):
        check_dir(bad)
    with pytest.raises(OSError):
        complete_tags(tmp_path)


# ------------------------------------------------------------------------- clean_torn_tags (cpuckpt clean)
def _backdate(path: Path, seconds: float) -> None:
    """Every mtime under ``path`` (and its own) ``seconds`` ago."""
    import os
    import time

    t = time.time() - seconds
    for p in [*path.rglob("*"), path]:
        os.utime(p, (t, t), follow_symlinks=False)


def _torn(root: Path, tag: str, *, ago: float = 4000) -> Path:
    """A tag cpuckpt's engine began and never committed, last changed ``ago`` seconds ago."""
    from cpuckpt.tier.tagmarker import open_tag

    d = root / tag
    open_tag(d, fsync=False)
    (d / FILES[0]).write_bytes(b"t" * 100)
    _backdate(d, ago)
    return d


def _committed(root: Path, tag: str, step: int, *, ago: float = 10, **marker) -> Path:
    """A committed tag, its marker's ``created_unix`` and every mtime ``ago`` seconds ago (``marker``: fields)."""
    import dataclasses
    import time

    d = _tag(root, tag, step)
    m = dataclasses.replace(new_marker(tag, 1, {n: TagFile(0, 100, 0) for n in FILES}, step),
                            created_unix=time.time() - ago, **marker)
    write_marker(d, m, fsync=False)
    _backdate(d, ago)
    return d


def _removing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".cpuckpt-removing-"))


def _hook_after_judging(monkeypatch, action) -> None:
    """Run ``action(tag_dir)`` right after a torn tag was judged removable, before its removal."""
    from cpuckpt.tier import tagmarker as tm

    judge = tm._kept_because

    def judged(tag_dir, *args):
        out = judge(tag_dir, *args)
        if out[0] is None:
            action(tag_dir)
        return out

    monkeypatch.setattr(tm, "_kept_because", judged)


def test_a_save_reopening_a_tag_while_it_is_removed_keeps_it_and_its_files(tmp_path, monkeypatch):
    """Between the judgement and the removal, a save opens the dead tag's name again (``open_tag``) and writes a
    file: the tag stays, with the new file, and nothing is left aside. It was unlinked in place: the new file went,
    then the removal failed, and the engine later committed a marker over the missing files."""
    from cpuckpt.tier.tagmarker import SAVING_NAME, clean_torn_tags, open_tag

    root = tmp_path / "save_dir"
    dead = _torn(root, "global_step10")
    _committed(root, "global_step20", 20)

    def save_again(tag_dir: Path) -> None:
        open_tag(tag_dir, fsync=False)
        (tag_dir / FILES[1]).write_bytes(b"n" * 100)

    _hook_after_judging(monkeypatch, save_again)
    assert clean_torn_tags(root) == []
    assert (dead / FILES[1]).read_bytes() == b"n" * 100 and (dead / FILES[0]).exists()
    assert (dead / SAVING_NAME).exists() and _removing(root) == []


def test_reopening_a_torn_tag_is_a_change_the_cleaner_sees(tmp_path, monkeypatch):
    """``open_tag`` alone on a dead torn tag (its saving file already there) dates it now: the removal's check
    finds it changed and puts it back (``open_tag`` changed no time: mkdir exist_ok, O_CREAT on an existing file)."""
    from cpuckpt.tier.tagmarker import clean_torn_tags, open_tag

    root = tmp_path / "save_dir"
    dead = _torn(root, "global_step10")
    _committed(root, "global_step20", 20)
    _hook_after_judging(monkeypatch, lambda tag_dir: open_tag(tag_dir, fsync=False))
    assert clean_torn_tags(root) == []
    assert dead.is_dir() and _removing(root) == []


def test_a_save_opening_the_name_after_the_move_makes_a_new_tag(tmp_path, monkeypatch, caplog):
    """Once the dead tag is moved aside, a save opening its name makes a new directory: the dead one is deleted,
    the new one and its file stay. When the moved tag changed too (a rank of that save still writing into it) and its
    name is taken, it is kept aside with a WARNING naming both, and no later clean deletes it (a file of the save
    may be only there: deleting it lost the save's data)."""
    import os

    from cpuckpt.procs import host_tag
    from cpuckpt.tier import tagmarker as tm

    root = tmp_path / "save_dir"
    _torn(root, "global_step10")
    _committed(root, "global_step20", 20)
    claimed = tm._claimed
    touch_moved: list[bool] = []

    def after_move(path: Path):  # the first look at the moved tag: right after the rename
        if path.name.startswith(tm.REMOVING_PREFIX) and not (root / "global_step10").exists():
            tm.open_tag(root / "global_step10", fsync=False)
            (root / "global_step10" / FILES[1]).write_bytes(b"n" * 100)
            if touch_moved:
                (path / FILES[0]).write_bytes(b"m" * 100)
        return claimed(path)

    monkeypatch.setattr(tm, "_claimed", after_move)
    assert tm.clean_torn_tags(root) == [root / "global_step10"]
    assert sorted(p.name for p in (root / "global_step10").iterdir()) == sorted([FILES[1], tm.SAVING_NAME])
    assert _removing(root) == []

    import shutil

    shutil.rmtree(root / "global_step10")
    _torn(root, "global_step10")
    touch_moved.append(True)
    with caplog.at_level(logging.WARNING, logger="cpuckpt.tier.tagmarker"):
        assert tm.clean_torn_tags(root) == []
    moved = root / _removing(root)[0]
    from cpuckpt.runfiles import boot_tag

    ns = format(os.stat("/proc/self/ns/pid").st_ino, "x")
    # its cleaner's host, boot, pid namespace and pid, the pid last: an older cpuckpt reads it after the last dash
    assert moved.name == f"{tm.REMOVING_PREFIX}global_step10-h{host_tag()}-b{boot_tag()}-n{ns}-{os.getpid()}"
    assert moved.name.rpartition("-")[2] == str(os.getpid())
    assert (moved / FILES[0]).read_bytes() == b"m" * 100 and (root / "global_step10" / FILES[1]).exists()
    assert f"not removing torn DeepSpeed tag {root / 'global_step10'}:" in caplog.text
    assert f"it is kept as {moved}, never deleted by a clean" in caplog.text
    monkeypatch.setattr(tm, "_claimed", claimed)
    assert tm.clean_torn_tags(root, min_age_s=60) == []  # changed just now
    _backdate(moved, 120)
    assert tm.clean_torn_tags(root, min_age_s=60) == [] and (moved / FILES[0]).read_bytes() == b"m" * 100
    assert (root / "global_step10" / FILES[1]).exists()  # newer than every commit: its save may be live


def test_a_tag_moved_aside_is_never_listed_and_a_later_clean_deletes_it(tmp_path):
    """``.cpuckpt-removing-<tag>-<pid>`` (an older cpuckpt's name, no host; a cleaner killed while deleting) is no
    tag: the restart's listing,
    find_latest, ``ls`` and the DCP root listing skip it, even holding a marker of its own name; a later clean
    deletes it once untouched for ``min_age_s`` and its cleaner's pid is gone (one whose pid runs stays)."""
    import os

    from cpuckpt import roots
    from cpuckpt.tier.tagmarker import clean_torn_tags, find_latest, scan_tags
    from cpuckpt.tools.catalog import scan_root

    root = tmp_path / "save_dir"
    _committed(root, "global_step20", 20)
    dead = _committed(root, ".cpuckpt-removing-global_step30-999999999", 30, ago=4000)
    (dead / FILES[1]).write_bytes(b"x")  # damaged, mid-delete
    (dead / "__0_0.distcp").write_bytes(b"d")
    _backdate(dead, 4000)
    live = _committed(root, f".cpuckpt-removing-global_step40-{os.getppid()}", 40, ago=4000)
    tags, damaged = scan_tags(root)
    assert [t.tag for t in tags] == ["global_step20"] and damaged == []
    assert find_latest(root).tag == "global_step20"
    assert [i.path.name for i in scan_root(root)] == ["global_step20"]
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".cpuckpt-removing-step_5-999999999").mkdir()
    (dcp / ".cpuckpt-removing-step_5-999999999" / "__0_0.distcp").write_bytes(b"d")
    _backdate(dcp, 4000)
    assert roots.list_checkpoints(dcp) == [] and roots.clean_incomplete(dcp, min_age_s=60) == []
    assert clean_torn_tags(root, min_age_s=8000, dry_run=True) == []
    assert clean_torn_tags(root, min_age_s=60, dry_run=True) == [dead] and dead.is_dir()
    assert clean_torn_tags(root, min_age_s=60) == [dead]
    assert not dead.exists() and live.is_dir()


def test_a_tag_another_hosts_cleaner_moved_aside_goes_by_its_age_alone(tmp_path, caplog):
    """``.cpuckpt-removing-<tag>-<pid>-h<host>`` (the previous version's name): the cleaner's pid is asked about
    only on its own host. Another host's (a save_dir on a shared file system) goes once untouched for ``min_age_s``,
    even where a process of this host has its pid (it was kept while that unrelated process ran); this host's stays
    while its pid runs."""
    import os

    from cpuckpt.procs import host_tag
    from cpuckpt.tier.tagmarker import clean_torn_tags

    root = tmp_path / "save_dir"
    alive = os.getppid()  # runs here, and is not this cleaner
    here = host_tag()
    there = format(int(here, 16) ^ 1, "012x")
    foreign = _torn(root, f".cpuckpt-removing-global_step10-{alive}-h{there}")
    local = _torn(root, f".cpuckpt-removing-global_step20-{alive}-h{here}")
    with caplog.at_level(logging.INFO, logger="cpuckpt.tier.tagmarker"):
        assert clean_torn_tags(root, min_age_s=8000) == []  # younger than min_age_s
        assert f"not deleting {foreign} (a torn DeepSpeed tag moved aside to be deleted): modified 4000 s ago" \
            in caplog.text
        caplog.clear()
        assert clean_torn_tags(root, min_age_s=60) == [foreign]
    assert not foreign.exists() and local.is_dir()
    assert (f"not deleting {local} (a torn DeepSpeed tag moved aside to be deleted): its cleaner (pid {alive}) may "
            "still run") in caplog.text


def test_a_leftovers_cleaner_pid_is_asked_about_only_on_its_own_host_boot_and_pid_namespace(tmp_path, caplog):
    """``.cpuckpt-removing-<tag>-h<host>-b<boot>-n<pidns>-<pid>``: a pid recorded on another boot (a reboot since:
    that pid is another process now) or in another pid namespace (another container of the node) says nothing here;
    such a leftover goes once untouched for ``min_age_s``, even where a process here has that pid. One of this host,
    boot and namespace stays while its pid runs, and so do the names of the versions before (``<tag>-<pid>-h<host>``
    of this host, ``<tag>-<pid>``)."""
    import os

    from cpuckpt.procs import host_tag
    from cpuckpt.runfiles import boot_tag
    from cpuckpt.tier.tagmarker import clean_torn_tags

    def other(tag: str) -> str:
        return format(int(tag, 16) ^ 1, f"0{len(tag)}x")

    root = tmp_path / "save_dir"
    alive = os.getppid()  # runs here, and is not this cleaner
    host, boot, ns = host_tag(), boot_tag(), format(os.stat("/proc/self/ns/pid").st_ino, "x")
    rebooted = _torn(root, f".cpuckpt-removing-global_step10-h{host}-b{other(boot)}-n{ns}-{alive}")
    elsewhere = _torn(root, f".cpuckpt-removing-global_step20-h{host}-b{boot}-n{other(ns)}-{alive}")
    foreign = _torn(root, f".cpuckpt-removing-global_step30-h{other(host)}-b{boot}-n{ns}-{alive}")
    kept = [_torn(root, f".cpuckpt-removing-global_step40-h{host}-b{boot}-n{ns}-{alive}"),
            _torn(root, f".cpuckpt-removing-global_step50-h{host}-b{boot}-{alive}"),  # no namespace readable
            _torn(root, f".cpuckpt-removing-global_step60-{alive}-h{host}"),
            _torn(root, f".cpuckpt-removing-global_step70-{alive}")]
    assert clean_torn_tags(root, min_age_s=8000) == []  # younger than min_age_s
    with caplog.at_level(logging.INFO, logger="cpuckpt.tier.tagmarker"):
        assert clean_torn_tags(root, min_age_s=60) == [rebooted, elsewhere, foreign]
    assert not any(p.exists() for p in (rebooted, elsewhere, foreign)) and all(p.is_dir() for p in kept)
    for p in kept:
        assert f"not deleting {p} (a torn DeepSpeed tag moved aside to be deleted): its cleaner (pid {alive}) may " \
               "still run" in caplog.text


def test_a_tag_a_writer_persists_stays_and_a_save_of_the_engine_empties_its_saving_file(tmp_path):
    """A writer's persist names its save in ``.cpuckpt-saving``: such a tag stays however old (a persist stalled
    past --min-age, its part not written yet). ``open_tag`` empties the file, so the engine's own save of the tag
    is judged as any."""
    from cpuckpt.tier.tagmarker import SAVING_NAME, clean_torn_tags, open_tag

    root = tmp_path / "save_dir"
    persisted = _torn(root, "global_step10")
    (persisted / SAVING_NAME).write_text("job-0001\n")
    _backdate(persisted, 4000)
    _committed(root, "global_step20", 20)
    assert clean_torn_tags(root) == [] and persisted.is_dir()
    open_tag(persisted, fsync=False)
    assert (persisted / SAVING_NAME).stat().st_size == 0
    _backdate(persisted, 4000)
    assert clean_torn_tags(root) == [persisted]


def test_a_commit_dated_by_another_clock_needs_60_s(tmp_path):
    """A later marker's ``created_unix`` (the committing node's clock) must be 60 s past the torn tag's last
    change, its file's mtime 1 s: 30 s after it by that clock orders nothing, whatever its file says."""
    import os
    import time

    from cpuckpt.tier.tagmarker import MARKER_NAME, clean_torn_tags

    root = tmp_path / "save_dir"
    torn = _torn(root, "global_step10", ago=4000)
    later = _committed(root, "global_step20", 20, ago=3970)
    os.utime(later / MARKER_NAME, (time.time() - 100, time.time() - 100))
    assert clean_torn_tags(root) == [] and torn.is_dir()
    _committed(root, "global_step30", 30, ago=3900)
    assert clean_torn_tags(root) == [torn]


def test_a_marker_whose_created_unix_is_no_time_dates_nothing(tmp_path):
    """``created_unix`` a string, NaN, infinite, or far after its own file: no evidence of when the commit was;
    nothing is removed, nothing raised."""
    import json

    from cpuckpt.tier.tagmarker import MARKER_NAME, clean_torn_tags

    root = tmp_path / "save_dir"
    torn = _torn(root, "global_step10")
    later = _committed(root, "global_step20", 20)
    text = (later / MARKER_NAME).read_text()
    for bad in ('"soon"', "NaN", "Infinity", "1e300", str(json.loads(text)["created_unix"] + 1e6)):
        data = text.replace(f'"created_unix":{json.loads(text)["created_unix"]!r}', f'"created_unix":{bad}')
        assert data != text
        (later / MARKER_NAME).write_text(data)
        _backdate(later, 10)
        assert clean_torn_tags(root) == [], bad
    assert torn.is_dir()
