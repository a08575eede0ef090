"""DeepSpeed adapter: zero-stall saves (``ordering: optimizer``) and the warm first save (``prepare_pool``).

One real 2-rank gloo run (DeepSpeed 0.19, ZeRO-2 fp32: the step copies the fp32 partitions into
the module's parameters; a model with a BatchNorm whose running statistics the forward writes)
proves, end to end:

- real path (CPU: the state is frozen at the call, its CPU tensors cloned, and laid out and staged by
  the stager thread after it): the step after the save changes every saved tensor (parameters,
  BatchNorm buffers, fp32 master partitions, Adam moments and step), and the committed files hold the
  save-step values bit-exact;
- simulated device copies: every job gets a fence whose ``order`` is a host wait for its staging
  (what ``cudaStreamWaitEvent`` does on the GPU, done on the host), and every chunk's host copy is
  held until a fence is ordered (no time window: a copy goes on unordered only after ``HOLD_LIMIT_S``).
  ``save_checkpoint`` then returns while no byte is copied (the file still being laid out, or its copies
  enqueued), the next forward writes the BatchNorm buffers and the next step updates everything while
  copies are pending, and the files still hold the save-step values bit-exact: the buffers were cloned at
  save time, and the hook ordered the fences before the optimizer's first write (the recorded events show
  the order). A ``load`` while copies are pending returns only once they are done;
- ``prepare_pool``: no pool before the first optimizer step; after it, a pool at least as large as
  the rank's checkpoint files; the first save uses that very pool (not replaced, not grown).

Unit tests (one process) cover the hook's placement (boundary / non-boundary / ``_take_model_step``),
``order_pending`` with fake fences, ``snapshot_buffers``, the size estimate, ``freeze`` (the copy
``torch.save`` writes the state of the call from, after the state changed) and a deferred save (laid out
after the call, after the state changed: the file holds the call's values; a failure of its layout
raised by its commit, ``latest`` left alone).

On the device machine (``pytest -m gpu``; skipped without CUDA), one in-process DeepSpeed engine (NCCL,
world 1) with real fences: every device-to-host copy is delayed ~50 ms on its side stream (a
``torch.cuda._sleep`` queued there first), so the step after the save writes every saved tensor
while the copies have not started. Ordered: the files hold the save-step values bit-exact. Negative
control (ordering disabled): the optimizer's writes land in the files, and only the cloned buffers
are spared, so the positive run would have seen a race.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("deepspeed")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ranks load this file by path, too
from test_deepspeed import _tensors

HOLD_LIMIT_S = 60.0  # a held chunk copy goes on unordered after this long: a save() that waited for one took as long


# ----------------------------------------------------------------------------------- rank side
def _setup_env() -> None:
    import deepspeed.ops
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of an inference-only op
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29556")


def _engine():
    import deepspeed
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.bn = torch.nn.BatchNorm1d(16)  # running_mean/var, num_batches_tracked: written by the forward
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.bn(self.fc1(x))))

    torch.manual_seed(0)
    model = Net()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": 2},
           "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _step(engine, k: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 + k * 7 + engine.global_rank)
    x = torch.randn(4, 8, generator=g)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()


def _live(engine) -> dict:
    """What the files hold, cloned now: the module state dict and this rank's ZeRO optimizer state."""
    return {k: v.detach().to("cpu", copy=True) for k, v in _tensors({"module": engine.module.state_dict(),
                                                                     "optim": engine.optimizer.state_dict()}).items()}


def _same(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _compare_files(tag_dir: Path, rank: int, saved: dict) -> list[str]:
    """Keys whose bytes in the files differ from ``saved`` (empty: bit-exact)."""
    import torch
    from cpuckpt.integrations.deepspeed.engine import safe_globals_for_deepspeed

    with torch.serialization.safe_globals(safe_globals_for_deepspeed()):
        optim = torch.load(next(tag_dir.glob(f"*_pp_rank_{rank}_mp_rank_00_optim_states.pt")), weights_only=True)
        found = _tensors({"optim": optim["optimizer_state_dict"]})
        if rank == 0:
            found.update(_tensors({"module": torch.load(tag_dir / "mp_rank_00_model_states.pt",
                                                        weights_only=True)["module"]}))
    want = {k: v for k, v in saved.items() if rank == 0 or not k.startswith("/module")}
    bad = sorted(want.keys() ^ found.keys())
    return bad + [k for k in want.keys() & found.keys() if not _same(want[k], found[k])]


class _HostFence:
    """Stands in for a ``CopyFence`` on CPU: ``order`` lets the held copies go on (``release``) and is a host wait
    for the job's staging."""

    def __init__(self, job, events: list[str], release) -> None:
        self.job = job
        self.events = events
        self.release = release

    def order(self, stream=None) -> None:
        self.events.append("fence.order")
        self.release()
        self.job.wait_staged()


def rank_zero_stall(root: str) -> dict:
    _setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    import cpuckpt.transfer.save_job as save_job
    from cpuckpt.transfer import staging

    rank = dist.get_rank()
    ckpt_ds.install({"ordering": "optimizer", "io": {"backend": "buffered", "chunk_bytes": 64 * 1024}})
    engine = _engine()
    ck = engine.checkpoint_engine
    out: dict = {"pool_before_step": staging.pool_state()[0]}
    _step(engine, 0)
    assert ck._preparer is not None, "no pool preparation after the first optimizer step"
    ck._preparer.join()
    pool = staging._POOL
    out.update(prepared=ck.prepared_bytes, pool_after_step=staging.pool_state()[0])
    _step(engine, 1)

    # -- A: the real path -------------------------------------------------------------------------
    save_dir = Path(root) / "ckpt"
    saved = _live(engine)
    out["keys"] = sorted(saved)
    engine.save_checkpoint(str(save_dir), tag="a")
    out["pool_after_save"] = staging.pool_state()[0]
    out["same_pool"] = staging._POOL is pool
    _step(engine, 2)
    live = _live(engine)
    out["a_unchanged"] = sorted(k for k in saved if _same(saved[k], live[k]))
    ckpt_ds.commit_pending(engine)
    out["a_mismatch"] = _compare_files(save_dir / "a", rank, saved)
    out["a_bytes"] = sum(p.stat().st_size for p in (save_dir / "a").glob("*.pt")
                         if p.name.endswith(f"pp_rank_{rank}_mp_rank_00_optim_states.pt")
                         or (rank == 0 and p.name == "mp_rank_00_model_states.pt"))

    # -- B: simulated device copies (fenced, held until ordered) -----------------------------------
    events: list[str] = []
    gate = [threading.Event()]  # the current phase's: every chunk's host copy waits for it
    original_start, original_fill = save_job.SaveJob.start, save_job.fill_chunk
    opt = engine.optimizer
    original_step = opt.step

    def start(self) -> None:
        original_start(self)
        if self.fence is None:
            self.fence = _HostFence(self, events, lambda: gate[0].set())

    def slow_fill(*args, **kwargs):
        gate[0].wait(HOLD_LIMIT_S)
        return original_fill(*args, **kwargs)

    def optimizer_step(*args, **kwargs):
        events.append("optimizer.step")
        return original_step(*args, **kwargs)

    save_job.SaveJob.start, save_job.fill_chunk, opt.step = start, slow_fill, optimizer_step
    try:
        saved = _live(engine)
        engine.save_checkpoint(str(save_dir), tag="b")
        out["b_save_s"] = ck.last_save_s  # one file's save() call
        out["b_pending"] = len(ck._staging) + len(ck._unordered)  # being laid out, or copies enqueued
        out["b_staged_at_return"] = bool(ck._jobs) and all(j.staged.done() for j in list(ck._jobs))
        events.append("saved")
        _step(engine, 3)  # forward writes the BatchNorm buffers while the copies are pending
        live = _live(engine)
        out["b_unchanged"] = sorted(k for k in saved if _same(saved[k], live[k]))
        ckpt_ds.commit_pending(engine)
        out["b_events"] = list(events)
        out["b_mismatch"] = _compare_files(save_dir / "b", rank, saved)

        # a load while copies are pending waits for them (held again: only the load's ordering lets them go on)
        gate[0] = threading.Event()
        engine.save_checkpoint(str(save_dir), tag="c")
        pending = len(ck._staging) + len(ck._unordered)
        ck.load(str(next((save_dir / "b").glob(f"*_pp_rank_{rank}_mp_rank_00_optim_states.pt"))))
        out["c_pending_before_load"] = pending
        out["c_staged_after_load"] = all(j.staged.done() for j in ck._jobs) and not ck._unordered \
            and not ck._staging
        ckpt_ds.commit_pending(engine)
    finally:
        gate[0].set()
        save_job.SaveJob.start, save_job.fill_chunk, opt.step = original_start, original_fill, original_step
    engine.destroy()
    ckpt_ds.uninstall()
    dist.barrier()
    return out


# ------------------------------------------------------------------------------------ the run
@pytest.fixture(scope="module")
def zero_stall_run(rank_runner, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds_zero_stall")
    # The gloo ranks train on the CPU everywhere, also on a GPU machine (2 ranks, maybe 1 GPU): DeepSpeed
    # picks its accelerator when imported, so the ranks get it from their environment.
    return rank_runner(2, rank_zero_stall, str(tmp), tmp_path=tmp, timeout_s=240, env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.xdist_group("ds_zero_stall_run")  # one training run (module fixture) for the three, not one per worker
def test_optimizer_ordering_real_path_keeps_the_save_step(zero_stall_run):
    for r in zero_stall_run:
        assert {"/module/bn.running_mean", "/module/bn.num_batches_tracked", "/module/fc1.weight"} <= set(r["keys"])
        assert r["a_unchanged"] == [], f"the step after the save left saved tensors unchanged: {r['a_unchanged']}"
        assert r["a_mismatch"] == [], f"checkpoint differs from the save-step values: {r['a_mismatch']}"


@pytest.mark.xdist_group("ds_zero_stall_run")  # one training run (module fixture) for the three, not one per worker
def test_optimizer_ordering_with_pending_copies_keeps_the_save_step(zero_stall_run):
    for rank, r in enumerate(zero_stall_run):
        assert r["b_staged_at_return"] is False and r["b_pending"] >= 1, "save() waited for its copies"
        assert r["b_save_s"] < HOLD_LIMIT_S, r["b_save_s"]  # returned while its copies were held
        assert r["b_unchanged"] == [], r["b_unchanged"]
        assert r["b_mismatch"] == [], f"rank {rank}: the step raced the pending copies: {r['b_mismatch']}"
        ev = r["b_events"]
        after = ev[ev.index("saved"):]
        assert "optimizer.step" in after and "fence.order" in after, ev
        assert after.index("fence.order") < after.index("optimizer.step"), f"optimizer wrote before ordering: {ev}"
        assert r["c_pending_before_load"] >= 1 and r["c_staged_after_load"], r


@pytest.mark.xdist_group("ds_zero_stall_run")  # one training run (module fixture) for the three, not one per worker
def test_prepare_pool_before_the_first_save(zero_stall_run):
    for r in zero_stall_run:
        assert r["pool_before_step"] == 0, "a pool existed before the engine stepped (test isolation)"
        assert r["prepared"] and r["pool_after_step"] >= r["prepared"], r
        assert r["prepared"] >= r["a_bytes"] > 0, r
        assert r["same_pool"] and r["pool_after_save"] == r["pool_after_step"], "the first save replaced the pool"


# ------------------------------------------------------------------------------- one process
class _FakeFence:
    def __init__(self, log: list) -> None:
        self.log = log

    def order(self, stream=None) -> None:
        self.log.append(("order", stream))


def _fake_job(log: list) -> SimpleNamespace:
    return SimpleNamespace(fence=_FakeFence(log))


def test_step_hooks_order_before_the_optimizer_writes():
    from cpuckpt.integrations.deepspeed.zero_stall import order_engine_steps

    log: list = []

    class Engine:
        def __init__(self, boundary: bool, managed: bool = True) -> None:
            self.boundary, self.managed = boundary, managed

        def is_gradient_accumulation_boundary(self) -> bool:
            return self.boundary

        def managed_gradient_accumulation(self) -> bool:
            return self.managed

        def step(self) -> None:
            log.append("step")
            if self.is_gradient_accumulation_boundary() or not self.managed:
                self._take_model_step(None)

        def _take_model_step(self, lr_kwargs) -> None:
            log.append("optimizer")

    class Ck:
        def __init__(self) -> None:
            self.pending = 0

        def bind(self, engine) -> None:
            log.append("bind")

        def before_optimizer_writes(self, engine) -> int:
            log.append(f"order{self.pending}")
            n, self.pending = self.pending, 0
            return n

        def after_optimizer_step(self, engine) -> None:
            log.append("after")

        def after_boundary_step(self, engine) -> None:
            log.append("stepped")

    assert order_engine_steps(Engine) == ["step", "_take_model_step"]
    assert order_engine_steps(Engine) == ["step", "_take_model_step"]  # idempotent: wrapped once
    e = Engine(boundary=False)
    e.checkpoint_engine = Ck()
    e.step()
    assert log == ["bind", "step"], "a managed non-boundary step must not order (nothing saved is written)"
    log.clear()
    e.boundary, e.checkpoint_engine.pending = True, 2
    e.step()
    assert log == ["bind", "order2", "step", "bind", "order0", "optimizer", "after", "stepped"], log
    log.clear()
    e._take_model_step(None)  # the pipeline engine's direct call
    assert log == ["bind", "order0", "optimizer", "after"], log
    log.clear()
    u = Engine(boundary=False, managed=False)  # unmanaged accumulation: every step() is a boundary
    u.checkpoint_engine = Ck()
    u.step()
    assert log[:3] == ["bind", "order0", "step"], log
    log.clear()
    plain = Engine(boundary=True)
    plain.checkpoint_engine = object()  # another checkpoint engine: the hooks do nothing
    plain.step()
    assert log == ["step", "optimizer"], log


def test_order_pending_orders_each_fence_once(tmp_path):
    from cpuckpt.integrations.deepspeed.engine import CpuckptCheckpointEngine

    log: list = []
    ck = CpuckptCheckpointEngine({"ordering": "optimizer", "prepare_pool": False})
    ck._unordered = [_fake_job(log), _fake_job(log), SimpleNamespace(fence=None)]
    assert ck.before_optimizer_writes() == 3
    assert log == [("order", None), ("order", None)]
    assert ck.order_pending("s") == 0 and len(log) == 2, "a fence was ordered twice"
    ck._unordered = [_fake_job(log)]
    ck.wait()  # no background commit: wait() still orders (and settles) pending copies
    assert log[-1] == ("order", None) and ck._unordered == []


def test_snapshot_buffers_clones_buffers_only():
    import collections

    import torch
    from cpuckpt.integrations.deepspeed.zero_stall import buffer_pointers, snapshot_buffers

    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sd = m.state_dict()
    state = {"module": sd, "buffer_names": ["1.running_mean", "1.running_var", "1.num_batches_tracked"],
             "optimizer": None}
    out = snapshot_buffers(state, set())  # by name (DeepSpeed's model states file)
    assert out is not state and out["module"] is not sd and state["module"] is sd, "input modified"
    assert isinstance(out["module"], collections.OrderedDict) and out["module"]._metadata == sd._metadata
    for k in state["buffer_names"]:
        assert torch.equal(out["module"][k], sd[k]) and out["module"][k].data_ptr() != sd[k].data_ptr(), k
    assert out["module"]["0.weight"].data_ptr() == m[0].weight.data_ptr(), "a parameter was cloned"
    layer = snapshot_buffers(dict(sd), buffer_pointers(m))  # by pointer (pipeline layer files)
    assert layer["1.running_var"].data_ptr() != m[1].running_var.data_ptr()
    assert layer["0.bias"].data_ptr() == m[0].bias.data_ptr()
    plain = {"x": torch.zeros(2)}
    assert snapshot_buffers(plain, set()) is plain


def test_estimate_covers_the_files_and_prepares_the_pool(tmp_path):
    import io

    import torch
    from cpuckpt.integrations.deepspeed.engine import CpuckptCheckpointEngine
    from cpuckpt.integrations.deepspeed.zero_stall import estimate_checkpoint_bytes

    from cpuckpt.transfer import staging

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 32))
    opt = torch.optim.Adam(model.parameters())
    ds = SimpleNamespace(module=model, optimizer=opt, save_non_zero_checkpoint=True)
    before = estimate_checkpoint_bytes(ds, chunk_bytes=64 * 1024, storage_alignment=4096)  # no state: Adam assumed
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    after = estimate_checkpoint_bytes(ds, chunk_bytes=64 * 1024, storage_alignment=4096)
    buf = io.BytesIO()
    torch.save({"module": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    assert before >= len(buf.getvalue()) and after >= len(buf.getvalue()), (before, after, len(buf.getvalue()))
    assert after < 3 * len(buf.getvalue()) + 4 * 64 * 1024, "a gross overestimate"

    staging.release_pool()
    try:
        off = CpuckptCheckpointEngine({"prepare_pool": False, "io": {"chunk_bytes": 64 * 1024}})
        off.after_optimizer_step(ds)
        assert off.prepared_bytes is None and staging.pool_state()[0] == 0
        sync = CpuckptCheckpointEngine({"async": False, "io": {"chunk_bytes": 64 * 1024}})
        sync.after_optimizer_step(ds)
        assert sync.prepared_bytes is None, "a sync engine prepared a pool"
        on = CpuckptCheckpointEngine({"io": {"chunk_bytes": 64 * 1024}})
        on.after_optimizer_step(ds)
        on.after_optimizer_step(ds)  # once only
        on._join_prepare()
        assert on.prepared_bytes == after and staging.pool_state()[0] >= after
    finally:
        staging.release_pool()


def _state_to_freeze():
    """A state like DeepSpeed's (the objects are importable: the test loads the files back)."""
    import argparse
    import collections
    import http

    import torch

    module = collections.OrderedDict(w=torch.randn(4, 3), b=torch.arange(3.0))  # no views: torch.save keeps
    # a view's whole storage, cpuckpt's file only the view's bytes (test_deepspeed: compact clones)
    module._metadata = collections.OrderedDict({"": {"version": 1}})  # what Module.state_dict() sets
    shared = [1, 2]
    x = torch.randn(3, requires_grad=True)
    return {"module": module, "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.ones(6)}},
                                            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
            "scaler": SimpleNamespace(cur_scale=8.0), "stage": http.HTTPStatus.OK,
            "args": argparse.Namespace(lr=0.1, layers=[2, 3]),
            "shared": (shared, shared), "leaf": x, "shapes": [torch.Size([4, 3])], "global_steps": 3}


def _saved_bytes(obj) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _mutate(state) -> None:
    import torch

    state["module"]["w"].add_(1)
    state["module"]["b"].zero_()
    state["module"]["extra"] = torch.zeros(1)
    state["module"]._metadata[""]["version"] = 2
    state["optimizer"]["state"][0]["step"] += 1
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    state["scaler"].cur_scale = 4.0
    state["args"].layers.append(9)
    state["shared"][0].append(3)
    with torch.no_grad():
        state["leaf"].mul_(2)
    state["global_steps"] = 4


def test_freeze_keeps_the_state_of_the_call():
    """``torch.save`` of the frozen copy writes the very bytes it wrote for the state at the call, after
    the containers, CPU tensors (in place), ``_metadata``, a mutable object and a Namespace were changed;
    shared references stay shared; what it cannot copy safely is refused."""
    import pytest
    import torch
    from cpuckpt.integrations.deepspeed.freeze import NotFreezable, freeze

    state = _state_to_freeze()
    want = _saved_bytes(state)
    frozen = freeze(state)
    assert frozen.device is None and frozen.event is None and frozen.cpu_bytes > 0
    _mutate(state)
    assert _saved_bytes(state) != want, "the mutations changed nothing: the test proves nothing"
    assert _saved_bytes(frozen.state) == want
    assert frozen.state["shared"][0] is frozen.state["shared"][1]
    assert frozen.state["stage"] is state["stage"] and frozen.state["leaf"].requires_grad

    with pytest.raises(NotFreezable, match="bytes of CPU tensors"):
        freeze({"big": torch.zeros(1000)}, max_cpu_bytes=1000)
    with pytest.raises(NotFreezable, match="Parameter"):
        freeze({"p": torch.nn.Parameter(torch.zeros(2))})
    with pytest.raises(NotFreezable, match="UntypedStorage"):
        freeze({"s": torch.zeros(2).untyped_storage()})


def test_deferred_save_is_laid_out_after_the_call_and_keeps_its_values(tmp_path):
    """``ordering: optimizer``: ``save()`` returns with the file still to be laid out by the stager thread;
    the state changed right after the call; the committed file loads as the state at the call. A failure of
    the deferred layout is raised by the checkpoint's commit, and ``latest`` is not written."""
    import threading

    import pytest
    import torch
    from cpuckpt.integrations.deepspeed import torchfile
    from cpuckpt.integrations.deepspeed.engine import CpuckptCheckpointEngine
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from cpuckpt.errors import CpuckptError

    ck = CpuckptCheckpointEngine({"ordering": "optimizer", "prepare_pool": False,
                                  "io": {"backend": "buffered", "chunk_bytes": 64 * 1024}})
    gate = threading.Event()
    original = torchfile.plan_torch_file

    def gated(obj, **kwargs):  # the stager waits until the caller has changed the state
        assert gate.wait(30)
        return original(obj, **kwargs)

    state = _state_to_freeze()
    want = torch.load(__import__("io").BytesIO(_saved_bytes(state)), weights_only=False)
    info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True)
    torchfile.plan_torch_file = gated
    try:
        ck.create(info)
        ck.save(state, str(tmp_path / "t1" / "mp_rank_00_model_states.pt"))
        assert len(ck._staging) == 1 and not ck._jobs, "save() laid the file out on the caller's thread"
        _mutate(state)
        gate.set()
        ck.commit(info)
        ck.wait()
    finally:
        torchfile.plan_torch_file = original
    got = torch.load(tmp_path / "t1" / "mp_rank_00_model_states.pt", weights_only=False)
    assert _saved_bytes(got) == _saved_bytes(want)
    assert (tmp_path / "latest").read_text() == "t1"

    info = CheckpointCommitInfo(tag="t2", save_dir=str(tmp_path), save_latest=True)
    ck.create(info)
    ck.save({"f": lambda: 0}, str(tmp_path / "t2" / "mp_rank_00_model_states.pt"))  # freezes; cannot be pickled
    with pytest.raises(CpuckptError, match="t2"):
        ck.commit(info)  # DeepSpeed's own commit of the object it created blocks (a step's commit would not)
    assert (tmp_path / "latest").read_text() == "t1"
    ck.cleanup()


# ------------------------------------------------------------------------------- on the GPU
# ~1 s at ~1.8 GHz: the save's copies start after DeepSpeed's host work has queued the next step
SLEEP_CYCLES = 2_000_000_000


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


_GPU_PORT: int | None = None  # the in-process NCCL group's port, shared by the parametrizations


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device (runs on the device machine)")
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "negative-control"])
def test_gpu_optimizer_ordering_keeps_the_save_step(tmp_path, monkeypatch, ordered):
    import socket

    import cpuckpt.integrations.deepspeed as ckpt_ds
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist
    from cpuckpt.integrations.deepspeed.engine import CpuckptCheckpointEngine

    from cpuckpt.transfer import staging

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # Every parametrization sets the launcher's variables (monkeypatch undoes them after each test);
    # the process group of the first one stays and is reused.
    global _GPU_PORT
    if _GPU_PORT is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            _GPU_PORT = sock.getsockname()[1]
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_GPU_PORT)}.items():
        monkeypatch.setenv(k, v)
    if not dist.is_initialized():
        torch.cuda.set_device(0)
        deepspeed.init_distributed(dist_backend="nccl")
    original_init = staging.DeviceCopier.__init__

    def delayed_copier(self, device, after=None) -> None:
        original_init(self, device, after)
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the copies start after the trainer's next kernels are queued

    monkeypatch.setattr(staging.DeviceCopier, "__init__", delayed_copier)
    if not ordered:
        def no_order(self, stream=None) -> int:
            self._collect_staging()  # the stager has enqueued the copies; nothing waits for them
            self._unordered.clear()
            return 0

        monkeypatch.setattr(CpuckptCheckpointEngine, "order_pending", no_order)
    # A window: DeepSpeed's step reads values back (.item()) before its optimizer writes, and a small
    # device-to-host copy waits behind every copy enqueued before it on the H200's copy engine; with the
    # whole save enqueued at once the step could not race the copies (the negative control saw no race).
    ckpt_ds.install({"ordering": "optimizer", "io": {"chunk_bytes": "16MiB"}, "timeout_s": 120,
                     "staging": {"d2h_window_bytes": "16MiB"}})
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4096, 8192), torch.nn.BatchNorm1d(8192),
                                    torch.nn.Linear(8192, 4096))  # ~0.27 GB of parameters, ~1 GB checkpoint
        cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
               "zero_optimization": {"stage": 1}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        ck = engine.checkpoint_engine

        def step(k: int) -> None:
            g = torch.Generator(device="cuda").manual_seed(k)
            x = torch.randn(8, 4096, device="cuda", generator=g)
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()

        step(0)
        step(1)
        saved = _live(engine)
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag="g")
        pending = len(ck._staging) + len(ck._unordered)  # being laid out, or copies enqueued
        staged_at_return = bool(ck._jobs) and all(j.staged.done() for j in list(ck._jobs))
        step(2)  # forward writes the buffers, the optimizer every other saved tensor
        ordered_after_step = not ck._unordered
        live = _live(engine)
        ckpt_ds.commit_pending(engine)
        mismatch = _compare_files(tmp_path / "ckpt" / "g", 0, saved)
        engine.destroy()
    finally:
        ckpt_ds.uninstall()
        staging.release_pool()  # the process group stays: the next parametrization (and DeepSpeed's comm) reuse it
    assert [k for k in saved if _same(saved[k], live[k])] == [], "the step left saved tensors unchanged"
    if ordered:
        assert pending >= 1 and not staged_at_return, "save_checkpoint waited for its device copies"
        assert ordered_after_step
        assert mismatch == [], f"the step raced the copies: {mismatch}"
    else:  # the race the ordering prevents: the optimizer's writes reach the files; the cloned buffers do not
        assert mismatch, "no race without ordering: the positive run proves nothing"
        assert not [k for k in mismatch if ".running_" in k or "num_batches_tracked" in k], mismatch
