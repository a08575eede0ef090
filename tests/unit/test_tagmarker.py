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
