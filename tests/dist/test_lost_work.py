"""A whole job SIGKILLed right after it logged a step loses at most one step with ``memory.max_uncommitted: 1``.

Two real gloo ranks train a small model data-parallel (gradients all-reduced, AdamW), a memory checkpoint after
every step, and log each step's loss after the save returned. Every rank SIGKILLs itself right after logging step
K: the whole job dies there. The relaunch loads the newest complete checkpoint and trains on; it must resume from
step K - 1 or newer and log exactly the losses of an uninterrupted run (bit-identical continuation).

Every memory commit is slowed (0.5 s before ``.metadata`` lands, 1.5 s in the control, a fault point of the test-
suite), so the bound cannot hold by luck: the negative control, the default (two saves overlap in a ring of three
slots), resumes two steps back under the same slow commits, and still from memory: with every slot in flight (the
default before ``memory.max_uncommitted``) every slot's commit could be cleared at once, and that relaunch started
from scratch. In the control's killed run the commits after the fifth are held until the kill (however late the
ranks reach it), so steps 6 and 7 are the two saves in flight there.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("lost_work")]  # one reference run

SLOW_COMMIT = "before-rename:.metadata=sleep:0.5"
SLOWER_COMMIT = "before-rename:.metadata=sleep:1.5"  # the control's (its killed run also holds 6 and 7: hold=)
STEPS = 9
HOLD_LIMIT_S = 120.0  # a held commit gives up (raises) after this long: the kill it waits for never came


class _CommitsHeldFrom:
    """Fault handler (:mod:`cpuckpt.faultpoint`): each commit of this process (``before-rename:.metadata``; one
    committer thread, in step order) sleeps ``sleep_s``, and the ``hold_from``-th and every later one is held until
    the process is killed."""

    def __init__(self, sleep_s: float, hold_from: int) -> None:
        self.sleep_s, self.hold_from = sleep_s, hold_from
        self._commits = itertools.count(1)

    def __call__(self, stage: str) -> None:
        if stage != "before-rename:.metadata":
            return
        if next(self._commits) >= self.hold_from:
            time.sleep(HOLD_LIMIT_S)
            raise RuntimeError(f"a held commit: no kill within {HOLD_LIMIT_S:.0f} s")
        time.sleep(self.sleep_s)


def _cfg(ram: str, max_uncommitted: int) -> dict:
    return {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 60,
            "memory": {"root": ram, "slots": 3, "persist_every": 0, "headroom_bytes": 0,
                       "max_uncommitted": max_uncommitted}}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _run(durable: str, ram: str, log: str, kill_after: int | None, max_uncommitted: int, slow: str,
         hold: tuple[float, int] | None = None) -> int:
    """Rank body: resume from the newest checkpoint (if any), train to STEPS; returns the step resumed from.
    ``hold``: (seconds, n) for :class:`_CommitsHeldFrom`, instead of ``slow``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from cpuckpt import faultpoint
    from cpuckpt.testing import faults
    from cpuckpt.tier.memory import MemoryTier

    if slow:
        faults.install(slow)
    if hold is not None:
        faultpoint.set_handler(_CommitsHeldFrom(*hold))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tier = MemoryTier(durable, _cfg(ram, max_uncommitted))

    def state() -> dict:
        model_sd, optim_sd = get_state_dict(model, opt)  # the optimizer's state made even before its first step
        return {"model": model_sd, "optim": optim_sd, "step": step}

    step = 0
    target = state()
    if tier.load_latest(target) is not None:
        set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
        step = target["step"]
    resumed = step
    with open(f"{log}.{rank}", "a") as out:
        while step < STEPS:
            step += 1
            x, y = _batch(step, rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            opt.step()
            opt.zero_grad(set_to_none=True)
            tier.save(state(), step).staged.wait()  # the trainer may change its tensors now
            out.write(f"{step} {loss.item().hex()}\n")  # the job's log: this step is done
            out.flush()
            if step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # every rank, right after logging: the whole job
    tier.close(persist_newest=False)
    return resumed


def _losses(log: Path, rank: int) -> dict[int, str]:
    lines = (Path(f"{log}.{rank}").read_text().split("\n"))
    return {int(s): v for s, v in (line.split() for line in lines if line)}


@pytest.fixture(scope="module")
def reference(rank_runner, tmp_path_factory) -> dict[int, str]:
    """An uninterrupted run's losses per step (rank 0's; the ranks differ only in their batches)."""
    tmp = tmp_path_factory.mktemp("reference")
    rank_runner(2, _run, str(tmp / "durable"), str(tmp / "ram"), str(tmp / "log"), None, 0, "", tmp_path=tmp)
    return _losses(tmp / "log", 0)


def _kill_and_relaunch(run_ranks, tmp_path: Path, kill_after: int, max_uncommitted: int,
                       slow: str = SLOW_COMMIT, hold: tuple[float, int] | None = None) -> tuple[int, dict]:
    args = (str(tmp_path / "durable"), str(tmp_path / "ram"), str(tmp_path / "log"))
    with pytest.raises(AssertionError, match="rank"):
        run_ranks(2, _run, *args, kill_after, max_uncommitted, "" if hold else slow, hold)
    logged = max(_losses(tmp_path / "log", 0))
    assert logged == kill_after, f"the job logged up to step {logged}, killed after {kill_after}"
    resumed = run_ranks(2, _run, *args, None, max_uncommitted, slow)
    assert resumed[0] == resumed[1], f"the ranks resumed from different steps: {resumed}"
    return resumed[0], _losses(tmp_path / "log", 0)


@pytest.mark.parametrize("kill_after", [4, 7])
def test_a_killed_job_resumes_one_step_back_at_most_and_trains_on_bit_identically(run_ranks, tmp_path, reference,
                                                                                  kill_after):
    resumed, losses = _kill_and_relaunch(run_ranks, tmp_path, kill_after, max_uncommitted=1)
    assert kill_after - 1 <= resumed <= kill_after, f"killed after logging step {kill_after}, resumed at {resumed}"
    assert losses == reference, "the resumed run's losses differ from the uninterrupted run's"


def test_negative_control_overlapping_saves_lose_more_under_slow_commits(run_ranks, tmp_path, reference):
    # the killed run's commits sleep 1.5 s, and those of steps 6 and 7 are held until the kill
    resumed, losses = _kill_and_relaunch(run_ranks, tmp_path, 7, max_uncommitted=0, slow=SLOWER_COMMIT,
                                         hold=(1.5, 6))
    # save 7 waited until fewer than 2 older saves ran (5 committed); 6 and 7 were in flight: two steps back, and
    # from memory, not from scratch
    assert resumed == 5, f"resumed at {resumed}"
    assert losses == reference  # still exact: only more steps are redone


def test_max_uncommitted_beyond_the_slots_is_refused(tmp_path):
    from cpuckpt.errors import ConfigError
    from cpuckpt.tier.memory import MemoryTier

    with pytest.raises(ConfigError, match=r"memory\.max_uncommitted is 3; with memory\.slots 3 it must be at most 2"):
        MemoryTier(tmp_path / "durable", _cfg(str(tmp_path / "ram"), 3))
    assert not (tmp_path / "ram").exists()  # refused before anything was made
