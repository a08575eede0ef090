"""Reading a commit back: the one definition of completeness and the one data-file size check.

``is_complete`` is the commit marker alone; ``check_complete`` adds the metadata and the manifest's
sizes; every caller of the size check (commit, reader, roots, verify) reports the same
``SizeMismatch`` wording, naming the file and both sizes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cpuckpt
from cpuckpt.backend.committed import (
    check_complete,
    check_slot_complete,
    is_complete,
    parse_metadata,
    read_manifest,
    same_save,
    size_mismatch,
    size_mismatches,
)
from cpuckpt.errors import CheckpointCorrupt
from cpuckpt.testing import faults
from cpuckpt.tools.verification import verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CFG = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 30}
DATA = "__0_0.distcp"


def _sd() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(7, generator=g), "step": 3}


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "step_3"
    cpuckpt.save(_sd(), path, CFG, step=3)
    return path


def test_a_good_checkpoint_is_complete(ckpt):
    c = check_complete(ckpt)
    assert c.complete and c.reason == "" and c.step == 3
    assert c.committed_at == (ckpt / ".metadata").stat().st_mtime
    assert is_complete(ckpt)
    manifest = read_manifest(ckpt)
    assert manifest is not None and size_mismatches(ckpt, manifest.files) == []


@pytest.mark.parametrize(("damage", "committed", "fragment"), [
    ("no-metadata", False, "no .metadata"),
    ("empty-metadata", False, ".metadata is empty"),
    ("garbage-metadata", True, ".metadata"),
    ("garbage-manifest", True, ".cpuckpt.json"),
    ("truncated-data", True, f"{DATA}: 100 bytes on disk, the manifest says"),
    ("missing-data", True, f"{DATA}: data file is missing"),
])
def test_check_complete_says_why(ckpt, damage, committed, fragment):
    data = ckpt / DATA
    if damage == "no-metadata":
        (ckpt / ".metadata").unlink()
    elif damage == "empty-metadata":
        (ckpt / ".metadata").write_bytes(b"")
    elif damage == "garbage-metadata":
        (ckpt / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    elif damage == "garbage-manifest":
        (ckpt / ".cpuckpt.json").write_text("{not json")
    elif damage == "truncated-data":
        os.truncate(data, 100)
    else:
        data.unlink()
    c = check_complete(ckpt)
    assert not c.complete and fragment in c.reason, c.reason
    assert is_complete(ckpt) is committed  # the cheap test sees the commit marker only
    info = cpuckpt.list_checkpoints(ckpt.parent)[0]
    assert (info.complete, info.reason) == (c.complete, c.reason)
    assert cpuckpt.find_latest(ckpt.parent) is None


def test_one_size_check_one_wording(ckpt):
    data = ckpt / DATA
    size = data.stat().st_size
    os.truncate(data, 1000)
    manifest = read_manifest(ckpt)
    assert manifest is not None
    (m,) = size_mismatches(ckpt, manifest.files)
    assert (m.name, m.file, m.expected, m.actual) == (DATA, data, size, 1000)
    assert str(m) == f"{data}: 1000 bytes on disk, the manifest says {size} (truncated or overwritten)"
    assert size_mismatches(ckpt, list(manifest.files.values()), first=True) == [m]
    with pytest.raises(CheckpointCorrupt) as ei:
        cpuckpt.load({"w": torch.zeros(64, 64), "b": torch.zeros(7), "step": None}, ckpt, CFG)
    assert str(m) in str(ei.value)
    assert check_complete(ckpt).reason == f"{DATA}: {m.what}"
    report = verify_checkpoint(ckpt)
    assert [(d.file, d.lo, d.hi, d.what) for d in report.damage if d.what == m.what] == [(DATA, 1000, size, m.what)]
    data.unlink()
    assert str(size_mismatch(data, None)) == f"{data}: data file is missing"
    assert size_mismatch(ckpt / ".metadata", None) is None  # None: only existence is checked


def test_a_stale_manifest_is_not_this_saves(ckpt):
    """A stock save committed over a cpuckpt one: its manifest describes old files."""
    manifest = read_manifest(ckpt)
    assert manifest is not None
    dcp.save({"w": torch.ones(64, 64), "b": torch.ones(7)}, storage_writer=dcp.FileSystemWriter(str(ckpt)))
    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    assert not same_save(manifest, md)
    c = check_complete(ckpt)
    assert c.complete and c.step is None


@pytest.mark.parametrize(("damage", "fragment"), [
    (None, ""),
    ("no-metadata", "no .metadata"),
    ("truncated-metadata", "does not name the manifest's save"),
    ("another-save", "does not name the manifest's save"),
    ("changed-metadata", ".metadata is not the one committed with the manifest (crc32c"),
    ("no-manifest", "no .cpuckpt.json"),
    ("save-id-not-a-string", "does not name the manifest's save"),
    ("garbage-manifest", ".cpuckpt.json"),
    ("truncated-data", f"{DATA}: 100 bytes on disk, the manifest says"),
    ("missing-data", f"{DATA}: data file is missing"),
])
def test_a_slot_is_complete_without_unpickling_its_metadata(ckpt, tmp_path, damage, fragment):
    """The writer's check of a memory slot (replicas): what check_complete refuses for a slot, it refuses too, and a
    .metadata of another save (a stock save over the slot, or a slot refilled under it) is not this save's."""
    data = ckpt / DATA
    if damage == "no-metadata":
        (ckpt / ".metadata").unlink()
    elif damage == "truncated-metadata":
        md = (ckpt / ".metadata").read_bytes()
        (ckpt / ".metadata").write_bytes(md[: len(md) // 2])
    elif damage == "another-save":
        other = tmp_path / "other"
        cpuckpt.save(_sd(), other, CFG, step=3)
        (ckpt / ".metadata").write_bytes((other / ".metadata").read_bytes())
    elif damage == "changed-metadata":  # a whole pickle of this save that still unpickles, with a key changed
        md = (ckpt / ".metadata").read_bytes()
        changed = md.replace(b"\x8c\x01w\x94", b"\x8c\x01v\x94")
        assert changed != md and "v" in parse_metadata(changed, "changed").state_dict_metadata
        (ckpt / ".metadata").write_bytes(changed)
    elif damage == "no-manifest":
        (ckpt / ".cpuckpt.json").unlink()
    elif damage == "save-id-not-a-string":  # a manifest that parses, with a number for its save: refused, not raised
        faults.rewrite_manifest(ckpt, lambda m: m.update(save_id=12345))
    elif damage == "garbage-manifest":
        (ckpt / ".cpuckpt.json").write_text("{not json")
    elif damage == "truncated-data":
        os.truncate(data, 100)
    elif damage == "missing-data":
        data.unlink()
    c = check_slot_complete(ckpt)
    assert (c.complete, fragment in c.reason) == (damage is None, True), c.reason
    if damage == "changed-metadata":
        assert [(d.file, d.what) for d in verify_checkpoint(ckpt).damage] == [(".metadata", c.reason)]
    if damage is None:
        assert (c.step, c.committed_at) == (3, (ckpt / ".metadata").stat().st_mtime)
        assert check_complete(ckpt).complete
    elif damage != "save-id-not-a-string":  # cpuckpt's .metadata without its save's manifest: damaged too
        c = check_complete(ckpt)
        assert not c.complete, damage
        if damage in ("no-manifest", "another-save"):
            assert "manifest .cpuckpt.json is missing or of another save" in c.reason, c.reason


def test_the_manifest_json_is_the_dataclass_fields_as_json_and_reads_back():
    """to_json walks the fields itself (no deep copy of every record): the same text dataclasses.asdict gives."""
    import dataclasses
    import json

    from crc32c import crc32c

    from cpuckpt.format.manifest import FileEntry, Manifest, manifest_from_json, signed_json

    m = Manifest(cpuckpt_version="1", save_id="s", step=3, config={"io": {"threads": 8}, "root": None},
                 timings={"t": 0.5}, files={"__0_0.distcp": FileEntry("__0_0.distcp", 10, 4, chunk_checksums=[1, 2],
                                                                      records=[[i, 64] for i in range(100)])})
    body = json.dumps(dataclasses.asdict(m), separators=(",", ":"), sort_keys=True)
    own = crc32c(body.encode())
    assert m.to_json() == signed_json(dataclasses.asdict(m)) == body[:-1] + f',"manifest_crc32c":{own}}}'
    assert manifest_from_json(m.to_json()) == m


def test_a_metadata_mapping_keys_to_each_others_records_is_refused_on_load(tmp_path):
    """A ``.metadata`` changed after its commit so that it still unpickles and every chunk still verifies (two keys'
    names swapped: each points at the other's record) is refused by every load path; without the crc32c the
    manifest records (format 1) it loads the values swapped."""

    path = tmp_path / "ck"
    cpuckpt.save({"a": torch.ones(4), "b": torch.zeros(4)}, path, CFG)
    md = (path / ".metadata").read_bytes()
    a, b, x = b"\x8c\x01a\x94", b"\x8c\x01b\x94", b"\x8c\x01x\x94"
    assert md.count(a) == 1 and md.count(b) == 1 and x not in md
    (path / ".metadata").write_bytes(md.replace(a, x).replace(b, a).replace(x, b))
    with pytest.raises(CheckpointCorrupt, match=r"\.metadata is not the one committed with the manifest"):
        cpuckpt.load({"a": torch.empty(4), "b": torch.empty(4)}, path, CFG)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as ei:  # DCP's own load: the rank's error is the same class
        dcp.load({"a": torch.empty(4), "b": torch.empty(4)}, storage_reader=cpuckpt.StorageReader(path, CFG))
    (failure,) = ei.value.failures.values()
    failure = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(failure, CheckpointCorrupt) and "not the one committed with the manifest" in str(failure)
    assert not check_complete(path).complete
    faults.rewrite_manifest(path, lambda m: (m.pop("metadata_crc32c"), m.update(format_version=1)))
    out = {"a": torch.empty(4), "b": torch.empty(4)}
    cpuckpt.load(out, path, CFG)
    assert torch.equal(out["a"], torch.zeros(4)) and torch.equal(out["b"], torch.ones(4))  # what the crc32c refuses


@pytest.mark.parametrize("text", ['{"format": "cpuckpt", "files": [1]}', '{"format": "cpuckpt", "files": "x"}',
                                  '{"format": "cpuckpt", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"])
def test_an_unusable_manifest_makes_the_checkpoint_incomplete_never_raises(ckpt, text):
    (ckpt / ".cpuckpt.json").write_text(text)
    c = check_complete(ckpt)
    assert not c.complete and ".cpuckpt.json: unreadable manifest" in c.reason, c.reason
    assert not check_slot_complete(ckpt).complete


def test_a_manifest_without_its_format_version_is_format_1():
    from cpuckpt.format.manifest import manifest_from_json

    assert manifest_from_json('{"format": "cpuckpt"}').format_version == 1


def test_metadata_of_any_size_sequence_parses_and_a_damaged_field_name_is_corrupt():
    """DCP takes a chunk's offsets and sizes as any sequence (Megatron-FSDP's uneven DTensors record tuples): such
    metadata is DCP metadata; one whose field name was damaged (the pickle memoizes it: every entry loses it) is
    CheckpointCorrupt, not an AttributeError in the middle of a load."""
    import pickle

    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 2]),
                                  [ChunkStorageMetadata(offsets=(0, 0), sizes=(2, 2)),
                                   ChunkStorageMetadata(offsets=[2, 0], sizes=[2, 2])])
    data = pickle.dumps(Metadata(state_dict_metadata={"w": entry, "v": entry}))
    assert parse_metadata(data, "tuples").state_dict_metadata["w"].chunks[0].offsets == (0, 0)
    assert data.count(b"offsets") == 1
    with pytest.raises(CheckpointCorrupt, match=r"damaged: malformed DCP metadata: the entry of 'w'"):
        parse_metadata(data.replace(b"offsets", b"offsetz"), "damaged")


def test_a_stock_checkpoint_whose_storage_record_field_is_damaged_is_corrupt(tmp_path):
    """A stock checkpoint has no manifest (no crc32c of its .metadata): a damaged field name of its storage records
    is CheckpointCorrupt from the metadata check (what the Megatron fallback falls back on), not an error mid-load."""
    path = tmp_path / "stock"
    dcp.save({"w": torch.ones(4), "b": torch.zeros(2)}, storage_writer=dcp.FileSystemWriter(str(path)))
    md = (path / ".metadata").read_bytes()
    assert md.count(b"relative_path") == 1
    (path / ".metadata").write_bytes(md.replace(b"relative_path", b"relative_pbth"))
    with pytest.raises(CheckpointCorrupt, match=r"malformed DCP metadata: the storage record of '(w|b)'"):
        cpuckpt.load({"w": torch.empty(4), "b": torch.empty(2)}, path, CFG)
    assert "malformed" in check_complete(path).reason


def test_an_overwrite_fsyncs_the_removal_of_the_old_commit_even_without_io_fsync(tmp_path, monkeypatch):
    """FORMAT.md §2, step 1: after a crash, no old ``.metadata`` may come back beside rewritten data."""
    import cpuckpt.backend.commit as commit

    cfg = {**CFG, "io": {**CFG["io"], "fsync": False}}
    path = tmp_path / "c"
    cpuckpt.save(_sd(), path, cfg)
    synced: list[Path] = []
    real = commit.fsync_dir
    monkeypatch.setattr(commit, "fsync_dir", lambda p: (synced.append(Path(p)), real(p))[1])
    cpuckpt.save(_sd(), path, cfg)
    assert synced == [path]


def test_listing_does_not_unpickle_the_metadata_its_manifest_vouches_for(ckpt, monkeypatch):
    """``.metadata`` whose crc32c the manifest of its save records is a cpuckpt save's own: listing a root of many
    checkpoints reads it without the (pure-Python, restricted) unpickler; a foreign one is still parsed."""
    import cpuckpt.backend.committed as committed

    parsed: list[object] = []
    real = committed.parse_metadata
    monkeypatch.setattr(committed, "parse_metadata", lambda data, where: (parsed.append(where), real(data, where))[1])
    assert check_complete(ckpt).complete and parsed == []
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[:-1] + b"\x00")  # not the committed pickle: parsed (and refused)
    c = check_complete(ckpt)
    assert not c.complete and parsed == [ckpt / ".metadata"]


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/passwd", "a/../../b", "", "sub//x"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(ckpt, name):
    """A crafted manifest (its own crc32c right) made ``verify`` and the size checks stat and read files elsewhere."""
    from cpuckpt.format.manifest import manifest_from_json

    faults.rewrite_manifest(ckpt, lambda m: m["files"].update({name: {**m["files"][DATA], "name": name}}))
    with pytest.raises(ValueError, match="outside the checkpoint"):
        manifest_from_json((ckpt / ".cpuckpt.json").read_bytes())
    assert not check_complete(ckpt).complete


def test_a_commit_refuses_a_part_of_another_save_into_the_same_directory(tmp_path: Path) -> None:
    """Two persists of one name in flight (a rewind re-saving a step while the first one's persist commits): a
    rank's writer that went on to the second replaced its part; committing the first with it would put the second
    save's data under the first's ``.metadata``, complete and verifying. The coordinator refuses it instead."""
    import dataclasses

    from cpuckpt.backend.commit import commit_checkpoint
    from cpuckpt.errors import IntegrityError
    from cpuckpt.format.manifest import MANIFEST_NAME, part_name

    path = tmp_path / "step_5"
    cpuckpt.save({"w": torch.arange(1000, dtype=torch.float32)}, path, step=5)
    manifest = read_manifest(path)
    metadata = (path / ".metadata").read_bytes()
    (path / ".metadata").unlink()
    (path / MANIFEST_NAME).unlink()
    files = dict(manifest.files)
    header = dataclasses.replace(manifest, files={}, metadata_crc32c=None)
    (path / part_name("__0_")).write_bytes(dataclasses.replace(header, save_id="another", files=files)
                                           .to_json().encode())
    with pytest.raises(IntegrityError, match="part of save another"):
        commit_checkpoint(path, metadata, ["__0_"], dataclasses.replace(header, files={}), fsync=False,
                          parts_of=manifest.save_id)
    assert not check_complete(path).complete
    (path / part_name("__0_")).write_bytes(dataclasses.replace(header, files=files).to_json().encode())
    commit_checkpoint(path, metadata, ["__0_"], dataclasses.replace(header, files={}), fsync=False,
                      parts_of=manifest.save_id)
    assert check_complete(path).complete and verify_checkpoint(path).ok


def test_a_metadata_removed_while_it_is_read_is_a_checkpoint_going_not_damage(tmp_path, monkeypatch):
    """Cleaning or retention (a writer of the previous run) may remove ``.metadata`` between its ``stat`` and its
    read: that checkpoint is going, not committed and damaged since (a restart would name it, or raise over it)."""
    import cpuckpt
    import cpuckpt.backend.committed as committed

    d = tmp_path / "step_1"
    cpuckpt.save({"w": torch.arange(8.0)}, d, step=1)
    real = committed.read_metadata_bytes

    def removed_first(path, *args, **kwargs):
        (Path(path) / ".metadata").unlink(missing_ok=True)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(committed, "read_metadata_bytes", removed_first)
    c = committed.check_complete(d)
    assert not c.complete and not c.committed and not c.unreadable, c
