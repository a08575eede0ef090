"""Zero-stall saves on the GPU: ``async_save(ordering="stream")`` + ``handle.wait_stream()``.

Run on the device machine (``pytest -m gpu tests/gpu/test_zero_stall_gpu.py``); skipped without CUDA.
The CPU half of the contract runs in CI (tests/dist/test_zero_stall.py).

Each test first queues a ~50 ms ``torch.cuda._sleep`` on the trainer's stream, so the save's side
stream (which waits for the trainer's stream) and the mutations queued after the call all start when
the sleep ends, whatever the Python launch latency: the race is then decided on the GPU alone. The
mutation of a 512 MiB tensor takes well under a millisecond; its copy to the host ~10 ms or more.

- with ``wait_stream()`` before a kernel chain that changes every byte of every saved tensor
  (including a "running mean" buffer written by a forward), the checkpoint holds the values of the
  save's step, bit-exact (pool and memory-tier images); a read-only "forward" before the wait overlaps;
- the negative control: the same mutation without ``wait_stream()`` lands in the checkpoint (torn),
  so the positive test would have seen it.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import cpuckpt
from cpuckpt.tier.images import ImageSet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the device machine)"),
]

CFG = {"io": {"chunk_bytes": "16MiB", "threads": 4}, "staging": {"pool_bytes": 0}, "timeout_s": 120}  # snapshot
SLEEP_CYCLES = 100_000_000  # ~50 ms at ~2 GHz


@pytest.fixture
def ram_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs (/dev/shm) where there is one (images are pinned there), else under tmp_path."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="cpuckpt-test-") as d:
            yield Path(d)
    else:
        yield tmp_path / "ram"


def _state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(3)
    return {
        "big": torch.randn(128 * 1024 * 1024, device="cuda", generator=g),  # 512 MiB
        "w": torch.randn(1024, 1024, device="cuda", generator=g),
        "bf16": torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16),
        "i64": torch.randint(0, 1 << 40, (1000,), device="cuda", generator=g),
        "running_mean": torch.randn(1024, device="cuda", generator=g),  # a buffer the "forward" writes
        "cpu": torch.arange(1000, dtype=torch.int64),
        "meta": {"step": 7},
    }


def _expected(sd: dict) -> dict:
    torch.cuda.synchronize()
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else dict(v)) for k, v in sd.items()}


def _mutate_on_stream(sd: dict) -> None:
    """A chain of kernels on the current stream: a forward that writes the buffer, then every byte of every
    GPU tensor changed (+3 on each byte: three in-place passes); the CPU tensor and the object too."""
    with torch.no_grad():
        x = sd["w"] @ sd["w"]  # "forward"
        sd["running_mean"].mul_(0.5).add_(x[:, :1].squeeze(1))  # a BatchNorm-style buffer update
        for _ in range(3):
            for k, v in sd.items():
                if isinstance(v, torch.Tensor) and v.is_cuda:
                    v.view(torch.uint8).add_(1)
    sd["cpu"].add_(1)
    sd["meta"]["step"] = -1


def _checkpoint(path: Path, like: dict) -> dict:
    dest = {k: (torch.empty_like(v, device="cpu") if isinstance(v, torch.Tensor) else {"step": -99})
            for k, v in like.items()}
    cpuckpt.load(dest, path)
    return dest


def _differing_tensors(got: dict, want: dict) -> list[str]:
    return [k for k, v in want.items()
            if isinstance(v, torch.Tensor) and not torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))]


def _cfg(window: int = 0, device_snapshot: bool = False) -> dict:
    return {**CFG, "staging": {**CFG["staging"], "d2h_window_bytes": window, "device_snapshot": device_snapshot}}


def _save_and_mutate(sd: dict, path: Path, *, order: bool, images: ImageSet | None = None,
                     window: int = 0, device_snapshot: bool = False,
                     checkpointer: cpuckpt.Checkpointer | None = None) -> cpuckpt.AsyncSaveHandle:
    save = checkpointer.async_save if checkpointer is not None else cpuckpt.async_save
    torch.cuda._sleep(SLEEP_CYCLES)  # everything below is queued before any of it runs
    h = save(sd, path, _cfg(window, device_snapshot), ordering="stream", sink=images)
    assert h.copies_on_device
    with torch.no_grad():
        _ = sd["big"].sum()  # a read-only kernel: may overlap the copies
    if order:
        h.wait_stream()
    _mutate_on_stream(sd)
    return h


@pytest.mark.parametrize("window", [0, 32 << 20], ids=["all-at-once", "windowed"])
@pytest.mark.parametrize("target", ["pool", "images"])
def test_mutations_after_wait_stream_are_not_saved(tmp_path: Path, ram_dir: Path, target: str, window: int) -> None:
    sd = _state()
    want = _expected(sd)
    images = ImageSet(ram_dir / "slot", pin=True) if target == "images" else None
    path = ram_dir / "slot" if images is not None else tmp_path / "ckpt"
    h = _save_and_mutate(sd, path, order=True, images=images, window=window)
    h.wait()
    torch.cuda.synchronize()
    mutated = _expected(sd)
    assert _differing_tensors(mutated, want) == [k for k, v in want.items() if isinstance(v, torch.Tensor)], \
        "the mutation must have changed every saved tensor (test sanity)"
    got = _checkpoint(path, want)
    assert _differing_tensors(got, want) == [], f"{target}: the checkpoint holds values written after the save"
    assert got["meta"] == {"step": 7}
    if images is not None:
        images.close()


@pytest.mark.parametrize("window", [0, 32 << 20], ids=["all-at-once", "windowed"])
@pytest.mark.parametrize("target", ["pool", "images"])
def test_device_snapshot_orders_after_the_device_copy_only(tmp_path: Path, ram_dir: Path, monkeypatch, target: str,
                                                           window: int) -> None:
    """``staging.device_snapshot``, for pool saves and memory-tier images alike (one save engine): the copies
    to the host are held back ~1 s on the side stream (a sleep queued before them, after the
    device-to-device copy); the mutation after ``wait_stream`` runs before they do (the trainer's stream
    is done while the save is not staged), and the checkpoint still holds the save's values bit-exact:
    the host copies read the snapshot. A second save of the same checkpointer reuses its device buffer,
    and closing the checkpointer frees it."""
    from cpuckpt.transfer import staging

    original = staging.DeviceCopier.enqueue

    def held_back(self, *args, **kwargs):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(20 * SLEEP_CYCLES)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(staging.DeviceCopier, "enqueue", held_back)
    images = ImageSet(ram_dir / "slot", pin=True) if target == "images" else None
    path = ram_dir / "slot" if images is not None else tmp_path / "ckpt"
    again = path if images is not None else tmp_path / "again"
    sd = _state()
    want = _expected(sd)
    ckpt = cpuckpt.Checkpointer()
    h = _save_and_mutate(sd, path, order=True, images=images, window=window, device_snapshot=True, checkpointer=ckpt)
    t0 = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    trainer_s = time.perf_counter() - t0
    staged_then = h._writer.job.staged.done()
    h.wait()
    assert trainer_s < 0.5 and not staged_then, (target, trainer_s, staged_then)
    torch.cuda.synchronize()
    assert _differing_tensors(_expected(sd), want) == [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    got = _checkpoint(path, want)
    assert _differing_tensors(got, want) == [], f"{target}: the checkpoint holds values written after the device copy"
    want2 = _expected(sd)
    ckpt.async_save(sd, again, _cfg(window, True), ordering="stream", sink=images).wait()
    assert ckpt.snapshots.allocations == 1 and len(ckpt.snapshots) == 1, "the second save allocated a buffer"
    assert _differing_tensors(_checkpoint(again, want2), want2) == []
    ckpt.close()
    assert len(ckpt.snapshots) == 0
    if images is not None:
        images.close()


@pytest.mark.parametrize("target", ["pool", "images"])
def test_a_cached_save_of_many_small_tensors_copies_from_the_snapshot(tmp_path: Path, ram_dir: Path, monkeypatch,
                                                                     target: str) -> None:
    """``staging.device_snapshot`` with cached items: a chunk of many small GPU tensors has a device fill program
    (one gather, one copy) whose pieces are views of the tensors the layout was prepared for. A save from a device
    snapshot must not gather from them: the third save's copies are held back ~1 s after its snapshot, the tensors
    change right after ``wait_stream``, and every checkpoint still holds its save's values bit-exact."""
    from cpuckpt.transfer import staging

    original = staging.DeviceCopier.enqueue
    hold = {"on": False}

    def held_back(self, *args, **kwargs):
        if hold["on"]:
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(20 * SLEEP_CYCLES)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(staging.DeviceCopier, "enqueue", held_back)
    images = ImageSet(ram_dir / "slot", pin=True) if target == "images" else None
    sd = {f"t{i}": torch.randn(64, device="cuda") for i in range(96)}  # 96 records in one chunk: a program
    ckpt = cpuckpt.Checkpointer()
    try:
        for k in range(3):  # the first plans, the second caches the items, the third uses their programs
            hold["on"] = k == 2
            path = ram_dir / "slot" if images is not None else tmp_path / f"ckpt{k}"
            want = _expected(sd)
            h = ckpt.async_save(sd, path, _cfg(0, True), ordering="stream", sink=images)
            h.wait_stream()
            with torch.no_grad():
                for v in sd.values():
                    v.add_(1000.0)  # what the next optimizer step does, ordered after the snapshot only
            h.wait()
            assert _differing_tensors(_checkpoint(path, want), want) == [], (target, k)
    finally:
        ckpt.close()
        if images is not None:
            images.close()


def test_two_checkpointers_keep_their_own_device_buffers(tmp_path: Path) -> None:
    """Two streams (two models) with ``staging.device_snapshot``: each allocates one device buffer and
    reuses it (alternating saves never take or wait for the other's), closing one frees its buffer
    only, and the other's later save reuses its own; every checkpoint bit-exact."""
    a_sd = _state()
    b_sd = {"v": torch.randn(1 << 20, device="cuda"), "meta": {"step": 1}}
    a, b = cpuckpt.Checkpointer(), cpuckpt.Checkpointer()
    try:
        for step in range(2):
            for name, sd, ckpt in (("a", a_sd, a), ("b", b_sd, b)):
                want = _expected(sd)
                ckpt.async_save(sd, tmp_path / f"{name}{step}", _cfg(0, True), ordering="stream").wait()
                assert _differing_tensors(_checkpoint(tmp_path / f"{name}{step}", want), want) == [], (name, step)
        assert (a.snapshots.allocations, b.snapshots.allocations) == (1, 1)
        assert (len(a.snapshots), len(b.snapshots)) == (1, 1)
        a.close()
        assert (len(a.snapshots), len(b.snapshots)) == (0, 1)
        want = _expected(b_sd)
        b.async_save(b_sd, tmp_path / "b-after", _cfg(0, True), ordering="stream").wait()
        assert b.snapshots.allocations == 1
        assert _differing_tensors(_checkpoint(tmp_path / "b-after", want), want) == []
    finally:
        a.close()
        b.close()


def test_without_wait_stream_the_checkpoint_is_torn(tmp_path: Path) -> None:
    """Negative control: the same mutation, not ordered after the copies, reaches the checkpoint."""
    sd = _state()
    want = _expected(sd)
    h = _save_and_mutate(sd, tmp_path / "ckpt", order=False)
    h.wait()
    got = _checkpoint(tmp_path / "ckpt", want)
    torn = _differing_tensors(got, want)
    assert "big" in torn, f"expected the unordered mutation to reach the 512 MiB tensor's copy, torn: {torn}"
    assert "cpu" not in torn and got["meta"] == {"step": 7}  # host values are snapshotted before the return


@pytest.mark.parametrize("window", [0, 32 << 20], ids=["all-at-once", "windowed"])
@pytest.mark.parametrize("target", ["pool", "images"])
def test_a_small_copy_waits_behind_the_window_not_the_save(tmp_path: Path, ram_dir: Path, target: str,
                                                          window: int) -> None:
    """``staging.d2h_window_bytes``: a trainer's small device-to-host copy (``loss.item()``) enqueued right
    after the call completes while the save's copies are still running; all at once (the control), it
    completes only after the whole save (with one hardware queue, as Megatron-LM runs (conftest.py), the
    copy engine serves every stream's device-to-host copies in enqueue order)."""
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        pytest.skip("one shared copy queue needs CUDA_DEVICE_MAX_CONNECTIONS=1 (tests/gpu/conftest.py sets it)")
    sd = _state()
    small = torch.empty(1, pin_memory=True)  # the trainer's .item(): an asynchronous copy on its stream
    images = ImageSet(ram_dir / "slot", pin=True) if target == "images" else None
    path = ram_dir / "slot" if images is not None else tmp_path / "ckpt"
    # A warm save, as in training: the first one reserves, maps and pins the images (0.3 s), or the pool.
    cpuckpt.async_save(sd, path if images is not None else tmp_path / "warm", _cfg(window), ordering="stream",
                       sink=images).wait()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(3 * SLEEP_CYCLES)  # the save's copies and the small copy queue up while this runs
    slept = torch.cuda.Event(enable_timing=True)
    slept.record()
    t0 = time.perf_counter()
    h = cpuckpt.async_save(sd, path, _cfg(window), ordering="stream", sink=images)
    small.copy_(sd["w"][0, :1], non_blocking=True)
    call_ms = 1000 * (time.perf_counter() - t0)
    done_small = torch.cuda.Event()
    done_small.record()
    # A trainer ticks while it waits for its copy (module calls; here cpuckpt.tick): a host that made no tick for 0.1 s
    # would have the pacer's watch enqueue the rest of the save (its idle drain), which the sleep outlasts.
    while not done_small.query():
        cpuckpt.tick()
        time.sleep(0.002)
    sleep_ms = start.elapsed_time(slept)
    fence = h._writer.job.fence
    enqueued_all = fence._final.is_set()
    copied_all = None if window else fence.event.query()  # all at once: the event is set by the call
    h.wait_stream()
    h.wait()
    assert call_ms < sleep_ms, f"the call ({call_ms:.0f} ms) outlasted the sleep ({sleep_ms:.0f} ms): nothing queued"
    if window:
        assert not enqueued_all, "the whole save was enqueued before the small copy completed"
    else:
        assert copied_all, "the small copy completed before the save's copies: no shared queue here"
    assert float(small[0]) == float(_expected(sd)["w"][0, 0])
    if images is not None:
        images.close()


@pytest.mark.parametrize("target", ["pool", "images"])
def test_paced_copies_go_at_the_trainers_module_calls(tmp_path: Path, ram_dir: Path, target: str) -> None:
    """``staging.d2h_window_bytes``: the call enqueues one piece; the model's forward and backward enqueue
    the others, one per module call or output gradient once the piece before is done (``transfer.pacing``);
    ``wait_stream()`` enqueues what is left; the checkpoint is the save's step, bit-exact."""
    from cpuckpt.transfer.pacing import PACER

    sd = _state()
    want = _expected(sd)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)]).cuda()
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    images = ImageSet(ram_dir / "slot", pin=True) if target == "images" else None
    path = ram_dir / "slot" if images is not None else tmp_path / "ckpt"
    cpuckpt.async_save(sd, path if images is not None else tmp_path / "warm", _cfg(32 << 20), ordering="stream",
                       sink=images).wait()  # warm: the images or the pool exist
    torch.cuda.synchronize()
    before = PACER.pieces
    h = cpuckpt.async_save(sd, path, _cfg(32 << 20), ordering="stream", sink=images)
    at_call = PACER.pieces - before
    for _ in range(3):
        model(x).sum().backward()
        torch.cuda.synchronize()  # as a trainer's .item(): the piece in flight completes, the next tick goes
    by_ticks = PACER.pieces - before
    h.wait_stream()
    _mutate_on_stream(sd)
    h.wait()
    pieces = PACER.pieces - before
    assert at_call == 1, f"the call enqueued {at_call} pieces, not one"
    assert by_ticks > 3, f"forward/backward ticks enqueued only {by_ticks - at_call} pieces"
    assert pieces >= 512 // 32, f"{pieces} pieces of 32 MiB for >= 512 MiB of copies"
    assert not PACER.pending and not torch.nn.modules.module._global_forward_hooks
    got = _checkpoint(path, want)
    assert _differing_tensors(got, want) == [], f"{target}: the checkpoint holds values written after the save"
    if images is not None:
        images.close()
