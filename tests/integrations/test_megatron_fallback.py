"""Megatron adapter: a restart falls back past a damaged newest checkpoint, on every rank together.

Real 2-rank gloo runs save three iterations with cpuckpt's megatron-core save strategy under one
root in Megatron-LM's layout (``iter_XXXXXXX/`` and the tracker ``latest_checkpointed_iteration.txt``),
then flip one byte of a data file of the newest in place (sizes intact: only the load's crc32c sees
it; rank 1's file alone in one case, which rank 0 would not notice). Then, on both ranks:

- ``load_latest`` (megatron-core ``dist_checkpointing``) loads the second newest bit-exact and
  returns its iteration; with ``fallback_on_corrupt: false`` it raises ``CheckpointCorrupt``;
- the Megatron-LM hook's ``load_checkpoint`` wrapper does the same for a stand-in of
  ``megatron.training.checkpointing`` that picks the iteration as Megatron-LM does
  (``read_metadata(tracker)`` in ``_load_base_checkpoint``, max over ranks, then
  ``dist_checkpointing.load`` with the ``TorchDistLoadShardedStrategy`` the hook replaces); the
  tracker file is left as it was.

Megatron-LM itself is not installed here: a device run checks that ``install()`` wraps its real
``load_checkpoint``.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from cpuckpt.errors import ConfigError

HERE = Path(__file__).resolve().parent
ENV = {"CPU_CI_CUDA_STUBS": "1",
       "PYTHONPATH": os.pathsep.join([str(HERE / "cpu_ci_cuda_stubs"), os.environ.get("PYTHONPATH", "")])}


def _mg():
    """tests/integrations/test_megatron.py's helpers (its sharded state dicts and checks), by path."""
    name = "_cpuckpt_test_megatron_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "test_megatron.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# A stand-in for megatron.training.checkpointing: the names and control flow of Megatron-LM main's
# iteration choice (module globals looked up at call time, as there).
_FAKE_MEGATRON_LM = '''
import os
import torch
import torch.distributed
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

_ARGS = None
_LOADED_ITERATION = None

def get_args():
    return _ARGS

def set_loaded_iteration(value):
    global _LOADED_ITERATION
    _LOADED_ITERATION = value

def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, 'latest_checkpointed_iteration.txt')

def read_metadata(tracker_filename):
    with open(tracker_filename) as f:
        iteration = int(f.read().strip())
    iters = torch.tensor([iteration], dtype=torch.long)
    torch.distributed.all_reduce(iters, op=torch.distributed.ReduceOp.MAX)
    return int(iters[0].item()), False

def _load_base_checkpoint(load_dir, args, sharded_state_dict):
    iteration, release = read_metadata(get_checkpoint_tracker_filename(load_dir))
    set_loaded_iteration(iteration)
    checkpoint_name = os.path.join(load_dir, 'iter_{:07d}'.format(iteration))
    load_strategy = TorchDistLoadShardedStrategy(cache_metadata=False)
    return dist_checkpointing.load(sharded_state_dict, checkpoint_name, load_strategy)

def load_checkpoint(make_sharded_state_dict, load_arg='load'):
    args = get_args()
    state_dict = _load_base_checkpoint(getattr(args, load_arg), args, make_sharded_state_dict())
    return state_dict, state_dict['iteration']
'''


def _fake_megatron_lm(load_dir: str) -> types.ModuleType:
    module = types.ModuleType("fake_megatron_training_checkpointing")
    exec(compile(_FAKE_MEGATRON_LM, module.__name__, "exec"), module.__dict__)
    module._ARGS = types.SimpleNamespace(load=load_dir, ckpt_step=None, non_persistent_ckpt_type=None)
    return module


def _flip(file: Path) -> None:
    """Flip one byte in the middle of ``file`` (tensor data), in place."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# ----------------------------------------------------------------------------------- rank side
def rank_fall_back(root: str, damaged_file: str) -> dict:
    """Save iterations 1..3; rank 0 damages ``damaged_file`` of iteration 3; load it back four ways."""
    import torch.distributed as dist
    from cpuckpt.integrations.megatron import fallback, load_latest, save_strategy
    from cpuckpt.integrations.megatron.hook import patch_training
    from cpuckpt.integrations.megatron.settings import MegatronOptions
    from megatron.core import dist_checkpointing

    from cpuckpt.config import Config
    from cpuckpt.errors import CheckpointCorrupt

    mg = _mg()
    _, _, device = mg._setup()
    root_p = Path(root)
    strategy = save_strategy()
    for step in (1, 2, 3):
        path = root_p / f"iter_{step:07d}"
        path.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(mg._sharded(step, device), str(path), sharded_strategy=strategy)
    dist.barrier()
    if dist.get_rank() == 0:
        (root_p / fallback.TRACKER).write_text("3")
        _flip(root_p / "iter_0000003" / damaged_file)
    dist.barrier()
    caught = _Warnings()
    logging.getLogger("cpuckpt").addHandler(caught)
    out: dict = {}

    # megatron-core: one sharded state dict serves every attempt (dist_checkpointing.load leaves it as it is)
    template = mg._template(device)
    loaded = load_latest(template, root_p)
    mg._check(loaded.state_dict, 2, device)
    out["core"] = (loaded.iteration, loaded.path.name)
    out["warned"] = any("iter_0000003" in m and "falling back" in m for m in caught.messages)
    try:
        load_latest(lambda: mg._template(device), root_p, {"megatron": {"fallback_on_corrupt": False}})
    except CheckpointCorrupt as e:
        out["core_off"] = type(e).__name__
    victim = root_p / "iter_0000003" / damaged_file
    held = victim.read_bytes()
    dist.barrier()
    if dist.get_rank() == 0:
        os.truncate(victim, len(held) // 2)  # committed, incomplete since: never loaded past with fallback off
    dist.barrier()
    try:
        load_latest(lambda: mg._template(device), root_p, {"megatron": {"fallback_on_corrupt": False}})
    except CheckpointCorrupt as e:
        out["core_off_truncated"] = "iter_0000003: committed, but incomplete now" in str(e)
    dist.barrier()
    if dist.get_rank() == 0:
        victim.write_bytes(held)
    dist.barrier()

    # Megatron-LM's load_checkpoint through the hook (patch_training is what install() runs)
    options = MegatronOptions(prepare_pool=False)
    fake = _fake_megatron_lm(str(root_p))
    patch_training(Config(), module=fake, options=options)
    read_metadata = fake.read_metadata
    state, iteration = fake.load_checkpoint(lambda: mg._template(device))
    mg._check(state, 2, device)
    out["hook"] = (iteration, fake._LOADED_ITERATION, fake.read_metadata is read_metadata)
    out["tracker"] = (root_p / fallback.TRACKER).read_text()
    off = _fake_megatron_lm(str(root_p))
    patch_training(Config(), module=off, options=MegatronOptions(prepare_pool=False, fallback_on_corrupt=False))
    try:
        off.load_checkpoint(lambda: mg._template(device))
    except CheckpointCorrupt as e:
        out["hook_off"] = type(e).__name__
    logging.getLogger("cpuckpt").removeHandler(caught)
    dist.barrier()
    if dist.get_rank() == 0:  # an iteration newer than the tracker's (a save never finalized): no candidate
        import shutil

        shutil.copytree(root_p / "iter_0000002", root_p / "iter_0000004")
        out["capped"] = [fallback.next_candidate([(root_p, need)])[0].iteration for need in (True, False)]
        (root_p / fallback.TRACKER).unlink()
        out["capped"].append(fallback.next_candidate([(root_p, False)])[0].iteration)  # no tracker: no cap
        out["no_tracker"] = fallback.next_candidate([(root_p, True)])[0]  # Megatron-LM would load nothing
    return out


@pytest.mark.parametrize("damaged_file", ["__0_0.distcp", "__1_0.distcp"], ids=["rank0-file", "rank1-file"])
def test_damaged_newest_falls_back_on_both_ranks(run_ranks, tmp_path, damaged_file):
    results = run_ranks(2, rank_fall_back, str(tmp_path / "ckpt"), damaged_file, timeout_s=180, env=ENV)
    for rank, r in enumerate(results):
        assert r["core"] == (2, "iter_0000002"), r
        assert r["warned"], "no WARNING naming the damaged iteration"
        assert r["core_off"] == "CheckpointCorrupt" and r["core_off_truncated"], r
        assert r["hook"] == (2, 2, True), r  # Megatron-LM's iteration and loaded iteration; read_metadata restored
        assert r["tracker"] == "3", "the tracker file changed"
        assert r["hook_off"] == "CheckpointCorrupt", r
    assert results[0]["capped"] == [3, 3, 4] and results[0]["no_tracker"] is None


def rank_scan_fails(root: str, clean: str, timeout_s: float) -> dict:
    """``next_candidate`` of ``root``, which rank 0 cannot scan, over a group with a ``timeout_s`` timeout; then of
    ``clean``, to see that the ranks are still in step."""
    import datetime
    import errno
    import time

    import torch.distributed as dist
    from cpuckpt.integrations.megatron import fallback

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    start = time.monotonic()
    try:
        fallback.next_candidate([(root, False)], None, group)
        out: dict = {"type": None}
    except Exception as e:
        out = {"type": type(e).__name__, "message": str(e), "eloop": getattr(e, "errno", None) == errno.ELOOP}
    out["s"] = time.monotonic() - start
    out["after"] = fallback.next_candidate([(clean, False)], None, group)
    return out


def test_scan_failure_raises_on_every_rank_at_once(run_ranks, tmp_path):
    """Rank 0 alone scans; its failure (here: ``os.scandir``'s entry ``iter_0000002`` is a symbolic link to itself,
    ELOOP at its ``stat``, as root too) is raised on both ranks within seconds, not after the group's timeout."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "iter_0000001").mkdir()
    (root / "iter_0000002").symlink_to("iter_0000002")
    (tmp_path / "clean").mkdir()
    timeout_s = 30.0
    results = run_ranks(2, rank_scan_fails, str(root), str(tmp_path / "clean"), timeout_s, timeout_s=2 * timeout_s,
                        env=ENV)
    for r in results:
        assert r["type"] == "StorageIOError" and r["eloop"], r
        assert r["message"].startswith(f"listing the Megatron iterations of {root} failed on rank 0:"), r
        assert "iter_0000002" in r["message"], r
        assert r["s"] < timeout_s / 3, r
        assert r["after"] == (None, []), r
    assert results[0]["message"] == results[1]["message"]


# ----------------------------------------------------------------------------------- one process
def test_settings_fallback_on_corrupt(monkeypatch):
    from cpuckpt.integrations.megatron.settings import resolve_options

    assert resolve_options(None).fallback_on_corrupt is True
    assert resolve_options({"megatron": {"fallback_on_corrupt": False}}).fallback_on_corrupt is False
    with pytest.raises(ConfigError, match=r"megatron\.fallback_on_corrupt"):
        resolve_options({"megatron": {"fallback_on_corrupt": "maybe"}})
    monkeypatch.setenv("CPUCKPT_MEGATRON_FALLBACK_ON_CORRUPT", "false")
    assert resolve_options(None).fallback_on_corrupt is False
    repo = HERE.parents[1]
    for name in ("megatron.yaml", "megatron-memory.yaml"):
        monkeypatch.delenv("CPUCKPT_MEGATRON_FALLBACK_ON_CORRUPT")
        assert resolve_options(str(repo / "configs" / name)).fallback_on_corrupt is True
        monkeypatch.setenv("CPUCKPT_MEGATRON_FALLBACK_ON_CORRUPT", "false")


def test_no_complete_iteration_is_a_first_run(tmp_path):
    from cpuckpt.integrations.megatron import load_latest

    (tmp_path / "iter_0000001").mkdir()  # a save that never committed
    assert load_latest({}, tmp_path) is None
    assert load_latest({}, tmp_path / "missing") is None


def test_wrapper_warns_when_megatron_lm_lacks_a_function(caplog):
    from cpuckpt.integrations.megatron.fallback import fall_back_on_corrupt

    module = types.ModuleType("old_megatron_training_checkpointing")
    module.load_checkpoint = lambda *a, **k: None
    module.get_args = lambda: None
    with caplog.at_level(logging.WARNING, logger="cpuckpt"):
        assert fall_back_on_corrupt(module, importers=[]) is False
    assert "read_metadata" in caplog.text and "get_checkpoint_tracker_filename" in caplog.text
    assert not hasattr(module.load_checkpoint, "_cpuckpt_fallback")


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None, reason="needs Megatron-LM (device run)")
def test_install_wraps_megatron_lm_load_checkpoint():
    import megatron.training.checkpointing as mlm
    from cpuckpt.integrations.megatron.hook import install

    saved = {n: getattr(mlm, n) for n in ("TorchDistSaveShardedStrategy", "TorchDistLoadShardedStrategy",
                                          "load_checkpoint", "cleanup_old_non_persistent_checkpoint")}
    training = sys.modules.get("megatron.training.training")
    try:
        assert install(argv=["pretrain_gpt.py", "--ckpt-format", "cpuckpt"]) is True
        assert getattr(mlm.load_checkpoint, "_cpuckpt_fallback", False)
        # wrapped once, around Megatron-LM's own function (an earlier install in this process may have wrapped it)
        assert mlm.load_checkpoint.__wrapped__ is inspect.unwrap(saved["load_checkpoint"])
        if training is not None and hasattr(training, "load_checkpoint"):
            assert training.load_checkpoint is mlm.load_checkpoint  # imported by name there
    finally:
        for n, v in saved.items():
            setattr(mlm, n, v)
        if training is not None and getattr(training, "load_checkpoint", None) is not saved["load_checkpoint"]:
            training.load_checkpoint = saved["load_checkpoint"]


def test_a_save_megatron_core_never_finalized_is_torn_unless_its_tracker_names_it(tmp_path):
    """An iteration directory cpuckpt committed but megatron-core never finalized (no ``metadata.json``: its finalize
    runs at a later iteration with async saves) is a torn save, which a restart passes over silently: it was called
    damaged, so ``fallback_on_corrupt: false`` raised over it at every restart. Once the tracker names it (written
    after ``metadata.json``), a missing ``metadata.json`` is damage."""
    import torch
    from cpuckpt.integrations.megatron import fallback

    import cpuckpt

    for step in (1, 2):
        cpuckpt.save({"w": torch.full((4,), float(step))}, tmp_path / f"iter_{step:07d}", step=step)
    (tmp_path / "iter_0000001" / "metadata.json").write_text("{}")
    found, passed = fallback.next_candidate([(tmp_path, False)])
    assert found.iteration == 1 and passed == [], (found, passed)
    (tmp_path / fallback.TRACKER).write_text("2")
    found, passed = fallback.next_candidate([(tmp_path, False)])
    assert found.iteration == 1 and len(passed) == 1 and "iter_0000002: committed, but incomplete now" in passed[0]
