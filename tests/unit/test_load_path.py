"""The load path reads ``.metadata`` once and reports where its time went (metadata, planning, reads)."""

from __future__ import annotations

import json

import _helpers as H  # tests/dist is on sys.path (tests/conftest.py)
import pytest
import torch

import cpuckpt
import cpuckpt.api
import cpuckpt.backend.reader
from cpuckpt.backend import committed


def _saved(tmp_path):
    sd = {"w": torch.randn(512, 256), "b": torch.arange(7), "step": 3}
    cpuckpt.save(sd, tmp_path / "c", step=3)
    return sd, tmp_path / "c"


def test_metadata_is_read_and_unpickled_once_per_load(tmp_path, monkeypatch):
    """A large model's .metadata is megabytes of pickle: the commit check and DCP share one read."""
    sd, path = _saved(tmp_path)
    calls = []

    def counting(p):
        calls.append(p)
        return committed.read_metadata_bytes(p)

    # cpuckpt.load reads it through the reader (StorageReader.load_metadata: a directory or an s3:// prefix)
    monkeypatch.setattr(cpuckpt.backend.reader, "read_metadata_bytes", counting)
    out = {"w": torch.empty(512, 256), "b": torch.empty(7, dtype=torch.int64), "step": 0}
    reader = cpuckpt.StorageReader(path)
    cpuckpt.load(out, path, storage_reader=reader)
    assert len(calls) == 1, calls
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 3
    assert reader.metadata is not None and "w" in reader.metadata.state_dict_metadata
    assert reader.last_read_nbytes >= 512 * 256 * 4


def test_a_second_load_with_a_fresh_reader_still_reads_metadata(tmp_path):
    _, path = _saved(tmp_path)
    for _ in range(2):
        out = {"w": torch.empty(512, 256), "b": torch.empty(7, dtype=torch.int64), "step": 0}
        cpuckpt.load(out, path)
        assert out["step"] == 3


def test_load_telemetry_splits_the_time(tmp_path, monkeypatch):
    _, path = _saved(tmp_path)
    sink = tmp_path / "t.jsonl"
    monkeypatch.setenv("CPUCKPT_TELEMETRY_FILE", str(sink))
    out = {"w": torch.empty(512, 256), "b": torch.empty(7, dtype=torch.int64), "step": 0}
    cpuckpt.load(out, path)
    (rec,) = [json.loads(line) for line in sink.read_text().splitlines()]
    assert rec["event"] == "load" and rec["read_s"] > 0 and rec["metadata_s"] > 0 and rec["plan_s"] >= 0
    assert rec["metadata_s"] + rec["plan_s"] + rec["read_s"] == pytest.approx(rec["stall_s"], abs=2e-6)


def test_storage_reader_of_another_checkpoint_is_refused(tmp_path):
    _, path = _saved(tmp_path)
    with pytest.raises(cpuckpt.ConfigError, match="storage_reader reads"):
        cpuckpt.load({"w": torch.empty(512, 256)}, path, storage_reader=cpuckpt.StorageReader(tmp_path / "other"))


@pytest.mark.parametrize("verify", ["always", "off"])
def test_reads_of_every_file_share_one_set_of_threads_and_are_accounted(tmp_path, monkeypatch, verify):
    """Several data files: one run of the read threads for all of them (no drain per file), and the
    read statistics split reads from the caller-thread copies of bounce buffers (a dtype change)."""
    cfg = {"io": {"read_threads": 2, "chunk_bytes": 65536}, "integrity": {"verify": verify}}
    sd = {f"t{i}": torch.randn(64, 128) for i in range(6)} | {"h": torch.randn(100, dtype=torch.float64)}
    with H.files_per_rank(3):  # as written before io.files_per_rank was removed
        cpuckpt.save(sd, tmp_path / "c", cfg)
    runs = []
    real = cpuckpt.backend.reader.run_parallel

    def counting(fn, tasks, **kw):
        runs.append(len(tasks))
        return real(fn, tasks, **kw)

    monkeypatch.setattr(cpuckpt.backend.reader, "run_parallel", counting)
    out = {k: torch.empty_like(v) for k, v in sd.items()} | {"h": torch.empty(100, dtype=torch.float32)}
    reader = cpuckpt.StorageReader(tmp_path / "c", cfg)
    cpuckpt.load(out, tmp_path / "c", cfg, storage_reader=reader)
    for k, v in sd.items():
        assert torch.equal(out[k], v.to(out[k].dtype)), k
    stats = reader.last_stats
    assert stats.files == 3 and len(runs) == 1 and runs[0] == stats.jobs >= 3
    assert stats.bounce_nbytes == 100 * 8  # the float64 record, converted on the caller's thread
    assert stats.nbytes == reader.last_read_nbytes >= sum(v.numel() * v.element_size() for v in sd.values())
    assert stats.plan_s + stats.io_s + stats.finish_s <= reader.last_read_s


def test_a_reset_reader_reads_the_new_checkpoints_metadata(tmp_path):
    """Metadata handed to a reader for one load (``use_metadata``, say by a ``cpuckpt.load`` that failed before DCP
    read it) is not served to the next load after ``reset``: that one may be of another checkpoint."""
    import torch.distributed.checkpoint as dcp

    a, b = tmp_path / "a", tmp_path / "b"
    cpuckpt.save({"a": torch.ones(3)}, a)
    cpuckpt.save({"b": torch.full((3,), 2.0)}, b)
    reader = cpuckpt.StorageReader(a)
    reader.use_metadata(reader.load_metadata())
    out = {"b": torch.zeros(3)}
    dcp.load(out, storage_reader=reader, checkpoint_id=b)
    assert torch.equal(out["b"], torch.full((3,), 2.0))
