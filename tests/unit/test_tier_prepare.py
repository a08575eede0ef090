"""The memory tier prepares the other slots' images after the first save (memory.prepare_slots), or every
slot's before it (``MemoryTier.reserve``).

Single process, real RAM-root files (persist_every 0: no writer process is started); the images are checked directly.
"""

from __future__ import annotations

import os
import time
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


def _loaded_step(path: Path) -> int:
    """The step of the checkpoint at ``path``, after checking its tensors are that step's, bit-exact."""
    out = {"w": torch.empty(256, 129), "b": torch.empty(77), "step": -1}
    cpuckpt.load(out, path)
    want = _state(out["step"])
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"]), f"{path}: step {out['step']}"
    return out["step"]


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
        assert _loaded_step(tier.find_latest()) == 3
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
            assert _loaded_step(tier.slots[j]) in (2, 3)
    finally:
        tier.close(persist_newest=False)


def _big(step: int) -> dict:
    """4 MiB of state: past the 2 MiB a small reservation maps."""
    return {"w": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(step)), "step": step}


def test_slots_reserved_before_the_first_save_are_used_without_mapping_again(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    try:
        assert tier.reserve(1 << 20) == 3  # an over-estimate of the shard: every slot's image, before any save
        reserved = [images.get(f"__{tier.rank}_0.distcp") for images in tier.images]
        assert all(img is not None and img.nbytes == 1 << 20 and img.remaps == 1 for img in reserved)
        for step in (1, 2, 3, 4):
            tier.save(_state(step), step).wait()
        for images, img in zip(tier.images, reserved):
            assert images.names == [img.path.name] and images.get(img.path.name) is img
            assert img.remaps == 1, f"{img.path}: the first save mapped its reserved image again"
            assert img.nbytes < 1 << 20 and os.stat(img.path).st_size == img.nbytes  # truncated to the save's size
        assert _loaded_step(tier.find_latest()) == 4
    finally:
        tier.close(persist_newest=False)


def test_an_under_estimate_is_mapped_again_and_a_reserved_name_no_save_uses_is_removed(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    try:
        assert tier.reserve(4096) == 3
        assert tier.images[1].reserve("__7_0.distcp", 8192)  # a name the saves of this rank never use
        stray = tier.images[1].get("__7_0.distcp").path
        for step in (1, 2):
            tier.save(_big(step), step).wait()
        own = tier.images[0].get(f"__{tier.rank}_0.distcp")
        assert own.remaps == 2 and own.nbytes > 4 << 20  # too small: the first save grew it
        deadline = time.monotonic() + 10  # removed by the commit's callback (it may run just after wait() returns)
        while stray.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier.images[1].names == [f"__{tier.rank}_0.distcp"] and not stray.exists()
        out = {"w": torch.empty(1024, 1024), "step": -1}
        cpuckpt.load(out, tier.find_latest())
        assert out["step"] == 2 and torch.equal(out["w"], _big(2)["w"])
    finally:
        tier.close(persist_newest=False)


def test_a_slot_holding_a_checkpoint_is_not_reserved_over(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    try:
        tier.save(_state(1), 1).wait()
        size = os.stat(tier.slots[0] / f"__{tier.rank}_0.distcp").st_size
        assert tier.reserve(1 << 20) == 2  # slots 1 and 2 only
        assert os.stat(tier.slots[0] / f"__{tier.rank}_0.distcp").st_size == size
        assert _loaded_step(tier.slots[0]) == 1
    finally:
        tier.close(persist_newest=False)


def test_the_preparation_after_the_first_save_resizes_reserved_images_to_its_size(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=True))
    try:
        assert tier.reserve(4096) == 3  # an under-estimate
        tier.save(_big(1), 1).wait()
        assert tier.wait_prepared(30)
        name = f"__{tier.rank}_0.distcp"
        size = tier.images[0].get(name).nbytes
        assert [images.get(name).nbytes for images in tier.images] == [size] * 3  # not left at the estimate
        remaps = [images.get(name).remaps for images in tier.images]
        for step in (2, 3):
            tier.save(_big(step), step).wait()
        assert [images.get(name).remaps for images in tier.images] == remaps, "a later save mapped its image again"
    finally:
        tier.close(persist_newest=False)


def test_images_reserved_ahead_are_kept_for_every_job_of_a_save_and_only_before_the_first_claim(tmp_path):
    """A DeepSpeed tag's files are one job each: the first file's claim keeps the other file's reservation (its
    image is the one the second job fills); leftovers go at the slot's commit; nothing is reserved once a job
    claimed, nor after close."""
    import concurrent.futures as cf

    from cpuckpt.tier.images import ImageSet

    images = ImageSet(tmp_path / "slot", pin=False)
    try:
        assert images.reserve("model.pt", 8192) and images.reserve("optim.pt", 8192) and images.reserve("x.pt", 64)
        optim = images.get("optim.pt")
        done = cf.Future()
        assert images.claim(done, ["model.pt"]) == []
        assert images.get("optim.pt") is optim and optim.path.exists()  # not dropped by the model file's claim
        assert not images.reserve("later.pt", 4096)  # a job claimed: from now on the jobs make their own images
        assert images.claim(cf.Future(), ["optim.pt"]) == []
        images.drop_unclaimed()  # the slot's commit: every job of the save claimed by now
        assert sorted(images.names) == ["model.pt", "optim.pt"] and not (tmp_path / "slot" / "x.pt").exists()
        assert images.get("optim.pt") is optim and optim.path.exists()
    finally:
        images.close()
    assert not images.reserve("after.pt", 4096) and not images.prepare("after.pt", 4096)  # closed: nothing made
    assert not (tmp_path / "slot" / "after.pt").exists()


def test_reserve_files_makes_every_free_slots_named_images_and_a_closed_tier_none(tmp_path):
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    try:
        assert tier.reserve_files({"a.pt": 1 << 20, "b.pt": 4096}) == 6
        assert [sorted(images.names) for images in tier.images] == [["a.pt", "b.pt"]] * 3
        assert tier.reserve_files({"a.pt": 1 << 20}) == 0  # there already
    finally:
        tier.close(persist_newest=False)
    assert tier.reserve_files({"d.pt": 4096}) == 0  # closed: nothing made


def test_a_relaunch_that_reserves_files_still_prepares_the_slots_holding_checkpoints(tmp_path):
    """The reservation skips committed slots: only the post-commit preparation maps a full ring's files."""
    cfg = _cfg(tmp_path, prepare=True)
    tier = MemoryTier(tmp_path / "durable", cfg)
    for step in (1, 2, 3):
        tier.save(_state(step), step).wait()
    tier.close(persist_newest=False, remove_root=False)

    tier = MemoryTier(tmp_path / "durable", cfg)  # the relaunch: every slot holds a committed checkpoint
    try:
        name = f"__{tier.rank}_0.distcp"
        assert tier.reserve_files({name: 1 << 20}) == 0  # every slot holds a checkpoint
        tier.save(_state(4), 4).wait()
        assert tier.wait_prepared(30)
        saved = tier.slots.index(tier.find_latest())
        for j, images in enumerate(tier.images):
            assert images.names == [name], f"slot {j} was not prepared after the relaunch's first save"
            if j != saved:
                assert _loaded_step(tier.slots[j]) in (2, 3)
    finally:
        tier.close(persist_newest=False)


def test_a_failed_reservation_leaves_no_file(tmp_path, monkeypatch):
    """A reservation that fails after creating its file (here: ENOSPC) removes it: no stray file in the slot."""
    import errno

    from cpuckpt.tier import images as images_mod

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    try:
        with monkeypatch.context() as m:
            m.setattr(images_mod.os, "posix_fallocate", no_space)
            assert tier.reserve_files({"model.pt": 1 << 20}) == 0  # a warning: the saves make the images
        assert [images.names for images in tier.images] == [[]] * 3
        assert not any(p.is_file() for slot in tier.slots if slot.exists() for p in slot.iterdir())
        tier.save(_state(1), 1).wait()
        assert "model.pt" not in os.listdir(tier.slots[0]) and _loaded_step(tier.find_latest()) == 1
    finally:
        tier.close(persist_newest=False)


def test_images_reserved_and_never_claimed_are_removed_at_exit(tmp_path, monkeypatch):
    """A job that fails before its first save leaves no reserved image behind (they hold no checkpoint)."""
    import atexit

    at_exit: list = []
    monkeypatch.setattr(atexit, "register", at_exit.append)
    monkeypatch.setattr(atexit, "unregister", lambda fn: at_exit.remove(fn) if fn in at_exit else None)
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    try:
        assert tier.reserve_files({"model.pt": 1 << 20}) == 3 and len(at_exit) == 1
        at_exit[0]()  # the exit handler, as the interpreter would run it
        assert [images.names for images in tier.images] == [[]] * 3
        assert not any((slot / "model.pt").exists() for slot in tier.slots)
    finally:
        tier.close(persist_newest=False)
    assert at_exit == []  # a closed tier leaves nothing to the exit
    assert tier.reserve_files({"model.pt": 1 << 20}) == 0 and at_exit == []  # nor does a reservation after it


def test_a_close_that_keeps_the_ram_root_removes_the_images_no_save_claimed(tmp_path):
    """The RAM root stays (``remove_root=False``, or an agreed failure) for the checkpoints in it; images reserved and
    never claimed hold none and go, the checkpoint's own image stays."""
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    name = f"__{tier.rank}_0.distcp"
    try:
        assert tier.reserve_files({name: 1 << 20, "spare.pt": 4096}) == 6
        tier.save(_state(1), 1).wait()
    finally:
        tier.close(persist_newest=False, remove_root=False)
    left = sorted(str(p.relative_to(tier.root.path)) for p in tier.root.path.rglob("*") if p.is_file()
                  and p.parent in tier.slots and not p.name.startswith("."))
    assert left == [f"slot-0/{name}"], left  # the checkpoint's data; slots 1 and 2 and the spare image are gone
    assert _loaded_step(tier.slots[0]) == 1


def test_slots_that_do_not_all_fit_are_reserved_as_many_as_fit(tmp_path, monkeypatch, caplog):
    """One after the other until the RAM filesystem's limit (a warning, no half-made image): here room for two of
    three."""
    from cpuckpt.tier import ramroot

    size = 4 << 20
    ram = tmp_path / "ram"

    def space(path):  # a filesystem with room for 2.5 images besides what the RAM root holds
        used = sum(p.stat().st_blocks * 512 for p in ram.rglob("*") if p.is_file())
        return 1 << 40, int(2.5 * size) - used

    monkeypatch.setattr(ramroot, "_space", space)
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    name = f"__{tier.rank}_0.distcp"
    try:
        assert tier.reserve(size) == 2
        assert [images.names for images in tier.images] == [[name], [name], []]
        assert not (tier.slots[2] / name).exists() and "ahead of the first save failed" in caplog.text
    finally:
        tier.close(persist_newest=False)


def test_a_reserved_image_that_cannot_be_removed_is_a_warning_and_the_close_goes_on(tmp_path, monkeypatch, caplog):
    """Removing an unclaimed image is housekeeping: a failure is logged, the close (collective) goes on."""
    import errno
    from pathlib import Path

    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.name == "spare.pt":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_unlink(self, missing_ok=missing_ok)

    assert tier.reserve_files({"spare.pt": 4096}) == 3
    monkeypatch.setattr(Path, "unlink", unlink)
    tier.close(persist_newest=False)  # does not raise
    assert "removing it failed" in caplog.text and not tier.root.path.exists()  # the rest removed all the same


def test_the_images_pages_are_allocated_side_by_side_and_a_failure_leaves_no_stray_file(tmp_path, monkeypatch,
                                                                                        caplog):
    """Every file's pages allocated on threads of their own first (no CUDA there), mapped and pinned after on the
    caller's thread; where slot 1's file cannot be allocated, slot 0 keeps its image, and neither slot 1 nor slot 2
    is left with a file no image took."""
    import errno
    import threading

    real = os.posix_fallocate
    threads, full = set(), []

    def fallocate(fd, offset, length):
        threads.add(threading.current_thread().name.split("_")[0])
        if full and "/slot-1/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    name = f"__{tier.rank}_0.distcp"
    try:
        assert tier.reserve_files({name: 1 << 20}) == 3 and "cpuckpt-allocate" in threads  # all fine
        for images in tier.images:
            images.drop_unclaimed()
        assert not any((slot / name).exists() for slot in tier.slots)
        full.append(True)
        assert tier.reserve_files({name: 1 << 20}) == 1  # slot 0; slot 1 fails (a warning) and stops it
        assert "ahead of the first save failed" in caplog.text
        assert [images.names for images in tier.images] == [[name], [], []]
        assert (tier.slots[0] / name).exists() and not (tier.slots[1] / name).exists()
        assert not (tier.slots[2] / name).exists()  # allocated ahead, not taken: removed
    finally:
        tier.close(persist_newest=False)


def test_an_interrupt_while_the_pages_are_allocated_ahead_leaves_no_file_and_is_raised(tmp_path, monkeypatch):
    """A Ctrl-C (here raised by the third file's allocation) stops the files not started, removes those made, and
    reaches the caller; the next reservation makes every image."""
    import threading

    import pytest

    from cpuckpt.tier.images import AllocatedAhead

    real = AllocatedAhead._make
    calls = []

    def make(self, path, images, nbytes):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, path, images, nbytes)

    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    name = f"__{tier.rank}_0.distcp"
    try:
        with monkeypatch.context() as m:
            m.setattr(AllocatedAhead, "_make", make)
            with pytest.raises(KeyboardInterrupt):
                tier.reserve_files({name: 1 << 20, "b.pt": 1 << 20})
        for thread in threading.enumerate():  # a file still allocated at the interrupt is its own thread's to remove
            if thread.name.startswith("cpuckpt-allocate"):
                thread.join(timeout=30)
        assert [images.names for images in tier.images] == [[], [], []]
        assert not [p for slot in tier.slots for p in slot.iterdir() if not p.name.startswith(".")]
        assert tier.reserve_files({name: 1 << 20, "b.pt": 1 << 20}) == 6
    finally:
        tier.close(persist_newest=False)


def test_a_file_still_allocated_at_an_interrupt_is_removed_by_its_own_thread(tmp_path, monkeypatch):
    """The interrupt (here raised where the caller waits for the allocations) does not wait for an allocation in
    progress (an unlink would, behind tmpfs's inode lock): the thread removes its file once its allocation ends, and
    the reservation never takes it."""
    import concurrent.futures as cf
    import threading

    import pytest

    real_fallocate, real_result = os.posix_fallocate, cf.Future.result
    started, release = threading.Event(), threading.Event()

    def slow(fd, offset, length):
        if "/slot-0/" in os.readlink(f"/proc/self/fd/{fd}"):
            started.set()
            release.wait(30)
        return real_fallocate(fd, offset, length)

    def result(self, timeout=None):  # Ctrl-C while the caller waits, once slot 0's file is being allocated
        if started.wait(30) and not release.is_set():
            raise KeyboardInterrupt
        return real_result(self, timeout)

    tier = MemoryTier(tmp_path / "durable", _cfg(tmp_path, prepare=False))
    name = f"__{tier.rank}_0.distcp"
    try:
        with monkeypatch.context() as m:
            m.setattr(os, "posix_fallocate", slow)
            m.setattr(cf.Future, "result", result)
            with pytest.raises(KeyboardInterrupt):
                tier.reserve_files({name: 1 << 20})
            assert (tier.slots[0] / name).exists()  # still being allocated: left to its thread
            release.set()
            for t in [t for t in threading.enumerate() if t.name.startswith("cpuckpt-allocate")]:
                t.join(30)
        assert not [p for slot in tier.slots for p in slot.iterdir() if not p.name.startswith(".")]
        assert [images.names for images in tier.images] == [[], [], []]
    finally:
        release.set()
        tier.close(persist_newest=False)
