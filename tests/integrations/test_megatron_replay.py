"""Replayed state dicts (``megatron.reuse_state_dict``, :mod:`cpuckpt.integrations.megatron.replay`) on 2 gloo ranks.

A real megatron-core ``GPTModel`` (data parallel 2, so half of the replicated tensors are main replicas elsewhere), a
real megatron-core ``FP32Optimizer`` over ``torch.optim.AdamW`` and a real ``OptimizerParamScheduler`` (the learning
rate changes every step) train between saves. Megatron-LM's ``save_checkpoint`` and ``generate_state_dict`` are not
importable without a GPU (``megatron.training`` needs triton): the rank functions below have their shape (the small
parts, the model's and optimizer's sharded state dicts, ``dist_checkpointing.save`` validated at the first save only,
through a fully parallel wrapper) and :func:`replay.install` wraps them as it wraps Megatron-LM's.

Every save is also written by stock megatron-core from a build of its own (a reference); each cpuckpt checkpoint must
hold exactly the reference's values: tensors, the pickled objects and the common state (learning rates, steps,
iteration). A replay that kept a stale tensor, learning rate or step would differ.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

STUBS = str(Path(__file__).resolve().parent / "cpu_ci_cuda_stubs")
ENV = {"CPU_CI_CUDA_STUBS": "1", "PYTHONPATH": os.pathsep.join([STUBS, os.environ.get("PYTHONPATH", "")])}
SAVES = 7


def _setup() -> tuple[int, str]:
    """CPU-CI stubs (no-op with a GPU); this rank and the device its tensors live on."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, STUBS)
    import cpu_ci_cuda_stubs

    cpu_ci_cuda_stubs.install()
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        return dist.get_rank(), "cuda"
    return dist.get_rank(), "cpu"


def _optimizer(model, case: str):
    """megatron-core's FP32Optimizer over AdamW; its constructor's scale tensor is on CUDA, so the base class's
    constructor is called instead (the only thing skipped is that unused scale)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    class Fp32(FP32Optimizer):
        def __init__(self, inner):
            MegatronOptimizer.__init__(self, inner, OptimizerConfig(lr=1e-3), lambda opt, config=None: None)
            self.is_stub_optimizer = False
            self.steps = 0

        def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
            sd = super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata)
            if case == "one_rank":  # a build that gathers (a distributed optimizer's): every rank must build at once
                import torch.distributed as dist

                dist.all_reduce(torch.ones(1))
            if case == "copies":  # a build that gathers or copies: its tensors are not the optimizer's
                for param_state in sd["state"].values():
                    if isinstance(param_state, dict) and "exp_avg" in param_state:
                        param_state["exp_avg"].data = param_state["exp_avg"].data.clone()
            if case == "padding":  # a distributed optimizer's bucket padding: new memory at every build, never read
                import torch.distributed as dist
                from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

                pad = ShardedTensor.from_rank_offsets("optimizer.bucket_0.exp_avg", torch.zeros(4),
                                                      (0, dist.get_rank(), dist.get_world_size()))
                sd["param_state"] = [{"exp_avg": pad, "padding": LocalNonpersistentObject(True)}]
            if case == "derived":  # a value the optimizer's state_dict() does not hold, changing every step
                sd["steps"] = self.steps
            return sd

    return Fp32(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))


def rank_replayed_saves(root: str, cases: list[str]) -> dict:
    """Every case in one launch of the ranks (megatron-core's import is most of a launch), each in ``root/case``."""
    from megatron.core import parallel_state

    _, device = _setup()
    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    for case in cases:
        (Path(root) / case).mkdir(exist_ok=True)  # both ranks make it
        out[case] = _replayed_saves(str(Path(root) / case), case, device)
    return out


def _replayed_saves(root: str, case: str, device: str) -> dict:
    import torch
    import torch.distributed as dist
    from cpuckpt.integrations.megatron import hook, replay
    from cpuckpt.integrations.megatron.compat import mcore_async_kwargs
    from cpuckpt.integrations.megatron.strategy import CpuckptSaveStrategy
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    rank = dist.get_rank()
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               use_cpu_initialization=True, params_dtype=torch.float32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=16).to(device)
    if case == "extra_state":  # a module whose extra state changes every step (Transformer Engine's FP8 metadata)
        class Meta(torch.nn.Module):
            steps = 0

            def get_extra_state(self):
                return {"amax": float(self.steps)}

            def set_extra_state(self, state):
                self.steps = int(state["amax"])

        model.decoder.add_module("meta", Meta())
    optimizer = _optimizer(model, case)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=1e-4, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=2,
                                        lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=20, wd_incr_style="constant")
    args = types.SimpleNamespace(ckpt_assume_constant_structure=True, ckpt_format="torch_dist",
                                 non_persistent_ckpt_type="global", seed=1)
    group = parallel_state.get_data_parallel_group()

    def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=None,
                            optim_sd_kwargs=None, model_sd_kwargs=None, rerun_state=None):
        sd = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
        for i, chunk in enumerate(model):
            sd["model" if len(model) == 1 else f"model{i}"] = chunk.sharded_state_dict(**(model_sd_kwargs or {}))
        if optimizer is not None:
            sd["optimizer"] = optimizer.sharded_state_dict(sd, **(optim_sd_kwargs or {}))
        if opt_param_scheduler is not None:
            sd["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        sd["rng_state"] = rng_state
        return sd

    reuse = replay.StateDictReuse(verify_every=4)
    wrapper = hook.validate_structure_once(types.SimpleNamespace(
        FullyParallelSaveStrategyWrapper=FullyParallelSaveStrategyWrapper))
    queue = AsyncCallsQueue(persistent=False)

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, checkpointing_context=None,
                        non_persistent_ckpt=False):
        rng = ShardedObject("rng_state", [{"torch": torch.get_rng_state(), "it": iteration}], (1, 1), (0, 0),
                            replica_id=rank)
        sd = module.generate_state_dict(args, model, optimizer, opt_param_scheduler, rng, iteration=iteration,
                                        optim_sd_kwargs={"metadata": {"flag": 1}})
        validate = "save_strategy" not in checkpointing_context
        if validate:
            base = CpuckptSaveStrategy(reuse=reuse)
            base.use_cached_ckpt_structure = True
            checkpointing_context["save_strategy"] = wrapper(base, group, True)
        path = Path(root) / f"iter_{iteration}"
        path.mkdir(exist_ok=True)
        request = dist_checkpointing.save(sd, str(path), checkpointing_context["save_strategy"],
                                          async_sharded_save=True, validate_access_integrity=validate,
                                          **mcore_async_kwargs())
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)

    module = types.SimpleNamespace(generate_state_dict=generate_state_dict, save_checkpoint=save_checkpoint,
                                   get_args=lambda: args)
    assert replay.install(module, reuse, importers=[])
    context: dict = {}
    replays, planned = [], []
    for it in range(1, SAVES + 1):
        for p in model.parameters():  # a training step: new values everywhere, learning rate and step advance
            p.grad = torch.randn_like(p)
        states = optimizer.optimizer.state.values()
        if case == "padding":  # (also) a step that is a plain number in the optimizer's state; AdamW steps tensors only
            for param_state in states:
                param_state["step"] = torch.tensor(float(param_state["step"]))
        optimizer.optimizer.step()  # AdamW's own (megatron-core's wrapper clips gradients on CUDA)
        optimizer.steps += 1
        if case == "padding":  # an optimizer whose step is a plain number: new at every step, outside the structure
            for param_state in states:
                param_state["step"] = float(param_state["step"])
        scheduler.step(1)
        if case == "extra_state":
            model.decoder.meta.steps += 1
        if case == "structure" and it == 5:  # a parameter moves to new memory mid-run (the optimizer keeps it)
            p = model.decoder.final_layernorm.weight
            p.data = p.data.clone() + 1
        if case == "state_moved" and it == 5:  # an optimizer state moves to new memory: the old one goes stale
            state = optimizer.optimizer.state[model.decoder.final_layernorm.weight]
            state["exp_avg"] = state["exp_avg"].clone()
        if case == "one_rank" and it == 5 and rank == 0:  # the same on one rank (same values: replicas agree)
            p = model.decoder.final_layernorm.weight
            p.data = p.data.clone()
        ref = Path(root) / f"ref_{it}"  # stock megatron-core, from a build of its own
        ref.mkdir(exist_ok=True)
        rng = ShardedObject("rng_state", [{"torch": torch.get_rng_state(), "it": it}], (1, 1), (0, 0),
                            replica_id=rank)
        dist_checkpointing.save(generate_state_dict(args, [model], optimizer, scheduler, rng, iteration=it,
                                                    optim_sd_kwargs={"metadata": {"flag": 1}}),
                                str(ref), TorchDistSaveShardedStrategy("torch_dist", 1))
        before = reuse.replays
        module.save_checkpoint(it, [model], optimizer, scheduler, checkpointing_context=context)
        replays.append(reuse.replays - before)
        planned.append(context["save_strategy"].base_strategy.last_save_stats.planned)
    queue.close()
    dist.barrier()
    return {"replays": replays, "off": reuse.off, "planned": planned}


def _contents(path: Path, out: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "getvalue") and hasattr(b, "getvalue"):  # a pickled object DCP stored as bytes
        return _equal(torch.load(a, weights_only=False), torch.load(b, weights_only=False))
    return a == b


# 1: before Megatron-LM's context holds its strategy (a save it validates): not replayable; 2 builds (captured), 3
# builds again and verifies, 4-6 replay, 7 builds (the fourth since the last build) and verifies
EXPECTED = {
    "constant": [0, 0, 0, 1, 1, 1, 0],
    "structure": [0, 0, 0, 1, 0, 0, 1],  # 5: the moved parameter makes a build, 6 verifies it
    "state_moved": [0, 0, 0, 1, 0, 0, 1],  # the same for an optimizer state (a replay would write the stale one)
    "one_rank": [0, 0, 0, 1, 0, 0, 1],  # the same on rank 0 only: every rank builds with it (the builds gather)
    # replayed: the padding as captured (its values are never read), the common step from the optimizer's fresh state
    # (a plain number there: a captured one would be stale)
    "padding": [0, 0, 0, 1, 1, 1, 0],
    "extra_state": [0] * SAVES,
    "copies": [0] * SAVES,
    "derived": [0] * SAVES,
}


def test_replayed_saves_write_what_megatron_builds(run_ranks, tmp_path):
    by_rank = run_ranks(2, rank_replayed_saves, str(tmp_path), list(EXPECTED), timeout_s=600, env=ENV)
    for case in EXPECTED:
        _check_case(tmp_path / case, case, [r[case] for r in by_rank])


def _check_case(root: Path, case: str, results: list[dict]) -> None:
    for r in results:
        assert r["replays"] == EXPECTED[case], (case, r)
        if EXPECTED[case][3]:  # replayed at least once: every build is laid out as a replay
            assert all(p.startswith("reused") for p in r["planned"][2:]), (case, " ".join(r["planned"]), r["off"])
    why_off = {"derived": "differed from Megatron's build at optimizer.steps",
               "copies": "is not a view of the model's or optimizer's tensors"}
    for r in results:
        assert (why_off[case] in r["off"]) if case in why_off else r["off"] is None, (case, r["off"])
    for it in range(1, SAVES + 1):
        ours = _contents(root / f"iter_{it}", root / f"ours_{it}.pt")
        ref = _contents(root / f"ref_{it}", root / f"ref_{it}.pt")
        assert ours.keys() == ref.keys(), (case, it, sorted(ours.keys() ^ ref.keys()))
        for k in ref:
            assert _equal(ours[k], ref[k]), f"{case}, save {it}: {k} differs from Megatron's build"
        if (root / f"ref_{it}" / "common.pt").exists():  # megatron-core < 0.20: the common state (rank 0's)
            import torch

            common = [torch.load(root / d / "common.pt", weights_only=False) for d in (f"iter_{it}", f"ref_{it}")]
            assert _equal(*common), f"{case}, save {it}: the common state differs from Megatron's build"


def test_only_saves_megatron_lm_would_not_validate_go_through_reuse():
    """``replay.install``'s wrappers, on stand-ins of Megatron-LM's two functions (``megatron.training`` does not import
    without a GPU): a build is offered to reuse only inside a save under ``--ckpt-assume-constant-structure`` of the
    torch_dist format, not a local non-persistent one, whose checkpointing context already holds a strategy that
    resolves a replay's marker (before that Megatron-LM validates the save); loads always build; a build the strategy
    never took is dropped at the end of the save, also when it raised; a second install moves the saves to its reuse."""
    import torch
    from cpuckpt.integrations.megatron import replay

    args = types.SimpleNamespace(ckpt_assume_constant_structure=True, ckpt_format="torch_dist",
                                 non_persistent_ckpt_type="global")
    model = [torch.nn.Linear(2, 2)]
    built = []

    def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=None):
        built.append(len(model))
        return {"iteration": iteration, "model": {"w": model[0].weight.detach()} if model else {}}

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, checkpointing_context=None,
                        non_persistent_ckpt=False, fail=False):
        module.generate_state_dict(args, model, optimizer, opt_param_scheduler, None, iteration=iteration)
        if fail:
            raise RuntimeError("the save failed")

    module = types.SimpleNamespace(generate_state_dict=generate_state_dict, save_checkpoint=save_checkpoint,
                                   get_args=lambda: args)
    reuse = replay.StateDictReuse()
    assert replay.install(module, reuse, importers=[])
    ours = types.SimpleNamespace(takes_replays=True)

    def offered(context, **kwargs) -> bool:
        before = reuse.saves
        module.save_checkpoint(1, model, None, None, checkpointing_context=context, **kwargs)
        return reuse.saves > before

    assert not offered(None)
    assert not offered({})  # the first save: Megatron-LM validates it
    assert not offered({"save_strategy": types.SimpleNamespace()})  # a strategy that would pass the marker on
    assert offered({"save_strategy": ours})
    assert offered({"save_strategy": ours}, non_persistent_ckpt=True)  # a global non-persistent one is offered
    args.non_persistent_ckpt_type = "local"
    assert not offered({"save_strategy": ours}, non_persistent_ckpt=True)  # nvidia-resiliency-ext's format
    args.non_persistent_ckpt_type = "global"
    args.ckpt_assume_constant_structure = False
    assert not offered({"save_strategy": ours})
    args.ckpt_assume_constant_structure = True
    before = reuse.saves
    module.generate_state_dict(args, model, None, None, None)  # a load's build
    assert reuse.saves == before
    with pytest.raises(RuntimeError, match="the save failed"):
        module.save_checkpoint(2, model, None, None, checkpointing_context={"save_strategy": ours}, fail=True)
    assert reuse.pending is None, "a build the strategy never took outlived its save"
    again = replay.StateDictReuse()
    assert replay.install(module, again, importers=[])
    before = reuse.saves
    module.save_checkpoint(3, model, None, None, checkpointing_context={"save_strategy": ours})
    assert reuse.saves == before and again.saves == 1
