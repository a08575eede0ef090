"""The memory tier prepares the other slots' images after the first save (memory.prepare_slots).

Single process, real RAM-root files (persist_every 0: no writer process is started); the images are checked directly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import cpuckpt
from cpuckpt.tier.memory import MemoryTier


def _cfg(tmp_path: Path, prepare: bool) -> dict:
    return {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 30,
            "memory": {"root": str(tmp_path / "ram"), "persist_every": 0, "slots": 3, "headroom_bytes": 0,
                       "prepare_slots": prepare}}


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 129, generator=g), "b": torch.randn(77, generator=g), "step": step}


def test_after_the_first_save_the_other_slots_images_exist_and_later_saves_do_not_grow_them(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=True))
    try:
        tier.save(_state(1), 1).wait()
        assert tier.wait_prepared(30)
        first = {n: tier.images[0].get(n).nbytes for n in tier.images[0].names}
        assert first, "the first save made no image"
        for images in tier.images[1:]:
            assert {n: images.get(n).nbytes for n in images.names} == first, images.directory
        def mappings() -> list[tuple[int, int, int]]:  # where each prepared image is mapped, and its size
            return [(images.get(n).tensor().data_ptr(), images.get(n).capacity, os.stat(images.get(n).path).st_size)
                    for images in tier.images[1:] for n in images.names]

        made = mappings()
        for step in (2, 3):
            tier.save(_state(step), step).wait()
        assert mappings() == made, "a later save grew (mapped again) a prepared image"
        out = {"w": torch.empty(256, 129), "b": torch.empty(77), "step": -1}
        cpuckpt.load(out, tier.find_latest())
        want = _state(3)
        assert out["step"] == 3 and torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
    finally:
        tier.close(persist_newest=False)


def test_without_prepare_slots_only_saved_slots_have_images(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    try:
        tier.save(_state(1), 1).wait()
        assert tier.wait_prepared(1)  # nothing is being prepared
        assert tier.images[0].names and not tier.images[1].names and not tier.images[2].names
    finally:
        tier.close(persist_newest=False)


def test_a_failed_before_fill_is_an_error_and_the_slot_is_untouched(tmp_path):
    from cpuckpt.errors import CpuckptError

    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    try:
        tier.save(_state(1), 1).wait()

        def refuse(slot: Path) -> None:
            raise OSError(f"cannot name {slot}")

        with pytest.raises(CpuckptError, match=r"preparing .*slot-1.* for step 2 failed: cannot name"):
            tier.save(_state(2), 2, before_fill=refuse)
        assert not (tier.slots[1] / ".metadata").exists() and tier.find_latest() == tier.slots[0]
        assert tier.wait_prepared(1)  # prepare_slots off: nothing to wait for
    finally:
        tier.close(persist_newest=False)


def test_after_a_restart_the_first_save_prepares_the_slots_holding_older_checkpoints_untouched(tmp_path):
    """A relaunch finds the ring full of complete checkpoints: after its first save, the other slots' files
    (already of the right sizes) are mapped here ahead of the saves that will reuse them, and each still holds
    its checkpoint, bit-exact."""
    from cpuckpt.backend.committed import check_complete

    cfg = _cfg(tmp_path, prepare=True)
    tier = MemoryTier(tmp_path / "durable", cfg)
    for step in (1, 2, 3):
        tier.save(_state(step), step).wait()
    tier.close(persist_newest=False, remove_root=False)

    tier = MemoryTier(tmp_path / "durable", cfg)  # the relaunch: a new tier over the same RAM root
    try:
        assert all(not images.names for images in tier.images), "a new process has mapped nothing yet"
        handle = tier.save(_state(4), 4)
        handle.wait()
        assert tier.wait_prepared(30)
        saved = next(j for j, images in enumerate(tier.images) if images.names and tier.slots[j] == tier.find_latest())
        names = set(tier.images[saved].names)
        for j, images in enumerate(tier.images):
            if j == saved:
                continue
            assert set(images.names) == names, f"slot {j} was not prepared after the relaunch's first save"
            assert check_complete(tier.slots[j]).complete, f"preparing slot {j} changed its checkpoint"
            out = {"w": torch.empty(256, 129), "b": torch.empty(77), "step": -1}
            cpuckpt.load(out, tier.slots[j])
            want = _state(out["step"])
            assert out["step"] in (2, 3) and torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
    finally:
        tier.close(persist_newest=False)
