"""DeepSpeed tags' completion markers, with real engines on 2 gloo ranks (CPU).

What is proven (real DeepSpeed ZeRO-2 engines, real files, real SIGKILLs; no mocks):

- a committed tag holds ``.cpuckpt-complete.json`` listing every rank's files (sizes, per-chunk
  crc32c), the world size, the tag and the global step, and no ``.cpuckpt-saving``;
- a save whose rank 1 is SIGKILLed just before its file's fsync (every byte written, not durable)
  leaves a tag with no marker although rank 0's files are durable: ``latest`` still names the
  previous tag, :func:`check_tag` calls the new one torn, :func:`find_latest` names the previous
  one, and both :func:`check_before_load` and ``engine.load_checkpoint(save_dir, tag=torn)`` raise
  ``IntegrityError`` on both ranks, while ``load_checkpoint(save_dir)`` restores the previous tag
  bit-exact; stock DeepSpeed (``TorchCheckpointEngine``) loads a marked tag unchanged;
- a flipped byte: sizes still match (no verify: accepted), ``verify=True`` raises ``CheckpointCorrupt``
  on both ranks although only rank 1 reads the damaged file;
- a failing re-save into a complete tag (rank 1's writes fail with ENOSPC) removes its marker before
  any byte changes: the tag is refused afterwards and :func:`find_latest` falls back to an older one.

Single process: the marker functions on plain directories (states, fallback, bad markers).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cpuckpt.testing import faults

pytest.importorskip("deepspeed")

faults.install()  # io.backend "fault:...": in the ranks too (they load this module by path)

_HERE = Path(__file__).resolve().parent


def _ds():
    """The helpers of test_deepspeed.py (engines, steps, state comparison), loaded by path."""
    import importlib.util
    import sys

    name = "_cpuckpt_test_deepspeed_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / "test_deepspeed.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


_IO = {"backend": "buffered", "chunk_bytes": 64 * 1024}


# ----------------------------------------------------------------------------------- rank side
def rank_torn_save(root: str) -> None:
    """t1 committed; then t2, whose rank 1 is SIGKILLed before its file's fsync. Never returns."""
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch
    import torch.distributed as dist

    ckpt_ds.install({"io": _IO})
    save_dir = Path(root) / "ckpt"
    engine = h._engine(2, seed=0)
    for k in range(3):
        h._step(engine, k)
    torch.save(h._state(engine), Path(root) / f"state_t1_rank{dist.get_rank()}.pt")
    engine.save_checkpoint(str(save_dir), tag="t1")
    ckpt_ds.commit_pending(engine)
    h._step(engine, 3)
    backend = "fault:KILL@fsync" if dist.get_rank() == 1 else "buffered"
    ckpt_ds.attach(engine, {"io": {**_IO, "backend": backend}, "timeout_s": 60})
    engine.save_checkpoint(str(save_dir), tag="t2")
    ckpt_ds.commit_pending(engine)  # rank 0 waits for rank 1 (DeepSpeed's barrier or the commit): it never comes
    raise AssertionError("the commit of t2 ended although rank 1 was killed before its fsync")


def _raised(fn) -> tuple[str | None, str]:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None, ""


def rank_after_crash(root: str) -> dict:
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch
    import torch.distributed as dist

    from cpuckpt.tier.tagmarker import MARKER_NAME, SAVING_NAME

    rank = dist.get_rank()
    out: dict = {}
    save_dir = Path(root) / "ckpt"
    # -- what the crash left: t1 complete, t2 torn (rank 0's files durable, rank 1's not fsynced)
    out["latest"] = (save_dir / "latest").read_text()
    out["t2_files"] = sorted(p.name for p in (save_dir / "t2").iterdir())
    out["t1_state"] = ckpt_ds.check_tag(save_dir, "t1").state
    t2 = ckpt_ds.check_tag(save_dir, "t2")
    out["t2_state"], out["t2_problems"] = t2.state, t2.problems
    found = ckpt_ds.find_latest(save_dir)
    out["find_latest"] = (found.tag, found.global_step)
    marker = ckpt_ds.check_tag(save_dir, "t1").marker
    out["marker"] = {"tag": marker.tag, "world_size": marker.world_size, "global_step": marker.global_step,
                     "files": {n: (f.rank, f.nbytes, f.checksum, len(f.chunk_checksums))
                               for n, f in marker.files.items()},
                     "sizes": {n: (save_dir / "t1" / n).stat().st_size for n in marker.files}}
    out["refused_helper"] = _raised(lambda: ckpt_ds.check_before_load(save_dir, "t2"))

    ckpt_ds.install({"io": _IO})
    engine = h._engine(2, seed=123)
    h._step(engine, 99)
    out["refused_load"] = _raised(lambda: engine.load_checkpoint(str(save_dir), tag="t2"))
    ckpt_ds.check_before_load(save_dir)  # latest = t1: complete and verified on both ranks
    path, _ = engine.load_checkpoint(str(save_dir))
    out["loaded"] = path
    saved = torch.load(Path(root) / f"state_t1_rank{rank}.pt", weights_only=False)
    h._assert_same(h._state(engine), saved, "t1 restored after the crash")

    # -- a flipped byte in rank 1's optimizer file of t1: same size, other crc32c
    victim = save_dir / "t1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    offset = victim.stat().st_size // 2
    dist.barrier()
    if rank == 0:
        with open(victim, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()
    out["flipped_no_verify"] = _raised(lambda: ckpt_ds.check_before_load(save_dir, "t1", verify=False))
    out["flipped_verify"] = _raised(lambda: ckpt_ds.check_before_load(save_dir, "t1", verify=True))
    out["flipped_check"] = ckpt_ds.check_tag(save_dir, "t1", verify=True).state
    dist.barrier()
    if rank == 0:
        with open(victim, "r+b") as f:
            f.seek(offset)
            f.write(byte)
    dist.barrier()

    # -- a complete tag m2 (re-saved below)
    h._step(engine, 100)
    engine.save_checkpoint(str(save_dir), tag="m2")
    ckpt_ds.commit_pending(engine)
    out["durable_tags"] = sorted(p.name for p in save_dir.iterdir() if p.is_dir())
    out["latest_m2"] = (save_dir / "latest").read_text()

    # -- a re-save into the complete tag m2 whose rank 1 cannot write: m2's marker goes first
    backend = "fault:ENOSPC@0" if rank == 1 else "buffered"
    ckpt_ds.attach(engine, {"io": {**_IO, "backend": backend}})
    engine.save_checkpoint(str(save_dir), tag="m2")
    out["resave"] = _raised(lambda: ckpt_ds.commit_pending(engine))
    out["m2_after"] = (ckpt_ds.check_tag(save_dir, "m2").state, (save_dir / "m2" / MARKER_NAME).exists(),
                       (save_dir / "m2" / SAVING_NAME).exists())
    out["m2_fallback"] = ckpt_ds.find_latest(save_dir).tag
    engine.destroy()

    # -- stock DeepSpeed's own engine loads a marked tag (the marker is never opened)
    ckpt_ds.uninstall()
    stock = h._engine(2, seed=7, cpuckpt={"enabled": False})
    out["stock_engine"] = type(stock.checkpoint_engine).__name__
    path, _ = stock.load_checkpoint(str(save_dir), tag="t1")
    out["stock_loaded"] = path
    h._assert_same(h._state(stock), saved, "t1 loaded by stock DeepSpeed")
    stock.destroy()
    return out


@pytest.mark.timeout(240)
def test_torn_tag_refused_and_fallback(run_ranks, tmp_path):
    with pytest.raises(AssertionError) as ei:  # conftest's RankError
        run_ranks(2, rank_torn_save, str(tmp_path), timeout_s=120, grace_s=2)
    res = ei.value.results
    assert res[1]["type"] == "RankDied", f"rank 1 was to be SIGKILLed before its fsync: {ei.value}"
    # rank 0 loses its peer in a collective (gloo error, or killed by the harness): it never commits t2
    assert "the commit of t2 ended" not in res[0]["message"], res[0]

    results = run_ranks(2, rank_after_crash, str(tmp_path), timeout_s=200)
    ckpt = tmp_path / "ckpt"
    for rank, r in enumerate(results):
        where = f"rank {rank}"
        assert r["latest"] == "t1", where
        assert ".cpuckpt-complete.json" not in r["t2_files"] and ".cpuckpt-saving" in r["t2_files"], r["t2_files"]
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in r["t2_files"], r["t2_files"]  # written, not fsynced
        assert (r["t1_state"], r["t2_state"]) == ("complete", "torn"), where
        assert "no completion marker" in r["t2_problems"][0], r["t2_problems"]
        assert r["find_latest"] == ("t1", 3), where
        m = r["marker"]
        assert (m["tag"], m["world_size"], m["global_step"]) == ("t1", 2, 3), m
        assert set(m["files"]) == {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                   "zero_pp_rank_1_mp_rank_00_optim_states.pt"}, m
        assert m["files"]["zero_pp_rank_1_mp_rank_00_optim_states.pt"][0] == 1
        for name, (_, nbytes, checksum, nchunks) in m["files"].items():
            assert nbytes == m["sizes"][name] and checksum == "crc32c" and nchunks == -(-nbytes // (64 * 1024)), name
        for key in ("refused_helper", "refused_load"):
            cls, msg = r[key]
            assert cls == "IntegrityError" and "t2" in msg and "torn" in msg and "find_latest" in msg, (key, r[key])
        assert r["loaded"] is not None
        assert r["flipped_no_verify"] == (None, ""), r["flipped_no_verify"]
        cls, msg = r["flipped_verify"]
        assert cls == "CheckpointCorrupt" and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in msg \
            and "checksum mismatch" in msg, r["flipped_verify"]
        assert r["flipped_check"] == "torn"
        assert r["durable_tags"] == ["m2", "t1", "t2"], r["durable_tags"]
        assert r["latest_m2"] == "m2"
        assert r["resave"][0] == "StorageIOError" and "m2" in r["resave"][1], r["resave"]
        assert r["m2_after"] == ("torn", False, True), r["m2_after"]
        assert r["m2_fallback"] == "t1"
        assert r["stock_engine"] == "TorchCheckpointEngine" and r["stock_loaded"] is not None
    assert results[0]["flipped_verify"] == results[1]["flipped_verify"]
    assert results[0]["refused_helper"] == results[1]["refused_helper"]
    assert not list(ckpt.glob("*/*.tmp")), "temporary marker files left behind"


def rank_clean_torn_tags(root: str) -> dict:
    """One rank: t1 committed; t2 whose write fails (its commit raises: torn, never to commit); t3 committed; t4
    saved and waiting for its commit (no step() yet). Cleaning (no --min-age) while t4 waits, then after its
    commit."""
    import time

    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds

    from cpuckpt.tier.tagmarker import clean_torn_tags

    save_dir = Path(root) / "ckpt"
    out: dict = {}
    ckpt_ds.install({"io": _IO})
    engine = h._engine(2, seed=0)
    h._step(engine, 0)
    engine.save_checkpoint(str(save_dir), tag="t1")
    h._step(engine, 1)  # commits t1
    ckpt_ds.attach(engine, {"io": {**_IO, "backend": "fault:ENOSPC@0"}})
    engine.save_checkpoint(str(save_dir), tag="t2")
    out["t2_commit"] = _raised(lambda: ckpt_ds.commit_pending(engine))[0]
    ckpt_ds.attach(engine, {"io": _IO})
    out["before_t3"] = [str(p) for p in clean_torn_tags(save_dir)]  # nothing committed after t2 yet
    past = time.time() - 120  # t2 last changed 2 min ago: commits since are past CLOCK_MARGIN_S
    for p in [*(save_dir / "t2").rglob("*"), save_dir / "t2"]:
        os.utime(p, (past, past))
    h._step(engine, 2)
    engine.save_checkpoint(str(save_dir), tag="t3")
    h._step(engine, 3)  # commits t3
    engine.save_checkpoint(str(save_dir), tag="t4")  # its commit waits for the next step()
    time.sleep(1.1)
    out["states"] = {t: ckpt_ds.check_tag(save_dir, t).state for t in ("t1", "t2", "t3", "t4")}
    out["removed"] = [str(p) for p in clean_torn_tags(save_dir)]
    out["after"] = {t: ckpt_ds.check_tag(save_dir, t).state for t in ("t1", "t2", "t3", "t4")}
    h._step(engine, 4)  # commits t4
    ckpt_ds.commit_pending(engine)
    out["t4_committed"] = ckpt_ds.check_tag(save_dir, "t4").state
    out["removed_after"] = [str(p) for p in clean_torn_tags(save_dir)]
    out["latest"] = (save_dir / "latest").read_text()
    engine.destroy()
    return out


@pytest.mark.timeout(240)
def test_clean_removes_a_dead_torn_tag_and_keeps_one_waiting_for_its_commit(run_ranks, tmp_path):
    """A real engine: a tag whose commit failed goes once a later tag committed; the tag saved since, waiting for
    its commit until the next step() (no --min-age), stays, and commits afterwards."""
    (r,) = run_ranks(1, rank_clean_torn_tags, str(tmp_path), timeout_s=200)
    ckpt = tmp_path / "ckpt"
    assert r["t2_commit"] == "StorageIOError", r
    assert r["before_t3"] == [], r
    assert r["states"] == {"t1": "complete", "t2": "torn", "t3": "complete", "t4": "torn"}, r
    assert r["removed"] == [str(ckpt / "t2")], r
    assert r["after"] == {"t1": "complete", "t2": "missing", "t3": "complete", "t4": "torn"}, r
    assert r["t4_committed"] == "complete" and r["removed_after"] == [] and r["latest"] == "t4", r


# ------------------------------------------------------------------------- single process, no ranks
def _tag(root: Path, tag: str, files: dict[str, bytes], step: int | None, *, rank_of=lambda n: 0) -> None:
    import crc32c

    from cpuckpt.tier.tagmarker import TagFile, new_marker, open_tag, write_marker

    d = root / tag
    open_tag(d, fsync=False)
    listed = {}
    for name, data in files.items():
        (d / name).write_bytes(data)
        listed[name] = TagFile(rank=rank_of(name), nbytes=len(data), chunk_bytes=8, checksum="crc32c",
                               chunk_checksums=tuple(crc32c.crc32c(data[i : i + 8]) for i in range(0, len(data), 8)))
    write_marker(d, new_marker(tag, 2, listed, step), fsync=False)


def test_marker_states_and_fallback(tmp_path):
    import cpuckpt.integrations.deepspeed as ckpt_ds

    from cpuckpt.errors import CheckpointCorrupt, IntegrityError
    from cpuckpt.tier.tagmarker import MARKER_NAME, SAVING_NAME, open_tag

    root = tmp_path / "ckpt"
    _tag(root, "a", {"x.pt": b"0123456789abcdef0"}, 10)
    _tag(root, "b", {"x.pt": b"fedcba9876543210"}, 20)
    (root / "latest").write_text("b")
    assert not (root / "b" / SAVING_NAME).exists()
    assert ckpt_ds.check_tag(root, "b", verify=True).complete
    assert ckpt_ds.find_latest(root).tag == "b"
    # a new save into b: the marker goes before any byte changes; b is torn, latest falls back to a
    open_tag(root / "b", fsync=True)
    assert not (root / "b" / MARKER_NAME).exists()
    assert ckpt_ds.check_tag(root, "b").state == "torn"
    assert (ckpt_ds.find_latest(root).tag, ckpt_ds.find_latest(root).global_step) == ("a", 10)
    with pytest.raises(IntegrityError, match=r"b: torn \(no completion marker"):
        ckpt_ds.require_complete(root)
    # a truncated file, a flipped byte, a stock tag, a missing tag, a bad marker
    _tag(root, "c", {"x.pt": b"0" * 20, "y.pt": b"1" * 9}, 30)
    (root / "c" / "y.pt").write_bytes(b"1" * 8)
    status = ckpt_ds.check_tag(root, "c")
    assert status.state == "torn" and "8 bytes on disk, the manifest says 9" in status.problems[0]
    (root / "c" / "y.pt").write_bytes(b"1" * 8 + b"2")
    assert ckpt_ds.check_tag(root, "c").complete
    with pytest.raises(CheckpointCorrupt, match=r"y\.pt: checksum mismatch in chunk 1 \(bytes \[8, 9\)\)"):
        ckpt_ds.require_complete(root, "c", verify=True)
    (root / "stock").mkdir()
    (root / "stock" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert ckpt_ds.check_tag(root, "stock").state == "unmarked"
    assert ckpt_ds.require_complete(root, "stock", allow_unmarked=True) is None
    with pytest.raises(IntegrityError, match="not written by cpuckpt"):
        ckpt_ds.require_complete(root, "stock")
    assert ckpt_ds.check_tag(root, "nope").state == "missing"
    (root / "a" / MARKER_NAME).write_text('{"format": "cpuckpt-deepspeed-tag", "format_version": 99, "files": {}}')
    status = ckpt_ds.check_tag(root, "a")
    assert status.state == "torn" and "newer than this cpuckpt reads" in status.problems[0]
    _tag(root, "d", {"x.pt": b"d"}, 31)
    assert sorted(os.listdir(root / "d")) == sorted(["x.pt", MARKER_NAME])  # the saving file went with the marker


def test_select_tag_falls_back_past_a_tag_that_fails_its_crc32c(tmp_path, caplog):
    import logging

    import cpuckpt.integrations.deepspeed as ckpt_ds

    from cpuckpt.errors import CheckpointCorrupt, ConfigError

    root = tmp_path / "ckpt"
    assert ckpt_ds.select_tag(root) is None and ckpt_ds.load_latest(object(), root) == (None, None)
    for tag, step in (("a", 10), ("b", 20), ("c", 30)):
        _tag(root, tag, {"x.pt": bytes(range(step, step + 20))}, step)
    (root / "latest").write_text("c")
    data = bytearray((root / "c" / "x.pt").read_bytes())
    data[10] ^= 0xFF  # same size: check_tag and find_latest still call it complete
    (root / "c" / "x.pt").write_bytes(bytes(data))
    assert ckpt_ds.find_latest(root).tag == "c"
    with caplog.at_level(logging.WARNING):
        found = ckpt_ds.select_tag(root)
    assert (found.directory, found.tag, found.global_step) == (root, "b", 20)
    assert any("c does not verify" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        ckpt_ds.select_tag(root, fallback_on_corrupt=False)
    for tag in ("a", "b"):
        (root / tag / "x.pt").write_bytes(b"\0" * 20)
    with pytest.raises(CheckpointCorrupt, match=r"no DeepSpeed tag in .* loads"):
        ckpt_ds.select_tag(root)
    with pytest.raises(ConfigError, match="s3://"):
        ckpt_ds.select_tag("s3://bucket/ds")


def test_select_tag_names_a_committed_tag_damaged_since_and_never_starts_from_scratch(tmp_path, caplog):
    """A committed tag with a file truncated (or its marker garbled) after the commit was skipped as a torn save:
    an older tag loaded, or nothing, without a word. Passing over one newer than the tag loaded is a WARNING (a
    CheckpointCorrupt with ``fallback_on_corrupt=False``); one older is not; with nothing loadable it raises."""
    import logging

    import cpuckpt.integrations.deepspeed as ckpt_ds

    from cpuckpt.errors import CheckpointCorrupt
    from cpuckpt.tier.tagmarker import MARKER_NAME, open_tag

    root = tmp_path / "ckpt"
    for tag, step in (("a", 10), ("b", 20), ("c", 30)):
        _tag(root, tag, {"x.pt": bytes(range(step, step + 20))}, step)
    open_tag(root / "d", fsync=False)  # a save that never committed: torn, skipped without a word
    (root / "latest").write_text("c")
    os.truncate(root / "a" / "x.pt", 5)  # older than the tag loaded: not passed over
    os.truncate(root / "c" / "x.pt", 5)
    with caplog.at_level(logging.WARNING, logger="cpuckpt.integrations.deepspeed"):
        assert ckpt_ds.select_tag(root).tag == "b"
    warned = [r.getMessage() for r in caplog.records if r.name == "cpuckpt.integrations.deepspeed"]
    assert len(warned) == 1 and f"{root / 'c'}: committed, but incomplete now (" in warned[0], warned
    assert "5 bytes on disk, the manifest says 20" in warned[0], warned
    with pytest.raises(CheckpointCorrupt, match=r"c: committed, but incomplete now .*fallback_on_corrupt is off"):
        ckpt_ds.select_tag(root, fallback_on_corrupt=False)
    (root / "b" / MARKER_NAME).write_bytes(b'{"tag": \xff')  # garbled after its commit: no step to rank it by
    with pytest.raises(CheckpointCorrupt) as ei:
        ckpt_ds.select_tag(root)
    assert all(f"{root / t}: committed, but incomplete now" in str(ei.value) for t in "abc"), ei.value
    assert str(root / "d") not in str(ei.value) and "not starting from scratch" in str(ei.value)


def test_an_old_tag_whose_marker_is_garbled_never_blocks_loading_the_newest(tmp_path, caplog):
    """A garbled marker has no step: it counted as newer than every tag, so with ``fallback_on_corrupt=False`` every
    restart raised over an ancient tag (and with it on, warned of a fallback while loading the newest). Its name's
    step ranks it (DeepSpeed's ``global_step<N>``); a name without one is named in a warning, never raised over."""
    import logging

    import cpuckpt.integrations.deepspeed as ckpt_ds

    from cpuckpt.tier.tagmarker import MARKER_NAME

    root = tmp_path / "ckpt"
    for tag, step in (("global_step10", 10), ("custom", 20), ("global_step1000", 1000)):
        _tag(root, tag, {"x.pt": bytes(range(20))}, step)
    (root / "latest").write_text("global_step1000")
    (root / "global_step10" / MARKER_NAME).write_text('{"format": "cpuckpt-deepspeed-tag", "ta')
    with caplog.at_level(logging.WARNING, logger="cpuckpt.integrations.deepspeed"):
        assert ckpt_ds.select_tag(root, fallback_on_corrupt=False).tag == "global_step1000"
    assert not [r for r in caplog.records if r.name == "cpuckpt.integrations.deepspeed"]
    (root / "custom" / MARKER_NAME).write_text('{"format": "cpuckpt-deepspeed-tag", "ta')
    with caplog.at_level(logging.WARNING, logger="cpuckpt.integrations.deepspeed"):
        assert ckpt_ds.select_tag(root, fallback_on_corrupt=False).tag == "global_step1000"
    warned = [r.getMessage() for r in caplog.records if r.name == "cpuckpt.integrations.deepspeed"]
    assert len(warned) == 1 and "custom" in warned[0] and "no step tells" in warned[0], warned


def test_a_tag_saved_again_while_it_is_checked_is_no_damage(tmp_path, monkeypatch):
    """``check_dir`` reads the marker, then the files' sizes: a save of the same tag beginning in between (its
    marker removed, the saving file made, files rewritten) made a sound tag read as committed and damaged since."""
    import cpuckpt.tier.tagmarker as tm

    root = tmp_path / "ckpt"
    _tag(root, "global_step5", {"x.pt": bytes(range(20))}, 5)
    sizes = tm.size_mismatches

    def saved_again_first(tag_dir, entries):
        tm.open_tag(tag_dir, fsync=False)  # the next save of the tag begins
        os.truncate(tag_dir / "x.pt", 3)
        return sizes(tag_dir, entries)

    monkeypatch.setattr(tm, "size_mismatches", saved_again_first)
    status = tm.check_dir(root / "global_step5")
    assert status.state == "torn" and not status.committed, status


def test_latest_as_a_symlink_to_a_tag_names_that_tag(tmp_path):
    """``latest`` made a symlink to a tag directory (by hand, or a tool) raised IsADirectoryError out of every
    listing, a restart's included, and was itself listed as a damaged tag (its marker names another tag)."""
    import cpuckpt.integrations.deepspeed as ckpt_ds

    root = tmp_path / "ckpt"
    for tag, step in (("a", 10), ("b", 20)):
        _tag(root, tag, {"x.pt": bytes(range(step, step + 20))}, step)
    os.symlink(root / "a", root / "latest", target_is_directory=True)
    assert ckpt_ds.find_latest(root).tag == "a"  # what latest names first, as with DeepSpeed's file
    found = ckpt_ds.select_tag(root, fallback_on_corrupt=False)
    assert (found.tag, found.global_step) == ("a", 10)
    assert ckpt_ds.require_complete(root).tag == "a"


def test_a_saving_file_left_beside_a_marker_does_not_hide_damage(tmp_path):
    """A crash between the marker's rename and the saving file's removal leaves both: that tag is committed, and a
    file of it cut short later is damage (it was read as a save beginning again: skipped, or a fresh start)."""
    import cpuckpt.integrations.deepspeed as ckpt_ds

    from cpuckpt.errors import CheckpointCorrupt
    from cpuckpt.tier.tagmarker import SAVING_NAME, check_dir

    root = tmp_path / "ckpt"
    for tag, step in (("global_step1", 1), ("global_step2", 2)):
        _tag(root, tag, {"x.pt": bytes(range(20))}, step)
    (root / "latest").write_text("global_step2")
    (root / "global_step2" / SAVING_NAME).touch()
    os.truncate(root / "global_step2" / "x.pt", 5)
    status = check_dir(root / "global_step2")
    assert status.state == "torn" and status.committed, status
    with pytest.raises(CheckpointCorrupt, match="global_step2: committed, but incomplete now"):
        ckpt_ds.select_tag(root, fallback_on_corrupt=False)
