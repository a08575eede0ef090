"""Checkpoints whose manifest records blocksum32 chunk checksums: every reader and verifier of chunk checksums
takes them as it takes crc32c (load, ``cpuckpt verify``, the DeepSpeed tag check; the writer's persist:
test_blocksum_persist.py).

A blocksum32 checkpoint is made by saving normally (crc32c) and rewriting the manifest's entries to blocksum32 with
values recomputed from the data files (``faults.rewrite_manifest``: the manifest's own crc32c made anew), as a
memory save whose chunks were summed on the GPU would record them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import cpuckpt
from cpuckpt.backend import reader as reader_mod
from cpuckpt.backend.committed import read_manifest
from cpuckpt.errors import CheckpointCorrupt
from cpuckpt.format.checksums import blocksum32
from cpuckpt.format.manifest import FileEntry
from cpuckpt.testing import faults
from cpuckpt.testing.faults import flip_byte
from cpuckpt.tier.tagmarker import TagFile, verify_files
from cpuckpt.tools.cli import cli
from cpuckpt.tools.verification import verify_checkpoint

CHUNK = 64 * 1024
CFG = {"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered"}, "integrity": {"verify": "always"}}


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(300, 257, generator=g), "b": torch.arange(10, dtype=torch.int64), "step": 7}


def _blank() -> dict:
    return {"w": torch.zeros(300, 257), "b": torch.zeros(10, dtype=torch.int64), "step": 0}


def _sums(data: bytes, chunk: int) -> list[int]:
    return [blocksum32(memoryview(data)[o:o + chunk]) for o in range(0, len(data), chunk)]


def _to_blocksum(path: Path) -> None:
    """Rewrite the committed manifest at ``path``: every file's chunks summed with blocksum32."""

    def edit(raw: dict) -> None:
        for name, e in raw["files"].items():
            e["checksum"] = "blocksum32"
            e["chunk_checksums"] = _sums((path / name).read_bytes(), e["chunk_bytes"])

    faults.rewrite_manifest(path, edit)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "step_7"
    cpuckpt.save(_state(), path, CFG, step=7)
    _to_blocksum(path)
    m = read_manifest(path)
    assert m is not None and m.files and all(e.checksum == "blocksum32" for e in m.files.values())
    assert any(len(e.chunk_checksums) > 1 for e in m.files.values())
    return path


@pytest.mark.parametrize("mapped", [False, True], ids=["pread", "mapped"])
def test_a_blocksum32_checkpoint_loads_and_a_flipped_byte_is_refused(ckpt, monkeypatch, mapped):
    monkeypatch.setattr(reader_mod, "in_ram", lambda p: mapped)  # the RAM root's path: chunks checked in the mapping
    state = _blank()
    cpuckpt.load(state, ckpt, CFG)
    want = _state()
    assert torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"]) and state["step"] == 7

    name = sorted(read_manifest(ckpt).files)[0]
    flip_byte(ckpt / name, CHUNK + 4321)  # in chunk 1
    with pytest.raises(CheckpointCorrupt, match=r"checksum mismatch in bytes \[65536, 131072\) \(chunk 1\): "
                                                r"stored blocksum32"):
        cpuckpt.load(_blank(), ckpt, CFG)


def test_verify_checks_blocksum32_chunks(ckpt):
    report = verify_checkpoint(ckpt)
    m = read_manifest(ckpt)
    assert report.ok and not report.unverified and not report.notes, report
    assert report.chunks == sum(len(e.chunk_checksums) for e in m.files.values())
    code_out = CliRunner().invoke(cli, ["verify", str(ckpt)], catch_exceptions=False)
    assert code_out.exit_code == 0 and code_out.output.startswith("OK "), code_out.output

    name = sorted(m.files)[0]
    flip_byte(ckpt / name, 2 * CHUNK + 17)  # in chunk 2
    report = verify_checkpoint(ckpt)
    (d,) = report.damage
    assert (d.file, d.lo, d.hi) == (name, 2 * CHUNK, 3 * CHUNK) and "blocksum32" in d.what, d
    res = CliRunner().invoke(cli, ["verify", str(ckpt)], catch_exceptions=False)
    assert res.exit_code == 1 and "checksum mismatch in chunk 2" in res.output, res.output


def test_an_unknown_kind_is_not_verifiable_not_damage(ckpt):
    """A kind this reader does not compute (a newer writer's) is reported unverifiable, as ``none`` is."""

    def edit(raw: dict) -> None:
        for e in raw["files"].values():
            e["checksum"] = "sha999"

    faults.rewrite_manifest(ckpt, edit)
    report = verify_checkpoint(ckpt)
    assert report.ok and report.unverified and "sha999" in report.notes[0], report
    state = _blank()
    cpuckpt.load(state, ckpt, CFG)  # loaded unverified, like a checkpoint saved without checksums
    assert torch.equal(state["w"], _state()["w"])


def test_a_deepspeed_tag_marker_keeps_blocksum32_and_its_check_uses_it(tmp_path):
    data = os.urandom(3 * CHUNK + 100)
    (tmp_path / "f.pt").write_bytes(data)
    entry = FileEntry("f.pt", len(data), CHUNK, "blocksum32", _sums(data, CHUNK))
    tf = TagFile.of(entry, rank=0)
    assert (tf.checksum, tf.chunk_checksums) == ("blocksum32", tuple(entry.chunk_checksums))
    from cpuckpt.tier.tagmarker import new_marker

    marker = new_marker("global_step1", 1, {"f.pt": tf}, 1)
    assert verify_files(tmp_path, marker) == []
    flip_byte(tmp_path / "f.pt", CHUNK + 1)
    (problem,) = verify_files(tmp_path, marker)
    assert "f.pt: checksum mismatch in chunk 1" in problem and "blocksum32" in problem, problem
