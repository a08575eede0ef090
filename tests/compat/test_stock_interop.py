"""Stock interoperability: our checkpoints load with stock DCP and torch.load, and stock ones with ours.

Also the manifest compatibility policy of cpuckpt/manifest.py: unknown fields ignored, missing later
fields defaulted, a too-new ``min_reader_version`` makes the reader fall back to stock reading.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import _helpers as H  # tests/dist is on sys.path (tests/conftest.py)
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

import cpuckpt
from cpuckpt.format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    manifest_from_json,
    signed_json,
)
from cpuckpt.testing import faults

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SMALL = {"io": {"chunk_bytes": "64KiB", "threads": 2}}

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
]


def _rand(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    return torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _state_dict() -> dict:
    sd: dict = {}
    for i, dt in enumerate(DTYPES):
        name = str(dt).replace("torch.", "")
        sd[f"t.{name}"] = _rand(dt, (3, 17), i)
        sd[f"scalar.{name}"] = _rand(dt, (), 100 + i)
        sd[f"empty.{name}"] = torch.empty((0, 4), dtype=dt)
    base = torch.arange(96, dtype=torch.float32).reshape(8, 12)
    sd["view.transpose"] = base.t()
    sd["view.slice"] = base[2:, ::3]
    sd["view.row"] = base[5]
    sd["view.offset"] = base.reshape(-1)[7:40]
    sd["view.expand"] = torch.arange(4.0).expand(3, 4)
    sd["big.f32"] = _rand(torch.float32, (300_000,), 7)  # 1.2 MB: many 64 KiB chunks, aligned data
    sd["big.bf16"] = _rand(torch.bfloat16, (513, 1031), 8)  # odd sizes crossing chunk boundaries
    sd["obj.int"] = 12345
    sd["obj.str"] = "hello, checkpoint"
    sd["obj.list"] = [1, 2.5, "three", None]
    sd["obj.tuple"] = (0.9, 0.99, {"lr": 0.1})
    sd["obj.bytes"] = b"\x00\x01raw"
    return sd


def _targets(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.contiguous()) if v.dtype != torch.bool else torch.ones_like(v.contiguous())
        else:
            out[k] = None
    return out


def _bytes_of(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        g = got[k]
        if isinstance(v, torch.Tensor):
            assert isinstance(g, torch.Tensor), k
            assert g.dtype == v.dtype and tuple(g.shape) == tuple(v.shape), k
            assert _bytes_of(g) == _bytes_of(v), f"{k} differs"
        else:
            assert g == v, k


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """One cpuckpt checkpoint (single rank, small chunks) shared by the read-only tests below."""
    path = tmp_path_factory.mktemp("ours") / "ckpt"
    sd = _state_dict()
    cpuckpt.save(sd, path, SMALL)
    return path, sd


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------- ours -> stock readers


def test_our_checkpoint_loads_with_stock_filesystem_reader(saved):
    path, sd = saved
    out = _targets(sd)
    dcp.load(out, storage_reader=FileSystemReader(str(path)))
    _assert_same(out, sd)


def test_our_checkpoint_layout_on_disk(saved):
    path, _ = saved
    names = sorted(p.name for p in path.iterdir())
    assert names == [".cpuckpt.json", ".metadata", "__0_0.distcp"]


def test_our_multi_file_checkpoint_loads_with_stock_reader(tmp_path):
    """Checkpoints with several data files per rank (cpuckpt's before io.files_per_rank was removed)
    still load, with the stock reader and with ours."""
    sd = _state_dict()
    with H.files_per_rank(3):
        cpuckpt.save(sd, tmp_path / "c", {"io": {"chunk_bytes": "64KiB"}})
    assert sorted(p.name for p in (tmp_path / "c").glob("*.distcp")) == [f"__0_{k}.distcp" for k in range(3)]
    out = _targets(sd)
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path / "c")))
    _assert_same(out, sd)
    out = _targets(sd)
    cpuckpt.load(out, tmp_path / "c")
    _assert_same(out, sd)


def _o_direct_ok(directory: Path) -> bool:
    import mmap
    import os

    if not hasattr(os, "O_DIRECT"):
        return False
    probe, buf = directory / "probe", mmap.mmap(-1, 4096)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, memoryview(buf), 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        buf.close()
        probe.unlink(missing_ok=True)


@pytest.mark.parametrize(
    "cfg",
    [
        {"io": {"backend": "direct", "chunk_bytes": "64KiB"}},
        {"io": {"backend": "buffered", "chunk_bytes": "4KiB", "threads": 1}},
        {"io": {"chunk_bytes": "64KiB"}, "integrity": {"checksum": "none"}},
        {"io": {"chunk_bytes": "64KiB", "fsync": False}, "layout": {"align_data_min_bytes": 0}},
        {"io": {"chunk_bytes": "128KiB"}, "layout": {"align_bytes": "64KiB"}},
    ],
    ids=["direct", "tiny-chunks", "no-checksum", "no-align", "big-align"],
)
def test_our_checkpoint_variants_load_with_stock_reader(tmp_path, cfg):
    if cfg["io"].get("backend") == "direct" and not _o_direct_ok(tmp_path):
        pytest.skip(f"O_DIRECT refused by the filesystem of {tmp_path}")
    sd = _state_dict()
    cpuckpt.save(sd, tmp_path / "c", cfg)
    out = _targets(sd)
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path / "c")))
    _assert_same(out, sd)
    out = _targets(sd)
    cpuckpt.load(out, tmp_path / "c", cfg)
    _assert_same(out, sd)


def test_our_checkpoint_loads_with_ourselves(saved):
    path, sd = saved
    for verify in ("always", "off"):
        out = _targets(sd)
        cpuckpt.load(out, path, {"integrity": {"verify": verify}})
        _assert_same(out, sd)


def _stock_metadata(path: Path) -> Metadata:
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)


def test_records_sliced_by_storage_data_load_with_torch_load(saved):
    path, sd = saved
    md = _stock_metadata(path)
    assert md.storage_data
    blobs: dict[str, bytes] = {}
    seen = set()
    for idx, sinfo in md.storage_data.items():
        assert type(sinfo) is _StorageInfo
        blob = blobs.setdefault(sinfo.relative_path, (path / sinfo.relative_path).read_bytes())
        record = blob[sinfo.offset : sinfo.offset + sinfo.length]
        assert len(record) == sinfo.length
        obj = torch.load(io.BytesIO(record), weights_only=True)
        want = sd[idx.fqn]
        if isinstance(want, torch.Tensor):
            assert isinstance(obj, torch.Tensor)
            assert obj.dtype == want.dtype and tuple(obj.shape) == tuple(want.shape)
            assert _bytes_of(obj) == _bytes_of(want), idx.fqn
        else:
            assert obj == want, idx.fqn
        seen.add(idx.fqn)
    assert seen == set(sd)


def test_metadata_unpickles_without_cpuckpt(saved, tmp_path):
    """In a fresh interpreter where importing cpuckpt is impossible, stock pickle reads .metadata."""
    path, _sd = saved
    script = textwrap.dedent(
        """
        import importlib.abc, pickle, sys

        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "cpuckpt" or name.startswith("cpuckpt."):
                    raise ImportError("cpuckpt is blocked in this interpreter")
                return None

        sys.meta_path.insert(0, Blocker())
        sys.modules["cpuckpt"] = None
        try:
            import cpuckpt  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("blocker failed: cpuckpt imported")
        with open(sys.argv[1], "rb") as f:
            md = pickle.load(f)
        from torch.distributed.checkpoint.metadata import Metadata
        assert type(md) is Metadata, type(md)
        leaked = sorted(m for m in sys.modules if m.split(".")[0] == "cpuckpt" and sys.modules[m] is not None)
        assert not leaked, leaked
        kinds = sorted({type(v).__module__ + "." + type(v).__qualname__ for v in md.storage_data.values()})
        print("OK", len(md.state_dict_metadata), kinds)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path / ".metadata")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK")
    assert "cpuckpt" not in proc.stdout
    assert "torch.distributed.checkpoint.filesystem._StorageInfo" in proc.stdout


def test_metadata_pickle_names_no_cpuckpt_globals(saved):
    """Stock DCP unpickles our ``.metadata`` without cpuckpt: no global of ours, and no string of ours but the
    writer's mark in ``StorageMeta.modules`` (a list DCP keeps and never reads)."""
    import pickletools

    from cpuckpt.format.manifest import WRITER_MARK

    data = (saved[0] / ".metadata").read_bytes()
    marks = 0
    for op, arg, _pos in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST") or (op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE") and arg):
            marks += arg == WRITER_MARK
            assert "cpuckpt" not in str(arg) or arg == WRITER_MARK, arg
    assert marks == 1


# --------------------------------------------------------------------------- stock writer -> ours


@pytest.mark.parametrize("thread_count", [1, 2])
def test_stock_checkpoint_loads_through_our_reader(tmp_path, thread_count):
    sd = _state_dict()
    path = tmp_path / f"stock{thread_count}"
    dcp.save(sd, storage_writer=FileSystemWriter(str(path), thread_count=thread_count))
    assert not (path / MANIFEST_NAME).exists()
    out = _targets(sd)
    reader = cpuckpt.StorageReader(path, SMALL)
    dcp.load(out, storage_reader=reader)
    assert reader.manifest is None  # read as a stock checkpoint
    _assert_same(out, sd)
    out = _targets(sd)
    cpuckpt.load(out, path)
    _assert_same(out, sd)


def test_stock_default_writer_checkpoint_loads_through_our_reader(tmp_path):
    sd = _state_dict()
    dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path / "s")))
    out = _targets(sd)
    cpuckpt.load(out, tmp_path / "s")
    _assert_same(out, sd)


def test_stock_file_per_tensor_checkpoint_loads_through_our_reader(tmp_path):
    sd = _state_dict()
    dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path / "s"), single_file_per_rank=False))
    out = _targets(sd)
    cpuckpt.load(out, tmp_path / "s")
    _assert_same(out, sd)


def test_a_damaged_stock_checkpoint_is_refused_and_load_latest_takes_the_one_before(tmp_path):
    """A stock checkpoint has no crc32c checksums, but each tensor record's data entry has its zip CRC-32: a flipped
    byte loaded silently (stock DCP's torch.load does not check it either) while `cpuckpt verify` and `ls --verify`
    called the checkpoint damaged, and load_latest picked it. Now the load refuses it (integrity.verify: off loads
    it unchecked) and load_latest falls back to the one before."""
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(100, 100, generator=g), "b": torch.randn(100, generator=g)}
    dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path / "root" / "step_1")))
    dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path / "root" / "step_2")))
    data = tmp_path / "root" / "step_2" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # inside w's tensor bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(cpuckpt.CheckpointCorrupt, match=r"__0_0\.distcp: the tensor bytes of the record .*CRC-32"):
        cpuckpt.load(_targets(sd), tmp_path / "root" / "step_2")
    out = _targets(sd)
    cpuckpt.load(out, tmp_path / "root" / "step_2", {"integrity": {"verify": "off"}})
    assert not torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])  # the flip, unchecked
    out = _targets(sd)
    loaded = cpuckpt.load_latest(out, tmp_path / "root")
    assert Path(loaded).name == "step_1"
    _assert_same(out, sd)


# ---------------------------------------------------------------------------- manifest compatibility


def _edit_manifest(path: Path, edit) -> dict:
    """Another writer's manifest (its own crc32c made anew, as that writer would)."""
    faults.rewrite_manifest(path, edit)
    return json.loads((path / MANIFEST_NAME).read_text())


def _load_with_reader(path: Path, sd: dict) -> cpuckpt.StorageReader:
    out = _targets(sd)
    reader = cpuckpt.StorageReader(path)
    dcp.load(out, storage_reader=reader)
    _assert_same(out, sd)
    return reader


def test_manifest_contents(saved):
    path, sd = saved
    m = manifest_from_json((path / MANIFEST_NAME).read_bytes())
    assert m.format == "cpuckpt" and m.format_version == FORMAT_VERSION
    assert m.min_reader_version <= FORMAT_VERSION
    assert m.world_size == 1 and m.cpuckpt_version == cpuckpt.__version__
    entry = m.files["__0_0.distcp"]
    assert entry.nbytes == (path / "__0_0.distcp").stat().st_size
    assert entry.chunk_bytes == 65536 and entry.checksum == "crc32c"
    assert len(entry.chunk_checksums) == -(-entry.nbytes // entry.chunk_bytes)
    md = _stock_metadata(path)
    tensor_offsets = sorted(s.offset for i, s in md.storage_data.items() if isinstance(sd[i.fqn], torch.Tensor))
    assert sorted(r[0] for r in entry.records) == tensor_offsets


def test_manifest_with_unknown_fields_loads(saved, tmp_path):
    path, sd = saved
    path = _copy(path, tmp_path / "c")

    def add(raw):
        raw["future_top_level"] = {"anything": [1, 2, 3]}
        raw["compression"] = "zstd-maybe"
        for entry in raw["files"].values():
            entry["future_file_field"] = 42
            entry["encryption"] = None

    _add = _edit_manifest(path, add)
    assert "future_top_level" in _add
    reader = _load_with_reader(path, sd)
    assert reader.manifest is not None  # still used (checksums verified), extras dropped
    assert reader.manifest.files["__0_0.distcp"].chunk_checksums
    out = _targets(sd)
    cpuckpt.load(out, path)
    _assert_same(out, sd)


def test_manifest_missing_later_fields_loads_with_defaults(saved, tmp_path):
    path, sd = saved
    path = _copy(path, tmp_path / "c")
    dropped = ["format_version", "min_reader_version", "cpuckpt_version", "torch_version", "save_id", "step",
               "created_unix", "world_size", "config", "timings"]

    def drop(raw):
        for k in dropped:
            raw.pop(k)
        for entry in raw["files"].values():
            entry.pop("checksum")

    _edit_manifest(path, drop)
    reader = _load_with_reader(path, sd)
    m = reader.manifest
    assert m is not None
    defaults = Manifest(format_version=1)  # a manifest without the field was written by format 1 (FORMAT.md 5.1)
    for k in dropped:
        assert getattr(m, k) == getattr(defaults, k), k
    assert m.files["__0_0.distcp"].checksum == FileEntry("x", 0, 0).checksum


def test_manifest_requiring_newer_reader_falls_back_to_stock_reading(saved, tmp_path, caplog):
    path, sd = saved
    path = _copy(path, tmp_path / "c")

    def future(raw):
        raw["format_version"] = FORMAT_VERSION + 5
        raw["min_reader_version"] = FORMAT_VERSION + 1
        for entry in raw["files"].values():
            # a future layout we must not interpret: if the reader used it, verification would fail
            entry["chunk_checksums"] = [0] * len(entry["chunk_checksums"])
            entry["chunk_bytes"] = 4096
            entry["records"] = [[r[0], r[1] + 1] for r in entry["records"]]

    _edit_manifest(path, future)
    with caplog.at_level(logging.WARNING):
        reader = _load_with_reader(path, sd)
    assert reader.manifest is None
    assert any("newer cpuckpt" in r.getMessage() for r in caplog.records)
    out = _targets(sd)
    with caplog.at_level(logging.WARNING):
        cpuckpt.load(out, path)
    _assert_same(out, sd)


def test_manifest_from_json_policy_unit():
    base = Manifest(save_id="abc", files={"f": FileEntry("f", 10, 4096, chunk_checksums=[1])})
    raw = json.loads(base.to_json())
    raw.pop("manifest_crc32c")
    raw["new_field"] = 1
    raw["files"]["f"]["new_file_field"] = 2
    m = manifest_from_json(signed_json(raw))
    assert m == base
    with pytest.raises(ValueError, match="manifest damaged"):  # the same fields, not as its writer wrote them
        manifest_from_json(json.dumps({**raw, "manifest_crc32c": json.loads(base.to_json())["manifest_crc32c"]}))
    raw.update(format_version=3)
    with pytest.raises(ValueError, match="without its manifest_crc32c"):
        manifest_from_json(json.dumps(raw))
    minimal = {"format": "cpuckpt", "files": {"f": {"name": "f", "nbytes": 10, "chunk_bytes": 4096}}}
    m = manifest_from_json(json.dumps(minimal).encode())
    assert m.format_version == 1 and m.files["f"].chunk_checksums == [] and m.files["f"].records == []
    assert m.metadata_crc32c is None  # format 1: nothing to compare .metadata with
    for bad in ["[]", '{"format": "other"}', "not json", '{"format": "cpuckpt", "files": {"f": 3}}',
                '{"format": "cpuckpt", "files": []}', '{"format": "cpuckpt", "files": 0}']:
        with pytest.raises(ValueError):
            manifest_from_json(bad)

