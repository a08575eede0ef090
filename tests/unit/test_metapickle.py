"""``.metadata`` bytes of repeated saves (``cpuckpt.format.metapickle``): every result unpickles to that save's
metadata (and is byte-for-byte ``pickle.dumps`` of it where no string is shared), whether it came from the previous
save's bytes or a full pickle; only a cached plan's structure is kept, weakly, and a directory's bytes only once it
is saved into again."""

from __future__ import annotations

import copy
import gc
import io
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from cpuckpt.format.metapickle import MetadataPickles, holds_text, with_checkpoint_id
from cpuckpt.format.unpickle import unpickle_metadata

SDM = {f"layer.{i}.w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([8, 4]),
                                             [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([8, 4]))])
       for i in range(300)}
PLANNER = {k: k for k in SDM}


def _md(save_id: str, *, slot: str = "/ram/slot-0", shift: int = 0, sdm: dict = SDM) -> Metadata:
    """As a save from a cached plan makes it: the same structure objects, fresh storage data and storage meta."""
    storage = {MetadataIndex(k, torch.Size([0, 0])): _StorageInfo("__0_0.distcp", i * 128 + shift, 64)
               for i, k in enumerate(sdm)}
    return Metadata(state_dict_metadata=sdm, planner_data=PLANNER, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=slot, save_id=save_id))


def _reusable(pickles: MetadataPickles, sdm: dict = SDM) -> Metadata:
    """The cached plan's metadata the saves copy (the caller keeps it alive, as the plan cache does)."""
    owner = _md("plan", sdm=sdm)
    pickles.reusable(owner)
    return owner


def test_a_repeated_save_gets_the_previous_bytes_with_its_own_save_id_and_they_are_its_pickle():
    pickles = MetadataPickles()
    owner = _reusable(pickles)
    ids = [f"job-{k:016x}" for k in (1, 2, 3, 4)]
    for k, save_id in enumerate(ids):
        md = _md(save_id)
        assert pickles.dumps(md) == pickle.dumps(md)
        assert pickles.reused == max(0, k - 1)  # the first two pickled in full (the first visit keeps nothing)
    assert pickle.loads(pickles.dumps(_md(ids[0]))).storage_meta.save_id == ids[0]
    del owner


def test_nothing_is_kept_for_a_structure_not_saved_again_nor_after_its_plan_is_gone():
    pickles = MetadataPickles()
    for k in range(3):  # no cached plan: every save its own structure (cpuckpt.save, a persister's load)
        md = _md(f"job-{k:016x}")
        assert pickles.dumps(md) == pickle.dumps(md)
    assert pickles.reused == 0 and not pickles._structures
    owner = _reusable(pickles)
    for k in range(5):  # a new directory every save (the disk path's step_N): names only, no bytes
        pickles.dumps(_md(f"job-{k:016x}", slot=f"/ckpt/step_{k}"))
    assert pickles.reused == 0 and all(e is None for s in pickles._structures.values() for e in s.entries.values())
    for k in range(3):
        pickles.dumps(_md(f"job-{k:016x}"))
    assert pickles.reused == 1
    del owner
    gc.collect()
    assert not pickles._structures  # the plan is gone: its bytes go with it


def test_more_slots_than_a_few_still_reuse():
    pickles = MetadataPickles()
    owner = _reusable(pickles)
    slots = [f"/ram/slot-{j}" for j in range(20)]
    for k in range(60):
        pickles.dumps(_md(f"job-{k:016x}", slot=slots[k % len(slots)]))
    assert pickles.reused == 20  # the third round of every slot
    del owner


def test_anything_else_that_changed_is_pickled_in_full():
    pickles = MetadataPickles()
    owner = _reusable(pickles)
    pickles.dumps(_md("job-0000000000000000"))
    pickles.dumps(_md("job-0000000000000001"))
    for md in (_md("job-0000000000000002", shift=4096),        # other storage data (a layout that moved)
               _md("job-00000000000000003"),                   # an id of another length
               _md("job-0000000000000004", slot="/ram/slot-1"),  # another directory: its own entry
               _md("job-0000000000000005", sdm=copy.copy(SDM))):  # another structure object
        assert pickles.dumps(md) == pickle.dumps(md)
    assert pickles.reused == 0
    # an id whose text also occurs elsewhere (here a tensor named like it, the very same str object): that name
    # is never replaced with the next save's id
    name = "job-0000000000000009"
    named = {**SDM, name: SDM["layer.0.w"]}
    owner_named = _reusable(pickles, named)
    for save_id in ("job-0000000000000008", name):
        first = _md(save_id, sdm=named)
        assert pickle.loads(pickles.dumps(first)) == first
    md = _md("job-000000000000000a", sdm=named)
    assert pickle.loads(pickles.dumps(md)) == md and pickles.reused == 0
    del owner, owner_named


def test_the_id_is_rewritten_in_its_own_record_only_whatever_its_text():
    """Ids whose text could match at a record's length byte, one-character ids (CPython shares those objects),
    non-ASCII ids and a changed field besides the per-save ones: each result is that save's metadata."""
    pickles = MetadataPickles()
    owner = _reusable(pickles)
    for first, then in (("0" * 48, "0" * 47 + "1"), (" " * 32, "x" * 32), ("Q", "R"), ("ab\udc80cd", "ab\udc81cd"),
                        ("é" * 10, "è" * 10), ("a" * 300, "b" * 300)):  # BINUNICODE past 255 bytes
        for save_id in (first, then, first):
            md = _md(save_id)
            assert pickle.loads(pickles.dumps(md)) == md, (first, then)
    # reused: ASCII ids of 2+ characters of the length the slot's kept bytes have (48: 1, 32: 2, 300: 2)
    assert pickles.reused == 5
    sdm = {"Q": SDM["layer.0.w"]}  # a one-character id that is also a tensor's name: never renamed
    owner_q = Metadata(state_dict_metadata=sdm, planner_data={"Q": ("Q",)})
    pickles.reusable(owner_q)
    for save_id in ("Q", "Q", "R"):
        md = Metadata(state_dict_metadata=sdm, planner_data={"Q": ("Q",)}, storage_data={},
                      storage_meta=StorageMeta(checkpoint_id="/ram/slot-9", save_id=save_id))
        assert pickle.loads(pickles.dumps(md)) == md
    reused = pickles.reused
    md = _md("job-00000000000000ff")
    md.version = "9.9.9"  # any other field that changed: pickled in full
    assert pickle.loads(pickles.dumps(md)).version == "9.9.9" and pickles.reused == reused
    del owner, owner_q


# ------------------------------------------------------------------------------------- with_checkpoint_id


def _pickled(md: Metadata, protocol: int, python: bool) -> bytes:
    if not python:
        return pickle.dumps(md, protocol=protocol)
    buf = io.BytesIO()
    pickle._Pickler(buf, protocol=protocol).dump(md)  # the pure-Python pickler frames its own way
    return buf.getvalue()


@pytest.mark.parametrize("python", [False, True])
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("old", ["/ram/slot-0", "/ram/" + "s" * 70000])
@pytest.mark.parametrize("new", ["/d", "/durable/step_00000064" * 20, "/d/\u00e9/\udcff/" + "x" * 70000])
def test_with_checkpoint_id_renames_without_unpickling(python, protocol, old, new):
    """The writer process's rename of a slot's ``.metadata``: every protocol, both picklers, shorter and longer names
    (a frame's length changes; records larger than a frame are written outside frames), non-UTF-8 bytes of a path
    (a lone surrogate); the strict unpickler reads the result, and everything else is unchanged."""
    md = _md("a1b2c3", slot=old)
    out = with_checkpoint_id(_pickled(md, protocol, python), new)
    assert out is not None
    back = pickle._loads(out)  # the pure-Python unpickler checks every frame's length
    assert back.storage_meta.checkpoint_id == new and back.storage_meta.save_id == "a1b2c3"
    assert back.state_dict_metadata == md.state_dict_metadata and back.storage_data == md.storage_data
    assert back.planner_data == md.planner_data
    assert unpickle_metadata(out).storage_meta.checkpoint_id == new


def test_with_checkpoint_id_of_the_committed_bytes():
    """What the trainer commits (``MetadataPickles``, the save id rewritten in place) renames as well."""
    pickles = MetadataPickles()
    owner = _reusable(pickles)
    for save_id in ("s1", "s2", "s3"):
        data = pickles.dumps(_md(save_id))
    assert pickles.reused and owner is not None
    assert unpickle_metadata(with_checkpoint_id(data, "/durable/7")).storage_meta.checkpoint_id == "/durable/7"


def test_with_checkpoint_id_refuses_what_it_cannot_rename_alone():
    """None (the caller unpickles) wherever a rewrite could touch another field, or there is no StorageMeta."""
    shared = "/ram/slot-0"  # one string object in two fields: pickled once, fetched from the memo again
    md = _md("x", slot=shared)
    md.planner_data = {"where": shared}
    assert with_checkpoint_id(pickle.dumps(md), "/d") is None
    # the key's text pickled first in another field (a state dict entry named so): StorageMeta's key is a memo fetch
    key = "checkpoint_id"
    md = _md("x")
    md.planner_data = {"checkpoint_id.step": (key, "step")}
    assert with_checkpoint_id(pickle.dumps(md), "/d") is None
    md.planner_data = {"a": "checkpoint_id", "b": "x"}  # the only record of the text, not StorageMeta's
    out = with_checkpoint_id(pickle.dumps(md), "/d")
    assert out is None or (unpickle_metadata(out).planner_data == md.planner_data
                           and unpickle_metadata(out).storage_meta.checkpoint_id == "/d")
    # a look-alike state (the key, a text, "save_id") outside StorageMeta: before it, or with no StorageMeta at all
    for storage_meta in (StorageMeta(checkpoint_id="/ram/slot-0", save_id="x"), None):
        md = Metadata(state_dict_metadata={}, planner_data={"checkpoint_id": "zz", "save_id": "q"},
                      storage_meta=storage_meta)
        assert with_checkpoint_id(pickle.dumps(md), "/d") is None, storage_meta
    # the value shared by a field pickled after StorageMeta (the same str object)
    md = _md("x")
    md.version = md.storage_meta.checkpoint_id
    assert with_checkpoint_id(pickle.dumps(md), "/d") is None
    assert with_checkpoint_id(b"not a pickle", "/d") is None
    assert with_checkpoint_id(pickle.dumps(_md("x")), Path("/d")) is None  # not a str


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_string_record_is_found_as_a_whole_never_inside_a_longer_one(protocol):
    """A slot's .metadata names its save by a string record of its own: "s1" is not found inside "s10", a name with
    a lone surrogate (a job named by undecodable bytes) is found as pickle wrote it, a name 256 bytes or longer too."""
    long_id = "j" * 300
    data = pickle.dumps({"save_id": "s10", "other": "job\udcff-1", "long": long_id}, protocol=protocol)
    assert holds_text(data, "s10") and not holds_text(data, "s1") and not holds_text(data, "10")
    assert holds_text(data, "job\udcff-1") and holds_text(data, long_id) and not holds_text(data, long_id[:-1])
