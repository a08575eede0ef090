"""The Megatron adapter's ``prepare_pool``: the host pool is reserved after the first optimizer step.

Real megatron-core optimizer classes (``MegatronOptimizer`` subclasses, wrapped the way the hook wraps
them), a real torch Adam inside, one process: the first step starts the reservation on a background
thread, sized from the model and the optimizer state; the first ``cpuckpt.async_save`` of that state
then stages into the prepared pool (the same pool object, not a replacement); a nested step (as
``ChainedOptimizer`` nests its optimizers' steps) sizes from the outermost optimizer only.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from cpuckpt.integrations.megatron import prepare
from megatron.core.optimizer.optimizer import MegatronOptimizer

import cpuckpt
from cpuckpt.config import Config
from cpuckpt.transfer import staging


class TinyOptimizer(MegatronOptimizer):
    """A megatron-core optimizer class around a torch Adam (the abstract methods a step needs only)."""

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer,
                 children: list[TinyOptimizer] | None = None) -> None:
        self.optimizer = inner
        self.model_chunks = [model]
        self.children = children or []
        self.steps = 0

    def step(self):  # type: ignore[override]
        for child in self.children:  # nested, as ChainedOptimizer runs its optimizers
            child.step()
        self.optimizer.step()
        self.steps += 1
        return True, None, None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def prepare_grads(self) -> bool:
        return False

    def step_with_ready_grads(self) -> bool:
        return True

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor(1.0)

    def reload_model_params(self, state_dict=None) -> None:
        pass

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def sharded_state_dict(self, *args, **kwargs):
        raise NotImplementedError


CFG = {"io": {"chunk_bytes": "1MiB", "threads": 2}, "staging": {"pin": False}, "timeout_s": 60}


@pytest.fixture
def preparing(fresh_pool):
    """No pool before or after (tests/conftest.py), and no preparer left for later optimizer steps."""
    yield
    prepare.stop_preparing()  # the wrapped steps of this process call no preparer after the test


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 256))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_first_step_prepares_the_pool_the_first_save_uses(preparing, tmp_path):
    model = _model()
    opt = TinyOptimizer(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    cfg = Config.from_dict(CFG)
    preparer = prepare.PoolPreparer(cfg)
    assert "TinyOptimizer" in prepare.prepare_after_first_step(preparer)

    model(torch.randn(16, 512)).sum().backward()
    assert staging.pool_state() == (0, False)
    opt.step()
    prepare.wait_prepared(60)  # what a save does first: never take a pool the preparation then replaces
    made = preparer.preparation
    assert made is not None and made.done and made.nbytes == preparer.nbytes
    assert made.error is None and made.seconds is not None
    # What the checkpoint holds: parameters, BatchNorm's buffers, Adam's moments and step counters.
    adam_state = [t for st in opt.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    want = _bytes(model.parameters()) + _bytes(model.buffers()) + _bytes(adam_state)
    assert preparer.nbytes == int(want * prepare.SLACK)
    pool = staging._POOL
    assert pool is not None and pool.nbytes >= preparer.nbytes

    opt.step()  # later steps start nothing
    assert preparer.preparation is made and made.done

    state = {"model": model.state_dict(), "optim": opt.optimizer.state_dict()}
    handle = cpuckpt.async_save(state, tmp_path / "ckpt", CFG)
    handle.staged.wait()
    handle.wait()
    assert staging._POOL is pool, "the first save replaced the prepared pool"
    back = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    cpuckpt.load(back, tmp_path / "ckpt", CFG)
    for k, v in model.state_dict().items():
        assert torch.equal(back["model"][k], v), k


def test_nested_steps_size_from_the_outermost_optimizer(preparing):
    a, b = _model(), _model()
    inner = TinyOptimizer(a, torch.optim.Adam(a.parameters()))
    outer = TinyOptimizer(b, torch.optim.SGD(b.parameters(), lr=0.1), children=[inner])
    seen: list[object] = []

    class Recorder(prepare.PoolPreparer):
        def after_step(self, optimizer) -> None:
            seen.append(optimizer)

    prepare.prepare_after_first_step(Recorder(Config.from_dict(CFG)))
    for m in (a, b):
        m(torch.randn(4, 512)).sum().backward()
    outer.step()
    assert seen == [outer] and inner.steps == 1


def test_pool_size_follows_the_staging_mode():
    shard = 100 * 2**20
    assert prepare.pool_nbytes(Config.from_dict({}), shard) == shard
    assert prepare.pool_nbytes(Config.from_dict({"async": {"max_in_flight": 2}}), shard) == 2 * shard
    bounded = Config.from_dict({"staging": {"pool_bytes": "64MiB"}, "io": {"chunk_bytes": "4MiB", "threads": 4}})
    assert prepare.pool_nbytes(bounded, shard) == 64 * 2**20  # streaming: the configured pool only


def test_the_estimate_before_the_first_step_covers_the_state_after_it():
    model = _model()
    opt = TinyOptimizer(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    before = prepare.shard_nbytes_estimate(opt)  # no moments yet: two per parameter are expected
    model(torch.randn(16, 512)).sum().backward()
    opt.step()
    after = prepare.state_nbytes(opt)
    steps = [t for st in opt.optimizer.state.values() for k, t in st.items() if k == "step"]
    # the same bytes but Adam's step counters (a few bytes each), within SLACK's margin
    assert int((after - _bytes(steps)) * prepare.SLACK) == before
    assert prepare.shard_nbytes_estimate(opt) == int(after * prepare.SLACK)  # with state: nothing guessed
    # a fully parallel save over 4 data-parallel ranks: a quarter of what every rank holds (no distributed optimizer)
    assert abs(prepare.shard_nbytes_estimate(opt, 0.25) - after * 0.25 * prepare.SLACK) <= 1
    sgd = TinyOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert prepare.shard_nbytes_estimate(sgd) == int(prepare.state_nbytes(sgd) * prepare.SLACK)  # not guessed
