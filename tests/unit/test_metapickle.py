"""``.metadata`` bytes of repeated saves (``cpuckpt.format.metapickle``): every result unpickles to that save's
metadata (and is byte-for-byte ``pickle.dumps`` of it where no string is shared), whether it came from the previous
save's bytes or a full pickle."""

from __future__ import annotations

import copy
import pickle

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

from cpuckpt.format.metapickle import MetadataPickles

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


def test_a_repeated_save_gets_the_previous_bytes_with_its_own_save_id_and_they_are_its_pickle():
    pickles = MetadataPickles()
    ids = [f"job-{k:016x}" for k in (1, 2, 3)]
    for k, save_id in enumerate(ids):
        md = _md(save_id)
        assert pickles.dumps(md) == pickle.dumps(md)
        assert pickles.reused == k  # the first pickled in full, the others from the previous bytes
    assert pickle.loads(pickles.dumps(_md(ids[0]))).storage_meta.save_id == ids[0]


def test_anything_else_that_changed_is_pickled_in_full():
    pickles = MetadataPickles()
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
    first = _md(name, sdm=named)
    assert pickle.loads(pickles.dumps(first)) == first
    md = _md("job-000000000000000a", sdm=named)
    assert pickle.loads(pickles.dumps(md)) == md and pickles.reused == 0


def test_the_id_is_rewritten_in_its_own_record_only_whatever_its_text():
    """Ids whose text could match at a record's length byte, one-character ids (CPython shares those objects),
    non-ASCII ids and a changed field besides the per-save ones: each result is that save's metadata."""
    pickles = MetadataPickles()
    for first, then in (("0" * 48, "0" * 47 + "1"), (" " * 32, "x" * 32), ("Q", "R"), ("ab\udc80cd", "ab\udc81cd"),
                        ("é" * 10, "è" * 10)):
        for save_id in (first, then):
            md = _md(save_id)
            assert pickle.loads(pickles.dumps(md)) == md, (first, then)
    sdm = {"Q": SDM["layer.0.w"]}  # a one-character id that is also a tensor's name: never renamed
    pickles.dumps(Metadata(state_dict_metadata=sdm, planner_data={"Q": ("Q",)}, storage_data={},
                           storage_meta=StorageMeta(checkpoint_id="/ram/slot-9", save_id="Q")))
    md = Metadata(state_dict_metadata=sdm, planner_data={"Q": ("Q",)}, storage_data={},
                  storage_meta=StorageMeta(checkpoint_id="/ram/slot-9", save_id="R"))
    assert pickle.loads(pickles.dumps(md)) == md
    reused = pickles.reused
    md = _md("job-00000000000000ff")
    md.version = "9.9.9"  # any other field that changed: pickled in full
    assert pickle.loads(pickles.dumps(md)).version == "9.9.9" and pickles.reused == reused
