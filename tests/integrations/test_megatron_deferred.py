"""Saves started after their call (integrations/megatron/deferred.py): what the call must freeze, and a start that
fails leaving the saves recorded after it to the next start point. Real megatron-core objects; no process group."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from cpuckpt.integrations.megatron import deferred, strategy
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor


def test_the_call_freezes_what_the_next_iteration_changes_before_its_optimizer_step():
    counters = {"large_value_counts": {"loss": 1}}  # the rerun state machine's, updated during the backward
    generator = torch.Generator().manual_seed(5)  # an RNG tracker's state with CUDA graphs: advanced by dropout
    on_device = {"exp_avg": torch.empty(2, device="meta")}  # a distributed optimizer's bucket: only its step writes
    bias = torch.zeros(3)
    state = {"rerun": ShardedObject("rerun_state_machine", counters, (1,), (0,), replica_id=0),
             "rng": ShardedObject("rng_state", [generator], (1,), (0,), replica_id=0),
             "bucket": ShardedObject("optimizer.bucket", on_device, (1,), (0,), replica_id=0),
             "extra": ShardedObject("layer._extra_state", None, (1,), (0,), replica_id=0),
             "expert_bias": ShardedTensor.from_rank_offsets("router.expert_bias", bias, replica_id=0),
             "qb_beta": ShardedTensor.from_rank_offsets("router.qb_beta", bias.clone(), replica_id=0)}
    assert strategy._snapshot_eager(state) == 2 and strategy._freeze_objects(state) == 2
    counters["large_value_counts"]["loss"] = 2
    torch.rand(4, generator=generator)
    bias.add_(1.0)
    assert state["rerun"].data == {"large_value_counts": {"loss": 1}}
    assert torch.equal(torch.rand(1, generator=state["rng"].data[0]),
                       torch.rand(1, generator=torch.Generator().manual_seed(5))), "the generator as it was"
    assert state["bucket"].data is on_device and state["extra"].data is None
    assert torch.equal(state["expert_bias"].data, torch.zeros(3)) and state["qb_beta"].data is not bias


def test_a_start_that_fails_leaves_the_saves_after_it_recorded_in_order():
    started: list[str] = []

    def failing() -> None:
        raise RuntimeError("no room")

    try:
        deferred.defer(lambda: started.append("a"))
        deferred.defer(failing)
        deferred.defer(lambda: started.append("c"))
        with pytest.raises(RuntimeError, match="no room"):
            deferred.start_all()
        assert started == ["a"] and len(deferred._STARTS) == 1, "c still recorded"
        assert deferred.start_all() == 1 and started == ["a", "c"]
    finally:
        deferred._STARTS.clear()


def test_a_recorded_save_starts_at_the_end_of_the_model_forward_on_the_trainer_thread_only():
    """With the model's forward as the start point (a one-stage pipeline), a recorded save starts once the forward's
    work is queued, not at the queue's finalize; a forward on another thread or under inference mode starts nothing."""
    import threading

    from cpuckpt.integrations.megatron import hook

    started: list[str] = []
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    setup_calls: list[int] = []

    class Training:  # megatron.training.training's entry point, as the hook wraps it
        @staticmethod
        def setup_model_and_optimizer(*args, **kwargs):
            setup_calls.append(1)
            return [model], object(), None

    assert hook.start_saves_at_forward(Training, stages=lambda: 1)
    assert not hook.start_saves_at_forward(Training, stages=lambda: 1), "installed once"
    assert not deferred._FORWARD_STARTS
    chunks, _, _ = Training.setup_model_and_optimizer()
    (forward_start,) = deferred._FORWARD_STARTS
    try:
        assert setup_calls == [1]
        assert not deferred.forward_will_start(), "no forward ran yet: the finalize still starts"
        deferred.defer(lambda: started.append("save"))
        worker = threading.Thread(target=model, args=(torch.ones(1, 2),))
        worker.start()
        worker.join()
        with torch.inference_mode():
            chunks[0](torch.ones(1, 2))
        assert started == [] and len(deferred._STARTS) == 1, "a forward on another thread or a rollout started it"
        chunks[0](torch.ones(1, 2))
        assert started == ["save"] and not deferred._STARTS
        assert deferred.forward_will_start(), "a forward ran since the last finalize: the next one starts nothing"
        assert not deferred.forward_will_start(), "each finalize observes anew"
    finally:
        deferred._STARTS.clear()
        forward_start.remove()
    assert not deferred._FORWARD_STARTS and not model._forward_hooks


def test_a_finalize_without_a_forward_since_the_last_still_starts_the_recorded_saves(tmp_path):
    """A run whose forward never reaches the hooked module (a full-iteration CUDA graph replays it) keeps the queue's
    finalize as its start point: the watched queue's non-blocking finalize starts what is recorded."""
    from cpuckpt.integrations.megatron import guard

    class Queue:  # megatron-core's AsyncCallsQueue, as the watchdog sees it: no calls pending
        def __init__(self) -> None:
            self.async_calls: list = []

        def maybe_finalize_async_calls(self, blocking=False, no_dist=False):
            return []

    model = torch.nn.Linear(2, 2)
    forward_start = deferred.start_at_forward([model])
    queue = guard.watch_async_queue(Queue(), timeout_s=30)
    started: list[int] = []
    try:
        model(torch.ones(1, 2))  # a forward ran: the next finalize leaves the start to the next forward
        deferred.defer(lambda: started.append(1))
        queue.maybe_finalize_async_calls()
        assert started == [], "started at the finalize although the forward will start it"
        queue.maybe_finalize_async_calls()  # no forward since: the finalize starts it
        assert started == [1]
        deferred.defer(lambda: started.append(2))
        queue.maybe_finalize_async_calls(blocking=True)
        assert started == [1, 2], "a blocking finalize starts what is recorded"
    finally:
        deferred._STARTS.clear()
        forward_start.remove()


def test_a_pipeline_of_several_stages_keeps_the_queue_finalize_as_the_start_point():
    from cpuckpt.integrations.megatron import hook

    model = torch.nn.Linear(2, 2)

    class Training:
        @staticmethod
        def setup_model_and_optimizer():
            return [model], object(), None

    assert hook.start_saves_at_forward(Training, stages=lambda: 2)
    Training.setup_model_and_optimizer()
    assert not deferred._FORWARD_STARTS and not model._forward_hooks


def test_each_wrapper_of_setup_is_found_again_by_a_later_install():
    """The slots' reservation and the forward start both wrap ``setup_model_and_optimizer``: a later install updates
    the reservation's run on its own wrapper (not a copy of its attributes on the outer one) and adds neither twice."""
    from cpuckpt.integrations.megatron import hook

    class Training:
        @staticmethod
        def setup_model_and_optimizer():
            return [torch.nn.Linear(1, 1)], None, None

    first, second = object(), object()
    hook._reserve_slots_after_setup(first, Training)
    reserve = Training.setup_model_and_optimizer
    assert hook.start_saves_at_forward(Training, stages=lambda: 1)
    outer = Training.setup_model_and_optimizer
    hook._reserve_slots_after_setup(second, Training)
    assert not hook.start_saves_at_forward(Training, stages=lambda: 1)
    assert Training.setup_model_and_optimizer is outer
    assert reserve._cpuckpt_run is second and "_cpuckpt_run" not in outer.__dict__


def test_the_forward_start_point_is_an_option_off_by_default():
    from pathlib import Path

    from cpuckpt.integrations.megatron.settings import split_config

    from cpuckpt.errors import ConfigError

    repo = Path(__file__).resolve().parents[2]
    assert split_config(repo / "configs" / "megatron.yaml")[1].start_at == "finalize"
    assert split_config({"megatron": {"ordering": "optimizer", "start_at": "forward"}})[1].start_at == "forward"
    with pytest.raises(ConfigError, match="start_at"):
        split_config({"megatron": {"start_at": "step"}})
