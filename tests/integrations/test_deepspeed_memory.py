"""DeepSpeed through the core memory tier (``memory_tier: true``), with real engines on 2 gloo ranks (CPU).

What is proven (real DeepSpeed ZeRO-2 engines, real writer processes, real files; no mocks):

- phase 1, ``memory.persist_every: 2``, ``memory.slots: 2``: checkpoints of global steps 1-3 are committed in
  the RAM root (``tags/<tag>`` names them, ``tags/latest`` the newest); only step 2 is persisted, by the
  writer processes, into ``save_dir/global_step2`` with DeepSpeed's file names, the completion marker (no
  saving file, no parts left) and ``save_dir/latest``; no other tag directory appears in ``save_dir``;
- phase 2, the plain adapter (no tier) writes a durable ``global_step6``;
- phase 3, a restart with the tier: ``load_latest`` loads the durable step 6, not the older step 3 the RAM
  root still holds; it trains on (7, 8 persisted, 9; ``ordering: optimizer``: each save's state frozen and
  laid out into the slot's images after the call, while the next step runs) and ends without ``destroy()``;
- phase 4, a restart: ``load_latest`` loads step 9 from RAM (newer than the durable step 8), bit-exact; the
  next save (10) does not overwrite it; ``engine.destroy()`` waits for the persist of step 10, stops the
  writers and removes the RAM root; stock DeepSpeed (``TorchCheckpointEngine``, no cpuckpt) loads
  ``save_dir`` (``latest``: step 10) bit-exact;
- ``memory.persist_every: 0``: no writer process ever starts; trainers SIGKILLed after a save's files are in
  RAM but before its commit leave a torn slot that is never chosen: the restart loads the previous tag from
  RAM, bit-exact;
- rank 1's writer cannot write (ENOSPC): the tag is never committed durably (no marker, no ``latest``), the
  next ``save_checkpoint`` raises ``PersistError`` on every rank, and so does ``engine.destroy()`` (its
  persist of the newest fails again), promptly, not after ``timeout_s``;
- a memory save every iteration, its memory commits slowed or held: the step after a save waits for its commit
  (with ``memory.max_uncommitted: 1`` always; by default from the second save on), so at the trainer's log of N the
  newest complete tag (a whole-job kill's restart) is N - 1, and it loads bit-exact; with saves every second
  iteration no step waits (each commit, held until every rank has logged, is waited for only at the next save);
- ranks with separate RAM roots (two nodes) work (tests/dist/test_multinode_deepspeed.py: two torchrun launches,
  a lost node restored from a partner's replica); what a node's leader cannot copy itself, ZeRO's
  ``elastic_checkpoint`` (every rank reads every rank's optimizer file), is refused across nodes with the same
  ``ConfigError`` on every rank, before a byte moves;
- ``memory_save_dir``: a tier whose tag naming fails right after ``deepspeed.initialize`` made it is closed before the
  failure is warned about (no copy process left, its trainer lock free, its RAM root and committed slots kept), so the
  restart's ``load_latest`` makes it again and loads the newest memory tag;
- a restart (``load_latest``) lists ``save_dir`` once on rank 0, also when it makes the tier (``os.listdir`` and
  ``os.scandir`` counted).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

_HERE = Path(__file__).resolve().parent
_IO = {"backend": "buffered", "chunk_bytes": 64 * 1024}


def _ds():
    """The helpers of test_deepspeed.py (engines, steps, state comparison), loaded by path."""
    import importlib.util
    import sys

    name = "_cpuckpt_test_deepspeed_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / "test_deepspeed.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _settings(ram: str, **memory) -> dict:
    return {"memory_tier": True, "io": _IO, "timeout_s": 60,
            "memory": {"root": ram, "slots": 2, "persist_every": 2, "headroom_bytes": 0, **memory}}


def _save_state(h, engine, root: str, rank: int) -> None:
    import torch

    torch.save(h._state(engine), Path(root) / f"state_{engine.global_steps}_rank{rank}.pt")


def _saved(root: str, step: int, rank: int) -> dict:
    import torch

    return torch.load(Path(root) / f"state_{step}_rank{rank}.pt", weights_only=False)


def _listing(save_dir: Path) -> dict:
    return {p.name: sorted(q.name for q in p.iterdir()) for p in save_dir.iterdir() if p.is_dir()}


# ----------------------------------------------------------------------------------- rank side
def rank_memory_train(root: str) -> dict:
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import deepspeed
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    save_dir, ram = Path(root) / "ckpt", Path(root) / "ram"
    ckpt_ds.install({**_settings(str(ram)), "memory_save_dir": str(save_dir)})  # slots reserved by initialize
    # engines without an optimizer (reference models) in the same process, one before the trained engine (bf16:
    # DeepSpeed gives it a stand-in optimizer) and one after: neither opens the tier nor reserves, the trained one does
    before, *_ = deepspeed.initialize(model=torch.nn.Linear(8, 4),
                                      config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}})
    engine = h._engine(2, seed=0)
    after, *_ = deepspeed.initialize(model=torch.nn.Linear(8, 4), config={"train_micro_batch_size_per_gpu": 2})
    reference_untiered = before.checkpoint_engine.memory_tier is None and after.checkpoint_engine.memory_tier is None

    def images() -> dict:
        tier = engine.checkpoint_engine.memory_tier
        # per slot: every file, its size and this rank's image object (kept: identity, not a reusable inode number)
        return {slot.name: {p.name: (p.stat().st_size, images.get(p.name)) for p in slot.iterdir()
                            if p.name.endswith(".pt")} for slot, images in zip(tier.slots, tier.images)}

    dist.barrier()
    reserved = images()  # before any step: every slot holds the images of the files the saves will write
    for k in range(1, 4):
        h._step(engine, k)
        _save_state(h, engine, root, rank)
        engine.save_checkpoint(str(save_dir))
    ckpt_ds.commit_pending(engine)
    tier = engine.checkpoint_engine.memory_tier
    tier.wait_persisted()
    dist.barrier()  # every rank's writer done: rank 0's has committed the durable tag
    links = tier.root.path / "tags"
    written = images()
    other_dir = engine.checkpoint_engine.memory_for(str(Path(root) / "elsewhere"))  # an export: to disk, no error
    out = {"reserved": {s: sorted(f) for s, f in reserved.items()},
           "written": {s: sorted(f) for s, f in written.items()},
           "reserved_over": all(reserved[s][n][0] >= written[s][n][0] for s in written for n in written[s]),
           # the file each save filled is the image reserved for it (no claim dropped another file's reservation)
           "same_images": all(reserved[s][n][1] is written[s][n][1] for s in written for n in written[s]),
           "other_dir": other_dir is None, "reference_untiered": reference_untiered,
           "durable": _listing(save_dir), "latest": (save_dir / "latest").read_text(),
           "persisted": [s for s in (1, 2, 3) if tier.persisted(s)],
           "links": sorted(p.name for p in links.iterdir()), "links_latest": (links / "latest").read_text(),
           "durable_state": ckpt_ds.check_tag(save_dir, "global_step2", verify=True).state,
           "memory_state": ckpt_ds.check_tag(links, "global_step3", verify=True).state}
    return out  # no destroy(): the RAM root stays for the restarts; the writers owe nothing and exit with us


def rank_plain_durable(root: str) -> None:
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    ckpt_ds.install({"io": _IO})  # no memory tier: straight to save_dir
    engine = h._engine(2, seed=1)
    for k in range(1, 7):
        h._step(engine, 10 + k)
    _save_state(h, engine, root, dist.get_rank())
    engine.save_checkpoint(str(Path(root) / "ckpt"))
    engine.destroy()


def rank_restart_durable_newer(root: str) -> dict:
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    rank = dist.get_rank()
    save_dir, ram = Path(root) / "ckpt", Path(root) / "ram"
    ckpt_ds.install({**_settings(str(ram)), "ordering": "optimizer"})  # zero-stall saves into the slots' images
    engine = h._engine(2, seed=5)
    path, _ = ckpt_ds.load_latest(engine, save_dir)
    out = {"loaded": path, "step": engine.global_steps}
    h._assert_same(h._state(engine), _saved(root, 6, rank), "the durable step 6, newer than RAM's step 3")
    for k in range(3):
        h._step(engine, 20 + k)
        _save_state(h, engine, root, rank)
        engine.save_checkpoint(str(save_dir))
    ckpt_ds.commit_pending(engine)
    engine.checkpoint_engine.memory_tier.wait_persisted()
    dist.barrier()
    out["durable"] = _listing(save_dir)
    out["latest"] = (save_dir / "latest").read_text()
    return out  # again no destroy(): step 9 lives in RAM only


def rank_restart_from_memory(root: str) -> dict:
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    rank = dist.get_rank()
    save_dir, ram = Path(root) / "ckpt", Path(root) / "ram"
    ckpt_ds.install(_settings(str(ram)))
    engine = h._engine(2, seed=7)
    path, _ = ckpt_ds.load_latest(engine, save_dir)
    out = {"loaded": path, "step": engine.global_steps}
    h._assert_same(h._state(engine), _saved(root, 9, rank), "step 9 restored from RAM")
    h._step(engine, 30)
    _save_state(h, engine, root, rank)
    engine.save_checkpoint(str(save_dir))  # step 10: into the slot after step 9's
    ckpt_ds.commit_pending(engine)
    links = engine.checkpoint_engine.memory_tier.root.path / "tags"
    out["step9_kept"] = ckpt_ds.check_tag(links, "global_step9").state
    engine.destroy()  # the persist of step 10 waited for, the writers stopped, the RAM root removed
    dist.barrier()
    out["ram_left"] = ram.exists() and any(ram.iterdir())
    out["latest"] = (save_dir / "latest").read_text()
    out["durable"] = _listing(save_dir)
    ckpt_ds.uninstall()
    stock = h._engine(2, seed=11, cpuckpt={"enabled": False})
    out["stock_engine"] = type(stock.checkpoint_engine).__name__
    stock_path, _ = stock.load_checkpoint(str(save_dir))
    out["stock_loaded"] = stock_path
    h._assert_same(h._state(stock), _saved(root, 10, rank), "step 10 loaded by stock DeepSpeed")
    stock.destroy()
    return out


def rank_memory_only_then_killed(root: str) -> None:
    """Steps 1-2 committed in RAM (persist_every 0), step 3's files staged into RAM, then SIGKILL before its commit."""
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    rank = dist.get_rank()
    save_dir = Path(root) / "ckpt"
    ckpt_ds.install(_settings(str(Path(root) / "ram"), persist_every=0))
    engine = h._engine(2, seed=0)
    for k in range(1, 3):
        h._step(engine, k)
        _save_state(h, engine, root, rank)
        engine.save_checkpoint(str(save_dir))
    ckpt_ds.commit_pending(engine)
    h._step(engine, 3)
    engine.save_checkpoint(str(save_dir))  # returns once staged into the slot; committed at the next step
    engine.checkpoint_engine.wait()  # every byte in RAM (no commit yet)
    tier = engine.checkpoint_engine.memory_tier
    (Path(root) / f"writer_{rank}").write_text(str(tier.writer_pid()))
    dist.barrier()
    (Path(root) / f"links_{rank}").write_text(",".join(sorted(p.name for p in (tier.root.path / "tags").iterdir())))
    os.kill(os.getpid(), signal.SIGKILL)


def rank_restart_past_a_torn_slot(root: str) -> dict:
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    from cpuckpt.tier.tagmarker import check_dir

    rank = dist.get_rank()
    ckpt_ds.install(_settings(str(Path(root) / "ram"), persist_every=0))
    engine = h._engine(2, seed=3)
    path, _ = ckpt_ds.load_latest(engine, Path(root) / "ckpt")
    h._assert_same(h._state(engine), _saved(root, 2, rank), "step 2 restored from RAM past the torn step 3")
    tier = engine.checkpoint_engine.memory_tier
    out = {"loaded": path, "slots": [check_dir(s).state for s in tier.slots],
           "links": sorted(p.name for p in (tier.root.path / "tags").iterdir())}
    engine.destroy()  # nothing to persist: this run saved nothing; the RAM root goes
    return out


def rank_memory_only_then_damaged(root: str, damage: str) -> None:
    """Steps 1-2 committed in RAM (persist_every 0), then rank 0 damages one slot since its commit: ``garble`` step
    1's marker, or ``truncate`` a file of step 2's (``none``: neither); the RAM root is left for the restart."""
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    from cpuckpt.tier.tagmarker import MARKER_NAME, read_marker

    rank = dist.get_rank()
    ckpt_ds.install(_settings(str(Path(root) / "ram"), persist_every=0))
    engine = h._engine(2, seed=0)
    for k in range(1, 3):
        h._step(engine, k)
        _save_state(h, engine, root, rank)
        engine.save_checkpoint(str(Path(root) / "ckpt"))
    ckpt_ds.commit_pending(engine)
    dist.barrier()
    if rank == 0 and damage != "none":
        step = {"garble": 1, "truncate": 2}[damage]
        slot = next(s for s in engine.checkpoint_engine.memory_tier.slots if read_marker(s).global_step == step)
        if damage == "garble":
            (slot / MARKER_NAME).write_text('{"format": 1, "tag": "global_st')  # cut short since its commit
        else:
            victim = slot / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
            os.truncate(victim, victim.stat().st_size // 2)
    dist.barrier()  # no destroy(): the RAM root stays for the restart


def rank_restart_past_a_truncated_slot(root: str) -> dict:
    import logging

    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds

    from cpuckpt.errors import CheckpointCorrupt

    ckpt_ds.install(_settings(str(Path(root) / "ram"), persist_every=0))
    engine = h._engine(2, seed=3)
    out: dict = {}
    try:
        ckpt_ds.load_latest(engine, Path(root) / "ckpt", fallback_on_corrupt=False)
    except CheckpointCorrupt as e:
        out["off"] = str(e)
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cpuckpt").addHandler(handler)
    path, _ = ckpt_ds.load_latest(engine, Path(root) / "ckpt")
    logging.getLogger("cpuckpt").removeHandler(handler)
    out.update(loaded=path, step=engine.global_steps, warned=warned)
    engine.destroy()
    return out


def rank_restart_past_a_garbled_slot(root: str) -> dict:
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    rank = dist.get_rank()
    ckpt_ds.install(_settings(str(Path(root) / "ram"), persist_every=0))
    engine = h._engine(2, seed=3)
    path, _ = ckpt_ds.load_latest(engine, Path(root) / "ckpt")
    h._assert_same(h._state(engine), _saved(root, 2, rank), "step 2 restored from RAM")
    out = {"loaded": path, "step": engine.global_steps}
    engine.destroy()
    return out


def rank_persist_fails_on_rank1(root: str) -> dict:
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    from cpuckpt.testing import faults

    rank = dist.get_rank()
    os.environ.update(faults.child_env(Path(root) / "site", "unused=sleep:0"))  # the writers know fault backends
    settings = _settings(str(Path(root) / "ram"), persist_every=1)
    if rank == 1:
        settings["io"] = {**_IO, "backend": "fault:ENOSPC@0"}  # rank 1's writer: every durable write fails
    ckpt_ds.install(settings)
    engine = h._engine(2, seed=0)
    h._step(engine, 1)
    engine.save_checkpoint(str(Path(root) / "ckpt"))
    ckpt_ds.commit_pending(engine)
    if rank == 1:
        engine.checkpoint_engine.memory_tier.wait_persisted()  # its part failed
    dist.barrier()
    h._step(engine, 2)
    out = {}
    for what, call in (("save", lambda: engine.save_checkpoint(str(Path(root) / "ckpt"))), ("destroy", engine.destroy)):
        t0 = time.monotonic()
        try:
            call()
            out[what] = None
        except Exception as e:
            out[what] = (type(e).__name__, str(e), time.monotonic() - t0)
    return out


def rank_two_nodes(root: str) -> tuple[str, str]:
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    ckpt_ds.install(_settings(f"{root}/ram{dist.get_rank()}"))  # a RAM root per rank: two nodes
    engine = h._engine(2, seed=0, extra={"zero_optimization": {"stage": 2, "elastic_checkpoint": True}})
    h._step(engine, 1)
    try:
        engine.save_checkpoint(str(Path(root) / "ckpt"))
    except Exception as e:
        return type(e).__name__, str(e)
    return "", ""


def rank_newest_at_each_log(root: str, max_uncommitted: int, every: int) -> dict:
    """A DeepSpeed loop with a memory save every ``every`` iterations, its memory commits (rank 0's rename of the slot's
    marker) slowed or held: the step (whose start requests the commit of the previous save: DeepSpeed's decoupled
    commit, ours in the background), the log, then the save. The newest complete tag at each log is what a whole-job
    kill right after that log restarts from (``load_latest``'s choice); at the last log it is loaded by a fresh engine.
    Each rank reads its own.

    A commit the step is expected to wait for is slowed by 0.8 s (no release could come while the step waits); one it
    is expected not to wait for is held until every rank has read the log (a step that waited would never end): with
    ``max_uncommitted: 1`` every commit is waited for; with the default (0) a commit whose save came one iteration
    after the save before it, not the job's first save's, nor those of saves further apart (here each after a
    ``save_16bit_model`` at the same step, whose commit blocks)."""
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    from cpuckpt.testing import faults

    rank = dist.get_rank()
    save_dir = Path(root) / "ckpt"
    Path(root).mkdir(parents=True, exist_ok=True)
    ckpt_ds.install(_settings(str(Path(root) / "ram"), slots=3, persist_every=0, max_uncommitted=max_uncommitted))
    engine = h._engine(2, seed=0)
    memory = None
    marker_rename = "before-rename:.cpuckpt-complete.json"  # the slot's marker: its memory commit
    saved: list[int] = []

    def newest() -> int | None:
        found = memory.candidates() if memory is not None else []
        return found[0].global_step if found else None

    at_log: dict[int, int | None] = {}
    for it in range(1, 3 * every + 2):
        if saved and saved[-1] == it - 1:  # this step requests the commit of that save; none other is in flight
            # (the save waited for the commit before it): the fault set now is that commit's
            waited = max_uncommitted == 1 or (len(saved) > 1 and saved[-1] - saved[-2] == 1)
            faults.install(f"{marker_rename}=sleep:0.8" if waited else
                           ";".join(f"{marker_rename}=wait:{Path(root) / f'logged{it}_rank{r}'}"
                                    for r in range(dist.get_world_size())))
        h._step(engine, it)
        dist.barrier()  # the log line; rank 0's commit is visible to every rank after it
        memory = memory or engine.checkpoint_engine.memory_for(str(save_dir))
        at_log[it] = newest()
        (Path(root) / f"logged{it}_rank{rank}").touch()  # releases a held commit
        if it % every == 0:
            _save_state(h, engine, root, rank)
            if every > 1:  # a blocking save at the same step first (its commit is not one the step waits for)
                engine.save_16bit_model(str(Path(root) / "model16"))
            engine.save_checkpoint(str(save_dir))
            saved.append(it)
    faults.install(f"{marker_rename}=sleep:0.8")
    ckpt_ds.commit_pending(engine)
    faults.uninstall()
    out = {"log": at_log}
    last = at_log[max(at_log)]
    if last is not None:  # what a kill right after the last log restarts from: its values, bit-exact
        restarted = h._engine(2, seed=3)
        path, _ = restarted.load_checkpoint(str(memory.links), tag=f"global_step{last}")
        h._assert_same(h._state(restarted), _saved(root, last, rank), f"global_step{last} from RAM")
        out["loaded"] = Path(path).parent.name
        restarted.destroy()
    engine.destroy()
    return out


def rank_newest_three_ways(root: str) -> list[dict]:
    """``memory.max_uncommitted: 1`` and the default with a save every iteration; the default with a save every second
    iteration; in one launch of the ranks."""
    return [rank_newest_at_each_log(str(Path(root) / name), k, every)
            for name, k, every in (("u1", 1, 1), ("default", 0, 1), ("apart", 0, 2))]


# ----------------------------------------------------------------------------------- test side
def _wait_writers_gone(ram: Path, timeout_s: float = 60.0) -> None:
    from cpuckpt.tier.persister import lock_held

    deadline = time.monotonic() + timeout_s
    while any(lock_held(p) for p in ram.rglob(".writer-*.lock")):
        assert time.monotonic() < deadline, "writer processes still running after their trainers ended"
        time.sleep(0.05)


@pytest.mark.timeout(400)
def test_memory_tier_persists_every_second_restarts_from_the_newest_and_stock_loads_the_durable(run_ranks,
                                                                                             tmp_path):
    ram = tmp_path / "ram"
    tag_files = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    marked = sorted([".cpuckpt-complete.json", *tag_files])
    for r in run_ranks(2, rank_memory_train, str(tmp_path), timeout_s=200):
        # memory_save_dir: the slots' images (DeepSpeed's names) made by deepspeed.initialize, before the first step;
        # the saves wrote into them (none removed, none added; each reserved at least the file's size: truncated)
        assert r["reserved"] == {"slot-0": tag_files, "slot-1": tag_files}, r["reserved"]
        assert r["written"] == r["reserved"] and r["reserved_over"] and r["same_images"], r
        assert r["other_dir"] and r["reference_untiered"], r
        assert r["durable"] == {"global_step2": marked}, r["durable"]  # only the persisted tag, nothing else
        assert r["latest"] == "global_step2" and r["persisted"] == [2], r
        assert r["links"] == ["global_step2", "global_step3", "latest"] and r["links_latest"] == "global_step3", r
        assert (r["durable_state"], r["memory_state"]) == ("complete", "complete"), r
    _wait_writers_gone(ram)

    run_ranks(2, rank_plain_durable, str(tmp_path), timeout_s=200)
    for r in run_ranks(2, rank_restart_durable_newer, str(tmp_path), timeout_s=200):
        assert Path(r["loaded"]).parent == tmp_path / "ckpt" / "global_step6" and r["step"] == 6, r
        assert sorted(r["durable"]) == ["global_step2", "global_step6", "global_step8"], r["durable"]
        assert r["durable"]["global_step8"] == marked and r["latest"] == "global_step8", r
    _wait_writers_gone(ram)

    for r in run_ranks(2, rank_restart_from_memory, str(tmp_path), timeout_s=200):
        assert Path(r["loaded"]).parent == ram / "tags" / "global_step9", r["loaded"]  # RAM root = memory.root
        assert r["step"] == 9 and r["step9_kept"] == "complete", r
        assert not r["ram_left"], "destroy() left the RAM root's contents"
        assert r["latest"] == "global_step10" and r["durable"]["global_step10"] == marked, r
        assert r["stock_engine"] == "TorchCheckpointEngine", r
        assert Path(r["stock_loaded"]).parent.name == "global_step10", r
    assert not list((tmp_path / "ckpt").glob("*/.cpuckpt-part-*")), "persist parts left in a durable tag"


@pytest.mark.timeout(300)
def test_no_writer_without_persists_and_a_torn_memory_tag_is_never_chosen(run_ranks, tmp_path):
    with pytest.raises(AssertionError) as ei:  # conftest's RankError: both ranks SIGKILLed themselves
        run_ranks(2, rank_memory_only_then_killed, str(tmp_path), timeout_s=150, grace_s=2)
    assert all(r["type"] == "RankDied" for r in ei.value.results.values()), ei.value
    assert [(tmp_path / f"writer_{r}").read_text() for r in (0, 1)] == ["None", "None"], "a writer was started"
    assert not [p for p in (tmp_path / "ckpt").glob("*") if p.is_dir()], "a tag directory reached save_dir"
    # Step 3 refilled step 1's slot: that tag's name went before the first byte (a stock load by it is not torn)
    for r in (0, 1):
        assert (tmp_path / f"links_{r}").read_text() == "global_step2,latest", r
    for r in run_ranks(2, rank_restart_past_a_torn_slot, str(tmp_path), timeout_s=150):
        assert Path(r["loaded"]).parent == tmp_path / "ram" / "tags" / "global_step2", r
        assert sorted(r["slots"]) == ["complete", "torn"], r["slots"]  # step 3's slot: files, no marker
        assert r["links"] == ["global_step2", "latest"], r["links"]  # step 1's slot was refilled by step 3
    assert not (tmp_path / "ram").exists() or not any((tmp_path / "ram").iterdir())


@pytest.mark.timeout(300)
def test_a_memory_tag_damaged_since_its_commit_is_named_not_skipped_as_torn(run_ranks, tmp_path):
    """A slot whose file was cut short after its commit was dropped from the candidates like a torn save: the
    restart loaded the older memory tag without a word, even with ``fallback_on_corrupt`` off."""
    run_ranks(2, rank_memory_only_then_damaged, str(tmp_path), "truncate", timeout_s=150)
    _wait_writers_gone(tmp_path / "ram")
    for r in run_ranks(2, rank_restart_past_a_truncated_slot, str(tmp_path), timeout_s=150):
        assert "committed, but incomplete now" in r.get("off", "") and "fallback_on_corrupt is off" in r["off"], r
        assert Path(r["loaded"]).parent == tmp_path / "ram" / "tags" / "global_step1" and r["step"] == 1, r
        assert any("committed, but incomplete now" in w and "falling back" in w for w in r["warned"]), r["warned"]


@pytest.mark.timeout(300)
def test_a_garbled_marker_in_another_slot_does_not_fail_the_restart_from_the_newest(run_ranks, tmp_path):
    """The restart finds the slot of the memory tag it loads by the slots' markers: another slot's marker, damaged
    since its commit, is not that slot, not a failure of this one (it made the newest memory tag "not verify")."""
    run_ranks(2, rank_memory_only_then_damaged, str(tmp_path), "garble", timeout_s=150)
    _wait_writers_gone(tmp_path / "ram")
    for r in run_ranks(2, rank_restart_past_a_garbled_slot, str(tmp_path), timeout_s=150):
        assert Path(r["loaded"]).parent == tmp_path / "ram" / "tags" / "global_step2" and r["step"] == 2, r


@pytest.mark.timeout(300)
def test_a_failed_persist_is_raised_on_every_rank_and_never_committed(run_ranks, tmp_path):
    from cpuckpt.integrations.deepspeed import check_tag

    for rank, r in enumerate(run_ranks(2, rank_persist_fails_on_rank1, str(tmp_path), timeout_s=200)):
        for what in ("save", "destroy"):
            assert r[what] is not None and r[what][0] == "PersistError", (rank, what, r[what])
            assert r[what][2] < 30, f"rank {rank}: {what} took {r[what][2]:.1f} s (timeout_s 60)"
    save_dir = tmp_path / "ckpt"
    assert check_tag(save_dir, "global_step1").state != "complete" and not (save_dir / "latest").exists()
    _wait_writers_gone(tmp_path / "ram")


@pytest.mark.timeout(200)
def test_elastic_checkpoints_across_nodes_are_refused_on_every_rank(run_ranks, tmp_path):
    results = run_ranks(2, rank_two_nodes, str(tmp_path), timeout_s=150)
    assert results[0] == results[1], results
    cls, msg = results[0]
    assert cls == "ConfigError" and "elastic_checkpoint" in msg and "across nodes" in msg, results[0]
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir()), "a byte reached save_dir"
    _wait_writers_gone(tmp_path)


@pytest.mark.timeout(300)
def test_a_kill_after_the_log_of_n_restarts_from_n_minus_1_with_saves_every_iteration(run_ranks, tmp_path):
    one_behind = {it: it - 1 if it > 1 else None for it in range(1, 5)}
    for u1, default, apart in run_ranks(2, rank_newest_three_ways, str(tmp_path), timeout_s=240):
        # max_uncommitted 1: the step after a save waits for its commit: the newest tag at the log of N is N - 1, and
        # it loads bit-exact
        assert u1["log"] == one_behind and u1["loaded"] == "global_step3", u1
        # the default with saves every iteration: the same from the second save on (the first save's commit, held
        # until every rank has logged, was not waited for: a step that waited for it would never end)
        assert default["log"] == {1: None, 2: None, 3: 2, 4: 3} and default["loaded"] == "global_step3", default
        # the control, saves every second iteration, each after a save_16bit_model at the same step: no step waits
        # (each commit held until every rank has logged the step that requested it); the next save waits for it.
        # At the logs of 4 and 6 the commit released at the log before may or may not have ended
        log = apart["log"]
        assert {it: log[it] for it in (1, 2, 3, 5, 7)} == {1: None, 2: None, 3: None, 5: 2, 7: 4}, apart
        assert log[4] in (None, 2) and log[6] in (2, 4) and apart["loaded"] == "global_step4", apart


def rank_listing_of_both_tiers_fails_on_rank0(root: str) -> dict:
    h = _ds()
    h._setup_env()
    import time

    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist
    from cpuckpt.integrations.deepspeed.memory import DeepSpeedMemory

    from cpuckpt.errors import CpuckptError

    def candidates(self):
        raise OSError(5, "Input/output error", f"{root}/ckpt/global_step2/.cpuckpt-complete.json")

    if dist.get_rank() == 0:  # rank 0's listing of both tiers hits an unreadable marker
        DeepSpeedMemory.candidates = candidates
    ckpt_ds.install(_settings(str(Path(root) / "ram")))
    engine = h._engine(2, seed=5)
    t0 = time.monotonic()
    try:
        ckpt_ds.load_latest(engine, Path(root) / "ckpt")
        out = {"error": None}
    except CpuckptError as e:
        out = {"error": type(e).__name__, "message": str(e)}
    out["s"] = time.monotonic() - t0
    engine.destroy()
    ckpt_ds.uninstall()
    return out


def test_a_listing_of_both_tiers_that_fails_on_rank_0_fails_on_every_rank_at_once(run_ranks, tmp_path):
    """``load_latest`` with the memory tier: rank 0 lists the tags of both tiers and broadcasts them; its listing
    raising (EIO on a marker) left the other ranks waiting in the broadcast until the group's timeout. Every rank
    now raises rank 0's error at once."""
    for r in run_ranks(2, rank_listing_of_both_tiers_fails_on_rank0, str(tmp_path), timeout_s=150):
        assert r["error"] is not None and "rank 0" in r["message"] and "Input/output error" in r["message"], r
        assert f"{tmp_path / 'ckpt'} and its memory tier" in r["message"] and r["s"] < 30, r


def _children() -> list[tuple[int, str]]:
    """This process's child processes still running (pid, command line): a zombie has ended."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == os.getpid() and state != "Z":
                out.append((int(proc.name), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError):  # not a process, or gone meanwhile
            continue
    return out


def rank_naming_fails_at_initialize(root: str) -> dict:
    """``memory_save_dir``: the tier made inside ``deepspeed.initialize`` (a copy process per rank) fails to name the
    tags of the RAM root's committed slots right after it is made (``<RAM root>/tags`` is a file now, not a
    directory); then that obstacle goes and the restart makes the tier again and loads the newest memory tag."""
    import logging
    import shutil

    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    from cpuckpt.tier.persister import lock_held
    from cpuckpt.tier.tagmarker import check_dir

    rank = dist.get_rank()
    save_dir, ram = Path(root) / "ckpt", Path(root) / "ram"
    if rank == 0:
        shutil.rmtree(ram / "tags")
        (ram / "tags").write_text("not a directory")  # the leader's mkdir of the tags' names fails
    dist.barrier()
    before = _children()
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cpuckpt").addHandler(handler)
    ckpt_ds.install({**_settings(str(ram), persist_every=0, copy_process=True), "memory_save_dir": str(save_dir)})
    engine = h._engine(2, seed=3)
    logging.getLogger("cpuckpt").removeHandler(handler)
    out: dict = {"warned": warned, "tier": engine.checkpoint_engine.memory_tier is not None,
                 # what the failed tier started (its copy process) ended with it, and its trainer lock is free
                 "children_left": [c for c in _children() if c not in before],
                 "lock_held": lock_held(ram / f".rank-{rank}.lock"),
                 "slots": sorted(check_dir(p).state for p in ram.iterdir() if p.name.startswith("slot-"))}
    dist.barrier()
    if rank == 0:
        (ram / "tags").unlink()
    dist.barrier()
    try:
        path, _ = ckpt_ds.load_latest(engine, save_dir)  # makes the tier: the RAM root opens again
        out["loaded"] = path
        h._assert_same(h._state(engine), _saved(root, 2, rank), "step 2 restored from RAM")
    except Exception as e:
        out["loaded"] = f"{type(e).__name__}: {e}"
    engine.destroy()  # nothing saved by this run: nothing to persist; the RAM root removed
    dist.barrier()  # rank 0 removes it once every rank is done
    out["ram_left"] = sorted(p.name for p in ram.iterdir()) if ram.exists() else []
    out["children_at_end"] = [c for c in _children() if c not in before]
    ckpt_ds.uninstall()
    return out


@pytest.mark.timeout(300)
def test_a_tier_whose_naming_fails_right_after_it_is_made_is_closed(run_ranks, tmp_path):
    """The memory tier made at ``deepspeed.initialize`` (``memory_save_dir``) whose tag naming then failed was left
    open: its copy process ran on and its trainer lock stayed held, so the restart's ``load_latest``, which makes the
    tier again, could not open the RAM root. The failure now closes the tier before it is raised, keeping its RAM
    root (the restart's checkpoints are there), and the restart loads the newest memory tag."""
    run_ranks(2, rank_memory_only_then_damaged, str(tmp_path), "none", timeout_s=150)
    for r in run_ranks(2, rank_naming_fails_at_initialize, str(tmp_path), timeout_s=200):
        assert any("not made at initialize" in w and "naming the memory tags" in w for w in r["warned"]), r["warned"]
        assert not r["tier"] and not r["children_left"] and not r["lock_held"], r
        assert r["slots"] == ["complete", "complete"], r  # the RAM root and its checkpoints kept
        assert Path(r["loaded"]).parent == tmp_path / "ram" / "tags" / "global_step2", r["loaded"]
        assert not r["ram_left"] and not r["children_at_end"], r


def rank_restart_counting_listings(root: str, made_by: str) -> dict:
    """A restart with memory tags (steps 1-2) in RAM and a newer durable tag (step 6) in ``save_dir``: every listing
    of ``save_dir``'s entries by ``load_latest`` is recorded (``os.listdir``/``os.scandir``, which ``Path.iterdir``
    and ``glob`` use, wrapped and passed through). The tier is made by ``initialize`` (``memory_save_dir``) or by
    ``load_latest`` itself (its start is counted then)."""
    h = _ds()
    h._setup_env()
    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    rank = dist.get_rank()
    save_dir = Path(root) / "ckpt"
    made_at_initialize = {"memory_save_dir": str(save_dir)} if made_by == "initialize" else {}
    ckpt_ds.install({**_settings(str(Path(root) / "ram"), persist_every=0), **made_at_initialize})
    engine = h._engine(2, seed=3)
    listings: list[str] = []
    real = {"listdir": os.listdir, "scandir": os.scandir}

    def counted(name: str):
        def call(path=".", *args, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(path)) == str(save_dir):
                listings.append(name)
            return real[name](path, *args, **kwargs)
        return call

    os.listdir, os.scandir = counted("listdir"), counted("scandir")
    try:
        path, _ = ckpt_ds.load_latest(engine, save_dir)
    finally:
        os.listdir, os.scandir = real["listdir"], real["scandir"]
    h._assert_same(h._state(engine), _saved(root, 6, rank), "the durable step 6, newer than RAM's step 2")
    engine.destroy()
    return {"loaded": path, "listings": listings}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("made_by", ["initialize", "load_latest"])
def test_a_restart_lists_save_dir_once(run_ranks, tmp_path, made_by):
    """``load_latest`` with the memory tier listed ``save_dir`` three times on rank 0 (the durable candidates, a tag
    stock DeepSpeed wrote, the damaged tags), four when it made the tier (its start looks for its newest slot), each a
    look at a directory a writer of the previous trainer may be committing into. One listing now serves them all; on
    one node the other ranks take rank 0's list (a tier's start, the core's, lists it once on every rank)."""
    run_ranks(2, rank_memory_only_then_damaged, str(tmp_path), "none", timeout_s=150)
    run_ranks(2, rank_plain_durable, str(tmp_path), timeout_s=150)
    for rank, r in enumerate(run_ranks(2, rank_restart_counting_listings, str(tmp_path), made_by, timeout_s=200)):
        assert Path(r["loaded"]).parent == tmp_path / "ckpt" / "global_step6", r["loaded"]
        if rank == 0:
            assert len(r["listings"]) == 1, r["listings"]
        else:  # at most its tier's start (the core's look for the newest slot) when load_latest made the tier
            assert len(r["listings"]) <= int(made_by == "load_latest"), r["listings"]


def test_a_name_removed_by_another_rank_while_it_is_resolved_is_no_error(tmp_path, monkeypatch):
    """Every rank of a node removes the names of the slot it claimed (``_unname``), the same names at once: a name
    gone between the ``lstat`` and the ``readlink`` of its resolution is not a failed save (it failed one rank's
    ``save_checkpoint`` with FileNotFoundError). The race made certain: the other rank removes it right then."""
    from cpuckpt.integrations.deepspeed.memory import _names

    slot = tmp_path / "slot0"
    slot.mkdir()
    link = tmp_path / "global_step1"
    os.symlink(slot, link, target_is_directory=True)
    assert _names(link, slot.resolve())
    real_readlink = os.readlink

    def removed_first(path, *args, **kwargs):
        if os.fspath(path) == str(link):
            link.unlink(missing_ok=True)  # the other rank's removal
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", removed_first)
    assert not _names(link, slot.resolve())
    assert not _names(link, slot.resolve())  # and once gone


def test_memory_tags_of_one_step_carry_their_commit_time(tmp_path):
    """Two memory tags of one step (a rewind: the abandoned one may still sit in another slot) are told apart by when
    they were committed, the later first, never by slot name: the slot format reports each marker's ``created_unix``
    (before: 0.0 for both, so ``slot-1`` won over a later ``slot-0``)."""
    import dataclasses

    from cpuckpt.integrations.deepspeed.memory import TagSlots

    from cpuckpt.tier.tagmarker import new_marker, write_marker

    for name, created in (("slot-0", 200.0), ("slot-1", 100.0)):
        (tmp_path / name).mkdir()
        marker = dataclasses.replace(new_marker("global_step7", 1, {}, 7, save_id=name), created_unix=created)
        write_marker(tmp_path / name, marker, fsync=False)
    found = {name: TagSlots().committed(tmp_path / name) for name in ("slot-0", "slot-1")}
    assert {name: (c.step, c.save_id, c.created) for name, c in found.items()} == {
        "slot-0": (7, "slot-0", 200.0), "slot-1": (7, "slot-1", 100.0)}


def rank_restart_whose_load_fails_on_rank_1(root: str) -> dict:
    h = _ds()
    h._setup_env()
    import time

    import cpuckpt.integrations.deepspeed as ckpt_ds
    import torch.distributed as dist

    from cpuckpt.errors import CpuckptError

    ckpt_ds.install(_settings(str(Path(root) / "ram"), persist_every=0))
    engine = h._engine(2, seed=3)
    if dist.get_rank() == 1:  # a file only rank 1 reads turns out unreadable inside DeepSpeed's own load

        def load_checkpoint(load_dir, tag=None, **kwargs):
            raise OSError(5, "Input/output error", f"{load_dir}/{tag}/zero_pp_rank_1_mp_rank_00_optim_states.pt")

        engine.load_checkpoint = load_checkpoint
    t0 = time.monotonic()
    try:
        ckpt_ds.load_latest(engine, Path(root) / "ckpt")
        out = {"error": None}
    except (CpuckptError, OSError) as e:
        out = {"error": type(e).__name__, "message": str(e)}
    out["s"] = time.monotonic() - t0
    engine.checkpoint_engine.memory_tier.close(persist_newest=False)
    ckpt_ds.uninstall()
    return out


@pytest.mark.timeout(300)
def test_a_load_that_fails_on_one_rank_fails_on_every_rank(run_ranks, tmp_path):
    """``load_latest`` with the memory tier: DeepSpeed's ``load_checkpoint`` raising on rank 1 only (an unreadable
    file) left rank 0 waiting in the tier's next collective until the group's timeout. Both ranks now raise,
    naming rank 1's error and the tag."""
    run_ranks(2, rank_memory_only_then_damaged, str(tmp_path), "none", timeout_s=150)
    _wait_writers_gone(tmp_path / "ram")
    for r in run_ranks(2, rank_restart_whose_load_fails_on_rank_1, str(tmp_path), timeout_s=150):
        assert r["error"] is not None and "Input/output error" in r["message"], r
        assert "global_step2" in r["message"], r
