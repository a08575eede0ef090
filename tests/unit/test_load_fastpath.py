"""The load fast path (``backend.fastload``) gives exactly DCP's result, and leaves everything else to DCP.

The reference is stock ``dcp.load`` through the same ``cpuckpt.StorageReader`` (DCP's planner, our
reads): every case compares the whole state dict after both loads, object for object and byte for
byte, and checks which path ``cpuckpt.load`` took (``last_stats.fast_path``).
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import _helpers as H  # tests/dist is on sys.path (tests/conftest.py)
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import cpuckpt
from cpuckpt.backend import collectives, fastload
from cpuckpt.backend.ramread import MappedFile, in_ram

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "b16": torch.randn(300, generator=g).to(torch.bfloat16),
            "i": torch.arange(50, dtype=torch.int64),
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "param": torch.nn.Parameter(torch.randn(8, 8, generator=g)),
        },
        "optim": {"state": {0: {"step": torch.tensor(12.0), "exp_avg": torch.randn(8, 8, generator=g)}}},
        "extra": {"step": 42, "name": "run", "hist": [1.0, 2.0], "pair": (1, "a")},
    }


def _targets(sd: dict) -> dict:
    """Same structure; tensors zeroed (same dtype/shape), non-tensors replaced by placeholders."""
    def conv(v):
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
            return [conv(x) for x in v]
        if isinstance(v, torch.nn.Parameter):
            return torch.nn.Parameter(torch.zeros_like(v))
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        return None
    return conv(sd)


def _same(a, b, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.requires_grad == b.requires_grad, where
        assert torch.equal(a.detach().reshape(-1).view(torch.uint8) if a.numel() else a,
                           b.detach().reshape(-1).view(torch.uint8) if b.numel() else b), where
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _both(path: Path, targets: dict, cfg: dict | None = None, planner=None) -> tuple[dict, dict, bool]:
    """(what cpuckpt.load left, what dcp.load left, whether cpuckpt.load took the fast path)."""
    mine, ref = copy.deepcopy(targets), copy.deepcopy(targets)
    reader = cpuckpt.StorageReader(path, cfg)
    cpuckpt.load(mine, path, cfg, planner=planner, storage_reader=reader)
    dcp.load(ref, storage_reader=cpuckpt.StorageReader(path, cfg), planner=copy.deepcopy(planner))
    return mine, ref, reader.last_stats.fast_path


@pytest.mark.parametrize("verify", ["always", "off"])
def test_fast_path_equals_dcp(tmp_path, verify):
    cfg = {"integrity": {"verify": verify}, "io": {"chunk_bytes": "64KiB"}}
    sd = _state()
    with H.files_per_rank(2):  # several files, as written before io.files_per_rank was removed
        cpuckpt.save(sd, tmp_path / "c", cfg)
    mine, ref, fast = _both(tmp_path / "c", _targets(sd), cfg)
    assert fast
    _same(mine, ref)
    _same(mine["model"], sd["model"])
    assert mine["extra"] == sd["extra"]


def test_dtype_change_and_noncontiguous_targets_take_the_fast_path(tmp_path):
    sd = {"a": torch.randn(40, 30), "b": torch.randn(20, 10).to(torch.bfloat16)}
    cpuckpt.save(sd, tmp_path / "c")
    targets = {"a": torch.zeros(30, 40).t(), "b": torch.zeros(20, 10, dtype=torch.float32)}
    mine, ref, fast = _both(tmp_path / "c", targets)
    assert fast
    _same(mine, ref)
    assert torch.equal(mine["a"], sd["a"]) and torch.equal(mine["b"], sd["b"].float())


def test_stateful_values_are_loaded_through_load_state_dict(tmp_path):
    model = torch.nn.Linear(6, 3)
    cpuckpt.save({"model": model.state_dict(), "n": 5}, tmp_path / "c")

    class Holder:
        def __init__(self) -> None:
            self.module = torch.nn.Linear(6, 3)
            self.loaded = 0

        def state_dict(self):
            return self.module.state_dict()

        def load_state_dict(self, sd):
            self.loaded += 1
            self.module.load_state_dict(sd)

    holder = Holder()
    target = {"model": holder, "n": 0}
    reader = cpuckpt.StorageReader(tmp_path / "c")
    cpuckpt.load(target, tmp_path / "c", storage_reader=reader)
    assert reader.last_stats.fast_path and holder.loaded == 1 and target["n"] == 5 and target["model"] is holder
    assert torch.equal(holder.module.weight, model.weight) and torch.equal(holder.module.bias, model.bias)


def _saved(tmp_path) -> tuple[Path, dict]:
    sd = {"a": {"x": torch.randn(5, 4), "y": torch.arange(6)}, "n": 3}
    cpuckpt.save(sd, tmp_path / "c")
    return tmp_path / "c", sd


def test_partial_load_goes_to_dcp(tmp_path):
    """The checkpoint holds keys the state dict lacks: DCP's pre-2.4 key handling decides, not us."""
    path, sd = _saved(tmp_path)
    mine, ref, fast = _both(path, {"a": {"x": torch.zeros(5, 4)}}, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert not fast
    _same(mine, ref)
    assert torch.equal(mine["a"]["x"], sd["a"]["x"])


def test_a_list_of_dicts_goes_to_dcp(tmp_path):
    """DCP walks into a list holding dicts (an optimizer's param_groups): the fast path does not."""
    sd = {"w": torch.randn(3, 3), "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}]}
    cpuckpt.save(sd, tmp_path / "c")
    mine, ref, fast = _both(tmp_path / "c", _targets(sd))
    assert not fast
    _same(mine, ref)
    assert mine["param_groups"] == sd["param_groups"]


@pytest.mark.parametrize("case", ["missing_in_checkpoint", "shape"])
def test_planning_errors_are_dcps_own(tmp_path, case):
    """What the fast path cannot plan goes to DCP, which raises as it did before (through run_dcp)."""
    path, _ = _saved(tmp_path)
    targets = {"a": {"x": torch.zeros(5, 4), "y": torch.zeros(6, dtype=torch.int64)}, "n": 0}
    if case == "missing_in_checkpoint":
        targets["a"]["z"] = torch.zeros(2)
    else:
        targets["a"]["x"] = torch.zeros(4, 5)
    errors = []
    for load in (lambda t: cpuckpt.load(t, path),
                 lambda t: collectives.run_dcp(lambda: dcp.load(t, storage_reader=cpuckpt.StorageReader(path)),
                                               "load", path)):
        with pytest.raises(cpuckpt.CpuckptError) as info:
            load(copy.deepcopy(targets))
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert ("Missing key" if case == "missing_in_checkpoint" else "Size mismatch") in str(errors[0])


def test_fast_path_failures_are_raised_as_dcps_path_raises_them(tmp_path):
    """A damaged file: the fast path's error is the one run_dcp makes of DCP's path (class and message)."""
    cfg = {"io": {"chunk_bytes": "64KiB"}}
    sd = {f"t{i}": torch.randn(100, 10) for i in range(4)}
    cpuckpt.save(sd, tmp_path / "c", cfg)
    data = next(p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    errors = []
    for load in (lambda t: cpuckpt.load(t, tmp_path / "c", cfg),
                 lambda t: collectives.run_dcp(lambda: dcp.load(t, storage_reader=cpuckpt.StorageReader(
                     tmp_path / "c", cfg)), "load", tmp_path / "c")):
        with pytest.raises(cpuckpt.CheckpointCorrupt) as info:
            load({k: torch.zeros_like(v) for k, v in sd.items()})
        errors.append(info.value)
    assert str(errors[0]) == str(errors[1]) and "checksum mismatch" in str(errors[0])


def test_a_custom_planner_is_honoured(tmp_path):
    """A planner subclass (megatron-core's MCoreLoadPlanner is one) always gets DCP's path: its hooks run."""
    path, sd = _saved(tmp_path)

    class Counting(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__()
            self.committed: list[str] = []

        def commit_tensor(self, read_item, tensor) -> None:
            self.committed.append(read_item.dest_index.fqn)

    planner = Counting()
    reader = cpuckpt.StorageReader(path)
    targets = {"a": {"x": torch.zeros(5, 4), "y": torch.zeros(6, dtype=torch.int64)}, "n": 0}
    cpuckpt.load(targets, path, planner=planner, storage_reader=reader)
    assert not reader.last_stats.fast_path and sorted(planner.committed) == ["a.x", "a.y"]
    assert torch.equal(targets["a"]["x"], sd["a"]["x"]) and targets["n"] == 3


def test_plan_fast_refuses_what_dcp_walks_differently(tmp_path):
    path, _ = _saved(tmp_path)
    md = cpuckpt.StorageReader(path).read_metadata()
    ok = {"a": {"x": torch.zeros(5, 4), "y": torch.zeros(6, dtype=torch.int64)}, "n": 0}
    assert fastload.plan_fast(ok, md) is not None
    assert fastload.plan_fast(ok, md, DefaultLoadPlanner(flatten_sharded_tensors=False)) is None
    duplicated = {"a.x": torch.zeros(5, 4), "a": {"x": torch.zeros(5, 4), "y": torch.zeros(6)}, "n": 0}
    assert fastload.plan_fast(duplicated, md) is None
    assert fastload.plan_fast({**ok, "n": [torch.zeros(1)]}, md) is None  # a list DCP walks into
    assert fastload.plan_fast({**ok, "a": {**ok["a"], "x": torch.zeros(5, 4, device="meta")}}, md) is None
    assert fastload.plan_fast({**ok, "n": torch.zeros(1)}, md) is None  # tensor where bytes were saved


def test_loads_from_a_ram_filesystem_map_the_files_and_still_verify(tmp_path):
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK) and in_ram(shm / "x")):
        pytest.skip("no writable tmpfs at /dev/shm")
    root = Path(os.environ.get("CPUCKPT_TEST_SHM", shm)) / f"cpuckpt-test-{os.getpid()}-{tmp_path.name}"
    root.mkdir(parents=True)
    try:
        sd = {f"t{i}": torch.randn(100, 10) for i in range(20)}
        cfg = {"io": {"chunk_bytes": "64KiB"}}
        cpuckpt.save(sd, root / "c", cfg)
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        reader = cpuckpt.StorageReader(root / "c", cfg)
        cpuckpt.load(out, root / "c", cfg, storage_reader=reader)
        assert reader.last_stats.mapped_files == 1 and reader.last_stats.fast_path
        assert all(torch.equal(out[k], v) for k, v in sd.items())
        data = next(p for p in (root / "c").iterdir() if p.suffix == ".distcp")
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
        with pytest.raises(cpuckpt.CheckpointCorrupt, match="checksum mismatch"):
            cpuckpt.load(out, root / "c", cfg)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def test_mapped_file_gives_the_files_bytes(tmp_path):
    f = tmp_path / "f.bin"
    payload = os.urandom(10000)
    f.write_bytes(payload)
    with MappedFile(f, len(payload)) as m:
        assert bytes(m.view()) == payload and m.tensor().numel() == len(payload)
    with MappedFile(f, 0) as m:
        assert m.tensor().numel() == 0


def test_stock_checkpoints_take_the_fast_path_too(tmp_path):
    sd = {"w": torch.randn(30, 3), "meta": {"k": "v"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "c"))
    mine, ref, fast = _both(tmp_path / "c", {"w": torch.zeros(30, 3), "meta": {"k": None}})
    assert fast
    _same(mine, ref)
    assert torch.equal(mine["w"], sd["w"]) and mine["meta"] == {"k": "v"}
