"""Single-process faults: failing writes, corrupted/truncated/missing files, hostile metadata.

Errors are checked through ``cpuckpt.save``/``cpuckpt.load``, which unwrap DCP's
``CheckpointException`` (a BaseException) into cpuckpt's own errors.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import cpuckpt
from cpuckpt import CheckpointCorrupt, CpuckptError, IntegrityError, StorageIOError
from cpuckpt.backend.committed import is_complete, read_manifest
from cpuckpt.testing import faults

faults.install()  # io.backend "fault:<errno>@<bytes>"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CHUNK = 64 * 1024
CFG = {"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered"}, "timeout_s": 30}
DATA = "__0_0.distcp"


def _cfg(**over) -> dict:
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in CFG.items()}
    for dotted, value in over.items():
        section, key = dotted.split("__")
        cfg.setdefault(section, {})[key] = value
    return cfg


def _state_dict() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(256, 384, generator=g),  # 384 KiB: aligned, several chunks
        "b": torch.randn(384, generator=g),
        "h": torch.randn(33, 65, generator=g).to(torch.bfloat16),
        "i": torch.randint(-1000, 1000, (1000,), generator=g),
        "s": torch.tensor(2.5),
        "step": 17,
        "note": "hello",
    }


def _targets(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def _assert_same(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    sd = _state_dict()
    cpuckpt.save(sd, path, CFG)
    out = _targets(sd)
    cpuckpt.load(out, path, CFG)
    _assert_same(out, sd)
    return path, sd


@pytest.fixture
def ckpt(pristine, tmp_path) -> tuple[Path, dict]:
    """A private copy of the pristine checkpoint that a test may damage."""
    path, sd = pristine
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst, sd


def _io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("cpuckpt-")]


# ----------------------------------------------------------------------------------- failing writes


@pytest.mark.parametrize(("spec", "err"), [("fault:ENOSPC@200000", errno.ENOSPC), ("fault:EIO@0", errno.EIO),
                                           ("fault:EIO@100000", errno.EIO)])
def test_failing_pwrite_fails_save_and_leaves_no_metadata(tmp_path, spec, err):
    sd = _state_dict()
    path = tmp_path / "bad"
    with pytest.raises(StorageIOError) as ei:
        cpuckpt.save(sd, path, _cfg(io__backend=spec))
    e = ei.value
    assert e.errno == err
    assert str(path / DATA) in str(e), f"error does not name the file: {e}"
    assert e.path == str(path / DATA) and e.offset is not None
    assert not (path / ".metadata").exists()
    assert not (path / ".cpuckpt.json").exists()
    assert not is_complete(path)


def test_failed_save_over_existing_checkpoint_makes_it_incomplete(ckpt):
    path, sd = ckpt
    assert (path / ".metadata").exists()
    with pytest.raises(CpuckptError):
        cpuckpt.save(sd, path, _cfg(io__backend="fault:ENOSPC@65536"))
    assert not (path / ".metadata").exists(), "a half-overwritten checkpoint still looks complete"
    with pytest.raises(IntegrityError, match=r"\.metadata"):
        cpuckpt.load(_targets(sd), path, CFG)


def _all_slots_free(timeout: float = 5.0) -> bool:
    """The process pool's slots all come back (stragglers of a failed save release theirs)."""
    from cpuckpt.transfer.staging import get_pool

    pool = get_pool(CHUNK, 1, pin=False, pretouch=False)  # the existing pool (any pool is large enough)
    deadline = time.monotonic() + timeout
    while pool.free_slots != pool.nslots and time.monotonic() < deadline:
        time.sleep(0.01)
    return pool.free_slots == pool.nslots


def test_save_after_failed_save_succeeds(tmp_path):
    """The pool and threads recover: a healthy save right after failed ones works and loads."""
    sd = _state_dict()
    with pytest.raises(CpuckptError):
        cpuckpt.save(sd, tmp_path / "bad0", _cfg(io__backend="fault:EIO@70000"))
    threads_after_first = len(_io_threads())
    for k in range(1, 4):
        with pytest.raises(CpuckptError):
            cpuckpt.save(sd, tmp_path / f"bad{k}", _cfg(io__backend="fault:EIO@70000"))
    # worker threads are shared and reused: failed saves do not leave more of them behind
    assert len(_io_threads()) <= threads_after_first, _io_threads()
    assert _all_slots_free(), "a failed save leaked host pool slots"
    good = tmp_path / "good"
    cpuckpt.save(sd, good, CFG)
    assert (good / ".metadata").exists()
    out = _targets(sd)
    cpuckpt.load(out, good, CFG)
    _assert_same(out, sd)
    assert _all_slots_free()


def test_bigger_save_right_after_failed_save_succeeds(tmp_path):
    """Stragglers of a failed save must not make the next, larger save fail (pool regrowth)."""
    sd = _state_dict()
    big = dict(sd, extra=torch.randn(512, 1024))  # needs more pool slots than the failed save
    with pytest.raises(CpuckptError):
        cpuckpt.save(sd, tmp_path / "bad", _cfg(io__backend="fault:ENOSPC@0"))
    cpuckpt.save(big, tmp_path / "good", CFG)
    out = _targets(big)
    cpuckpt.load(out, tmp_path / "good", CFG)
    _assert_same(out, big)


def test_failed_save_through_dcp_wraps_our_error(tmp_path):
    sd = _state_dict()
    writer = cpuckpt.StorageWriter(tmp_path / "x", _cfg(io__backend="fault:ENOSPC@0"))
    with pytest.raises(CheckpointException) as ei:
        dcp.save(sd, storage_writer=writer)
    exc = next(iter(ei.value.failures.values()))
    exc = exc[0] if isinstance(exc, tuple) else exc
    assert isinstance(exc, StorageIOError) and exc.errno == errno.ENOSPC


# ------------------------------------------------------------------------------------- corruption


def _flip(path: Path, offset: int) -> int:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ 0xFF]))
    return old


def _restore(path: Path, offset: int, old: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([old]))


def test_every_single_byte_flip_is_detected(ckpt):
    path, sd = ckpt
    data = path / DATA
    size = data.stat().st_size
    assert size > 4 * CHUNK
    rng = random.Random(1234)
    offsets = sorted({0, size - 1, CHUNK - 1, CHUNK, *(rng.randrange(size) for _ in range(48))})
    assert len(offsets) >= 50
    misses = []
    for off in offsets:
        old = _flip(data, off)
        try:
            with pytest.raises(CheckpointCorrupt) as ei:
                cpuckpt.load(_targets(sd), path, CFG)
        except pytest.fail.Exception:
            misses.append(off)
            continue
        finally:
            _restore(data, off, old)
        msg = str(ei.value)
        assert str(data) in msg, msg
        m = re.search(r"\[(\d+), (\d+)\)", msg)
        assert m, f"no byte range in: {msg}"
        lo, hi = int(m.group(1)), int(m.group(2))
        assert lo <= off < hi, f"flip at {off} reported in [{lo}, {hi})"
    assert not misses, f"undetected flips at offsets {misses}"
    out = _targets(sd)
    cpuckpt.load(out, path, CFG)  # restored: loads again
    _assert_same(out, sd)


def test_flip_detected_through_dcp_load_as_wrapped_error(ckpt):
    path, sd = ckpt
    old = _flip(path / DATA, 1000)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(_targets(sd), storage_reader=cpuckpt.StorageReader(path, CFG))
    _restore(path / DATA, 1000, old)
    exc = next(iter(ei.value.failures.values()))
    exc = exc[0] if isinstance(exc, tuple) else exc
    assert isinstance(exc, CheckpointCorrupt)


def test_verify_off_skips_checksums(ckpt):
    path, sd = ckpt
    m = read_manifest(path)
    rec_off, data_rel = sorted(m.files[DATA].records)[0]
    _flip(path / DATA, rec_off + data_rel)  # first data byte of the first tensor
    out = _targets(sd)
    cpuckpt.load(out, path, _cfg(integrity__verify="off"))  # no check: loads the damaged byte
    assert sum(not torch.equal(out[k], v) for k, v in sd.items() if isinstance(v, torch.Tensor)) == 1
    with pytest.raises(CheckpointCorrupt):
        cpuckpt.load(_targets(sd), path, CFG)


@pytest.mark.parametrize("keep", [0, 1, 4096, CHUNK, "minus1"])
def test_truncated_data_file_is_detected(ckpt, keep):
    path, sd = ckpt
    data = path / DATA
    size = data.stat().st_size
    new = size - 1 if keep == "minus1" else keep
    os.truncate(data, new)
    for verify in ("always", "off"):
        with pytest.raises(CheckpointCorrupt) as ei:
            cpuckpt.load(_targets(sd), path, _cfg(integrity__verify=verify))
        assert str(data) in str(ei.value)
        assert str(new) in str(ei.value) and str(size) in str(ei.value)


def test_extended_data_file_is_detected(ckpt):
    path, sd = ckpt
    with open(path / DATA, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(CheckpointCorrupt, match=re.escape(str(path / DATA))):
        cpuckpt.load(_targets(sd), path, CFG)


def test_deleted_data_file_is_detected(ckpt):
    path, sd = ckpt
    (path / DATA).unlink()
    with pytest.raises(CheckpointCorrupt) as ei:
        cpuckpt.load(_targets(sd), path, CFG)
    assert str(path / DATA) in str(ei.value) and "missing" in str(ei.value)


def test_missing_metadata_is_incomplete(ckpt):
    path, sd = ckpt
    (path / ".metadata").unlink()
    with pytest.raises(IntegrityError) as ei:
        cpuckpt.load(_targets(sd), path, CFG)
    assert str(path) in str(ei.value)


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\x00" * 64, b"this is not a pickle", pickle.dumps({"not": "metadata"}), pickle.dumps([1, 2, 3])[:-3]],
    ids=["empty", "zeros", "text", "wrong-object", "truncated"],
)
def test_garbage_metadata_is_refused(ckpt, garbage):
    path, sd = ckpt
    (path / ".metadata").write_bytes(garbage)
    with pytest.raises(IntegrityError) as ei:
        cpuckpt.load(_targets(sd), path, CFG)
    assert str(path / ".metadata") in str(ei.value)


class _Evil:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class _EvilEval:
    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (eval, (self.code,))


def _hostile_metadata(path: Path, payload) -> bytes:
    """The real metadata with a hostile object planted inside it (so the outer structure is valid)."""
    md = pickle.loads((path / ".metadata").read_bytes())
    md.planner_data = payload
    return pickle.dumps(md)


@pytest.mark.parametrize("kind", ["bare-system", "bare-eval", "planted-system", "planted-eval"])
def test_malicious_metadata_is_refused_and_nothing_runs(ckpt, tmp_path, kind):
    path, sd = ckpt
    marker = tmp_path / "pwned"
    system, ev = _Evil(f"touch {marker}"), _EvilEval(f"open({str(marker)!r}, 'w').close()")
    payload = {
        "bare-system": pickle.dumps(system),
        "bare-eval": pickle.dumps(ev),
        "planted-system": _hostile_metadata(path, system),
        "planted-eval": _hostile_metadata(path, ev),
    }[kind]
    (path / ".metadata").write_bytes(payload)
    with pytest.raises(IntegrityError) as ei:
        cpuckpt.load(_targets(sd), path, CFG)
    assert "not allowed" in str(ei.value) or "refused" in str(ei.value)
    assert not marker.exists(), "unpickling .metadata executed code"


def test_malicious_payload_control(tmp_path):
    """Control: the planted payload does execute under plain pickle, so the test above proves something."""
    marker = tmp_path / "control"
    pickle.loads(pickle.dumps(_EvilEval(f"open({str(marker)!r}, 'w').close()")))
    assert marker.exists()


def _write_metadata(path: Path, md: object) -> None:
    """A hostile ``.metadata`` as its writer would leave it: with the manifest's crc32c of it rewritten too (else
    that check refuses it first: these tests are about what is checked after it)."""
    import crc32c

    data = pickle.dumps(md)
    (path / ".metadata").write_bytes(data)
    faults.rewrite_manifest(path, lambda m: m.update(metadata_crc32c=crc32c.crc32c(data)))


@pytest.mark.parametrize("bad", ["../outside.distcp", "../ckpt/" + DATA, "/etc/passwd", "sub/../../x.distcp", ""])
def test_storage_data_path_escape_is_refused(ckpt, tmp_path, bad):
    path, sd = ckpt
    md = pickle.loads((path / ".metadata").read_bytes())
    # a file that would be read if the reader followed the path
    shutil.copy(path / DATA, tmp_path / "outside.distcp")
    for k, sinfo in md.storage_data.items():
        md.storage_data[k] = type(sinfo)(bad, sinfo.offset, sinfo.length)
    _write_metadata(path, md)
    with pytest.raises(CheckpointCorrupt) as ei:
        cpuckpt.load(_targets(sd), path, CFG)
    assert repr(bad) in str(ei.value) or bad in str(ei.value)


def test_storage_entry_missing_from_metadata(ckpt):
    path, sd = ckpt
    md = pickle.loads((path / ".metadata").read_bytes())
    key = next(k for k in md.storage_data if k.fqn == "w")
    del md.storage_data[key]
    _write_metadata(path, md)
    with pytest.raises(CheckpointCorrupt, match=r"storage entry for .*'w'"):
        cpuckpt.load(_targets(sd), path, CFG)


def test_corrupt_manifest_is_refused(ckpt):
    path, sd = ckpt
    (path / ".cpuckpt.json").write_text("{ not json")
    with pytest.raises(IntegrityError, match=re.escape(str(path / ".cpuckpt.json"))):
        cpuckpt.load(_targets(sd), path, CFG)


def test_manifest_record_offsets_mismatch_is_detected(ckpt):
    """A writer that listed the wrong records (its own crc32c right)."""
    path, sd = ckpt
    faults.rewrite_manifest(path, lambda m: m["files"][DATA].update(records=m["files"][DATA]["records"][1:]))
    with pytest.raises(CheckpointCorrupt, match="no tensor record"):
        cpuckpt.load(_targets(sd), path, CFG)


@pytest.mark.parametrize("old,new", [('"records":[[0,', '"records":[[1,'),
                                     ('"chunk_checksums":[', '"chunk_checksumz":['),
                                     ('"checksum":"crc32c"', '"checksum":"none"'), ('"nbytes":', '"nbytes":1')])
def test_one_damaged_field_of_the_manifest_is_refused_not_loaded(ckpt, old, new):
    """The manifest had no checksum of its own: one byte of a record's offset loaded wrong values with nothing
    noticing (the chunk checksums cover the data files), and a damaged checksum field turned verification off."""
    from cpuckpt.backend.committed import check_complete

    path, sd = ckpt
    text = (path / ".cpuckpt.json").read_text()
    assert old in text
    (path / ".cpuckpt.json").write_text(text.replace(old, new, 1))
    with pytest.raises(IntegrityError, match="manifest damaged"):
        cpuckpt.load(_targets(sd), path, {**CFG, "integrity": {"verify": "always"}})
    c = check_complete(path)
    assert not c.complete and "manifest damaged" in c.reason
    assert cpuckpt.find_latest(path.parent) is None


def test_damaged_stock_record_is_reported_as_corrupt(tmp_path):
    """A stock checkpoint has no checksums, but a record whose zip structure is damaged must still
    surface as CheckpointCorrupt (not as a raw zipfile/NotImplementedError from the parser)."""
    from torch.distributed.checkpoint import FileSystemWriter

    sd = {"w": torch.randn(64, 64), "b": torch.randn(10)}
    path = tmp_path / "stock"
    dcp.save(sd, storage_writer=FileSystemWriter(str(path)))
    md = pickle.loads((path / ".metadata").read_bytes())
    sinfo = next(v for k, v in md.storage_data.items() if k.fqn == "b")
    data = path / sinfo.relative_path
    blob = bytearray(data.read_bytes())
    rec = blob[sinfo.offset : sinfo.offset + sinfo.length]
    for damage in ("compression", "signature"):
        damaged = bytearray(blob)
        if damage == "compression":  # central directory: compression method of the record's first entry
            cd = sinfo.offset + rec.find(b"PK\x01\x02")
            damaged[cd + 10] = 99
        else:  # local header signature of the record's first entry
            damaged[sinfo.offset : sinfo.offset + 4] = b"XXXX"
        data.write_bytes(damaged)
        with pytest.raises(CheckpointCorrupt) as ei:
            cpuckpt.load({"w": torch.zeros(64, 64), "b": torch.zeros(10)}, path)
        assert str(data) in str(ei.value) and str(sinfo.offset) in str(ei.value), damage
