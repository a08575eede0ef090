"""Loading a checkpoint never runs code its non-tensor values name (issue 27, item 4), unless trusted.

A value whose ``__reduce__`` creates a marker file is saved with ``cpuckpt.save``; every load path
(``cpuckpt.load``'s fast path and DCP's planner path, ``dcp.load`` with our reader, the memory tier,
two ranks) refuses it with :class:`UnsafeCheckpointError` naming the key and the global, and the
marker never appears. ``integrity.trusted`` (config or environment) loads it, running the code;
``torch.serialization.safe_globals`` allows a harmless class; plain values still round-trip.
Real files, real DCP, real processes for the 2-rank case.
"""

from __future__ import annotations

import collections
import contextlib
import pathlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import cpuckpt
from cpuckpt.errors import CheckpointCorrupt, UnsafeCheckpointError

CFG: dict[str, Any] = {"io": {"chunk_bytes": "64KiB", "backend": "buffered"}, "timeout_s": 60}


class Touch:
    """Unpickling it creates ``marker``: stands for any code a hostile checkpoint could run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@dataclass
class Point:
    """A harmless user class: allowed only through torch.serialization's allow-list."""

    x: int
    y: float


class DcpPlanner(DefaultLoadPlanner):
    """A planner subclass: cpuckpt.load then takes DCP's planner path (the fast path takes none)."""


class OwnBytesPlanner(DefaultLoadPlanner):
    """A planner with its own load_bytes (full pickle, as DCP's): it gets re-encoded bytes, never the saved ones."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        super().load_bytes(read_item, value)


ROUTES = ["fast", "planner", "own_load_bytes"]


def _planner(route: str) -> DefaultLoadPlanner | None:
    """None takes the fast path; either planner takes DCP's."""
    cls = {"fast": None, "planner": DcpPlanner, "own_load_bytes": OwnBytesPlanner}[route]
    return cls() if cls is not None else None


def _targets() -> dict[str, Any]:
    return {"w": torch.zeros(64, 8), "evil": None, "step": 0}


def _save_evil(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt"
    cpuckpt.save({"w": torch.randn(64, 8), "evil": Touch(str(marker)), "step": 3}, path, CFG)
    assert not marker.exists(), "saving must not run the value's reduce result"
    return path, marker


def _exc_of(failure: Any) -> BaseException:
    """The exception of one of a CheckpointException's failures (DCP keeps ``(exception, frames)``)."""
    return failure[0] if isinstance(failure, tuple) else failure


def _raised_here(err: BaseException) -> BaseException | None:
    """The rank's own error behind ``cpuckpt.load``'s group error (DCP's path wraps it in a CheckpointException)."""
    cause = err.__cause__
    if isinstance(cause, CheckpointException):
        return next((_exc_of(f) for f in cause.failures.values()), None)
    return cause


def _assert_refusal(err: BaseException, key: str = "evil") -> None:
    text = str(err)
    assert isinstance(err, UnsafeCheckpointError) and isinstance(err, CheckpointCorrupt), repr(err)
    assert repr(key) in text and "pathlib.Path" in text, text
    assert "add_safe_globals" in text and "integrity.trusted" in text, text


@pytest.mark.parametrize("route", ROUTES)
def test_cpuckpt_load_refuses_a_value_that_runs_code_and_names_key_and_global(tmp_path, route):
    path, marker = _save_evil(tmp_path)
    reader = cpuckpt.StorageReader(path, CFG)
    with pytest.raises(UnsafeCheckpointError) as info:
        cpuckpt.load(_targets(), path, CFG, storage_reader=reader, planner=_planner(route))
    _assert_refusal(info.value)
    assert str(path) in str(info.value)
    assert reader.last_stats.fast_path == (route == "fast")
    assert not marker.exists(), "the checkpoint's pickled code ran"


def test_dcp_load_with_our_reader_refuses_it_too(tmp_path):
    path, marker = _save_evil(tmp_path)
    with pytest.raises(CheckpointException) as info:
        dcp.load(_targets(), storage_reader=cpuckpt.StorageReader(path, CFG))
    (failure,) = info.value.failures.values()
    _assert_refusal(_exc_of(failure))
    assert not marker.exists()


def test_memory_tier_load_refuses_it(tmp_path):
    from cpuckpt.tier.memory import MemoryTier

    marker = tmp_path / "pwned"
    cfg = {**CFG, "memory": {"root": str(tmp_path / "ram"), "persist_every": 0, "slots": 2, "headroom_bytes": 0,
                             "prepare_slots": False}}
    tier = MemoryTier(tmp_path / "durable", cfg)
    try:
        tier.save({"w": torch.randn(64, 8), "evil": Touch(str(marker)), "step": 3}, 3).wait()
        with pytest.raises(UnsafeCheckpointError) as info:
            tier.load(_targets(), tier.find_latest())
        _assert_refusal(info.value)
        assert tier.loads and tier.loads[-1][1].mapped_files, "the load did not read this process's images"
        assert not marker.exists()
    finally:
        tier.close(persist_newest=False)


@pytest.mark.parametrize("how", ["config", "env"])
def test_trusted_loads_it_with_full_pickle(tmp_path, monkeypatch, how):
    path, marker = _save_evil(tmp_path)
    out = _targets()
    if how == "config":
        cpuckpt.load(out, path, {**CFG, "integrity": {"trusted": True}})
    else:
        monkeypatch.setenv("CPUCKPT_INTEGRITY_TRUSTED", "true")
        cpuckpt.load(out, path, CFG)
    assert marker.exists(), "trusted means full pickle: the value's code runs"
    assert out["step"] == 3 and out["evil"] is None  # Path.touch returns None


@pytest.mark.parametrize("route", ROUTES)
def test_safe_globals_allow_a_harmless_class(tmp_path, route):
    path = tmp_path / "ckpt"
    cpuckpt.save({"w": torch.ones(4), "pt": Point(2, 0.5)}, path, CFG)
    with pytest.raises(UnsafeCheckpointError, match=r"'pt'.*Point") as info:
        cpuckpt.load({"w": torch.zeros(4), "pt": None}, path, CFG, planner=_planner(route))
    local = _raised_here(info.value)  # the group's error carries the message; the rank's own one its fields
    assert isinstance(local, UnsafeCheckpointError) and local.key == "pt", repr(local)
    assert [n.rpartition(".")[2] for n in local.names] == ["Point"], local.names
    before = set(torch.serialization.get_safe_globals())
    with torch.serialization.safe_globals([Point]):
        out = {"w": torch.zeros(4), "pt": None}
        cpuckpt.load(out, path, CFG, planner=_planner(route))
    assert out["pt"] == Point(2, 0.5) and torch.equal(out["w"], torch.ones(4))
    assert set(torch.serialization.get_safe_globals()) == before


def _plain() -> dict[str, Any]:
    return {
        "d": {"a": 1, "b": [1, 2.5, "x", None, True]}, "lst": [1, "two", 3.0], "i": 7, "f": 0.25, "s": "hi",
        "none": None, "tup": (1, (2, "3")), "by": b"\x00\xffraw", "ba": bytearray(b"ab"), "set": {1, 2},
        "cplx": 1 + 2j, "od": (collections.OrderedDict(z=1, a=2),), "size": torch.Size([3, 4]),
        "dtype": torch.bfloat16, "dev": torch.device("cpu"), "tt": (torch.arange(5), torch.ones(2, 2)),
        "arr": np.arange(6, dtype=np.int32).reshape(2, 3), "npf": np.float64(1.5), "npdt": np.dtype("float16"),
        "nprng": np.random.RandomState(3).get_state(), "rec": np.zeros(2, dtype=[("a", "f4"), ("b", "i8")]),
        "objarr": np.array([1, "a", None], dtype=object),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("route", [*ROUTES, "dcp"])
def test_plain_values_round_trip(tmp_path, route):
    path = tmp_path / "ckpt"
    want = {"w": torch.randn(16, 3), **_plain()}
    cpuckpt.save(want, path, CFG)
    before = set(torch.serialization.get_safe_globals())
    out: dict[str, Any] = {"w": torch.zeros(16, 3), **{k: None for k in _plain()}, "d": {"a": None, "b": None}}
    if route == "dcp":
        dcp.load(out, storage_reader=cpuckpt.StorageReader(path, CFG))
    else:
        reader = cpuckpt.StorageReader(path, CFG)
        cpuckpt.load(out, path, CFG, storage_reader=reader, planner=_planner(route))
        assert reader.last_stats.fast_path == (route == "fast")
    bad = [k for k in want if not _same(want[k], out[k])]
    assert not bad, {k: (want[k], out[k]) for k in bad}
    assert set(torch.serialization.get_safe_globals()) == before, "a load left numpy in torch's allow-list"


def test_a_damaged_value_is_checkpoint_corrupt_naming_the_key(tmp_path):
    from cpuckpt.format.unpickle import load_value

    with pytest.raises(CheckpointCorrupt, match=r"/ck: non-tensor value 'k' is not a loadable"):
        load_value(b"not a zip at all", "k", where="/ck")
    with pytest.raises(CheckpointCorrupt, match=r"non-tensor value 'k' is not a loadable") as info:
        load_value(b"PK\x03\x04" + bytes(40), "k")
    assert not isinstance(info.value, UnsafeCheckpointError)


def test_the_error_survives_pickling():
    import pickle

    err = UnsafeCheckpointError("m", key="a.b", names=["os.system"])
    err.rank = 1
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is UnsafeCheckpointError and str(back) == "m" and back.key == "a.b"
    assert back.names == ("os.system",) and back.rank == 1


# -- two ranks ----------------------------------------------------------------------------------

def rank_refuses(root: str) -> dict:
    """Both ranks request the hostile value (fast path), then only rank 1 does (DCP's planner path)."""
    import pathlib as _pathlib

    import torch as _torch
    import torch.distributed as dist

    import cpuckpt as _cpuckpt

    rank = dist.get_rank()
    cfg = {"io": {"chunk_bytes": "64KiB", "backend": "buffered"}, "timeout_s": 60}
    marker = _pathlib.Path(root) / f"pwned{rank}"
    path = _pathlib.Path(root) / "c"
    sd = {"w": _torch.full((32, 4), float(rank)), "evil": Touch(str(marker)), "step": 5}
    _cpuckpt.save(sd, path, cfg)
    seen: dict[str, Any] = {}
    for case, wanted in (("all", True), ("rank1", rank == 1)):
        out = {"w": _torch.zeros(32, 4), "step": 0, **({"evil": None} if wanted else {})}
        reader = _cpuckpt.StorageReader(path, cfg)
        try:
            _cpuckpt.load(out, path, cfg, storage_reader=reader)
            seen[case] = None
        except _cpuckpt.CpuckptError as e:
            seen[case] = (type(e).__name__, str(e), e.rank)
        seen[case + "_fast"] = reader.last_stats.fast_path
    seen["marker"] = marker.exists()
    return seen


def test_two_ranks_raise_the_same_error_and_run_nothing(run_ranks, tmp_path):
    results = run_ranks(2, rank_refuses, str(tmp_path), timeout_s=120)
    for r in results:
        assert r["all"] is not None and r["all"][0] == "UnsafeCheckpointError", r
        assert r["rank1"] is not None and r["rank1"][0] == "UnsafeCheckpointError" and r["rank1"][2] == 1, r
        assert "'evil'" in r["all"][1] and "pathlib.Path" in r["all"][1], r
        assert r["all_fast"] and not r["rank1_fast"], r
        assert not r["marker"], "a rank ran the checkpoint's pickled code"
    assert results[0]["all"] == results[1]["all"] and results[0]["rank1"] == results[1]["rank1"], results
    assert not list(tmp_path.glob("pwned*"))


# -- megatron-core, two ranks ---------------------------------------------------------------------

def _megatron_rng(rank: int) -> list[dict[str, Any]]:
    """What Megatron's training loop puts in its ``rng_state`` ShardedObject (one entry per rank here)."""
    import random

    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}]


def rank_megatron(root: str) -> dict:
    """megatron-core's dist_checkpointing through cpuckpt's strategies: RNG state and optimizer-like
    ShardedObjects load under the safe defaults; a hostile ShardedObject is refused on both ranks."""
    import pathlib as _pathlib

    import cpuckpt.integrations.megatron as ckpt_mg
    import torch as _torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    import cpuckpt as _cpuckpt

    rank, world = dist.get_rank(), dist.get_world_size()

    def sharded(rng: Any, extra: Any = None) -> dict:
        sd = {"w": ShardedTensor.from_rank_offsets("layer.w", _torch.full((4, 3), float(rank)), (0, rank, world)),
              "rng_state": ShardedObject("rng_state", rng, (world,), (rank,)),
              "opt": ShardedObject("optimizer.param_groups", {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99),
                                   "params": [0, 1]}], "step": _torch.tensor(3)}, (1,), (0,), replica_id=rank)}
        if extra is not None:
            sd["extra"] = ShardedObject("extra", extra, (world,), (rank,))
        return sd

    good = _pathlib.Path(root) / "good"
    good.mkdir(exist_ok=True)
    dist_checkpointing.save(sharded(_megatron_rng(rank)), str(good), sharded_strategy=ckpt_mg.save_strategy())
    loaded = dist_checkpointing.load(sharded(None), str(good), sharded_strategy=ckpt_mg.load_strategy())
    want = _megatron_rng(rank)[0]
    got = loaded["rng_state"][0]
    seen: dict[str, Any] = {
        "random": got["random_rng_state"] == want["random_rng_state"],
        "np": got["np_rng_state"][0] == "MT19937" and bool((got["np_rng_state"][1] == want["np_rng_state"][1]).all()),
        "torch": _torch.equal(got["torch_rng_state"], want["torch_rng_state"]),
        "opt": loaded["opt"]["param_groups"][0]["betas"] == (0.9, 0.99) and int(loaded["opt"]["step"]) == 3,
        "w": _torch.equal(loaded["w"], _torch.full((4, 3), float(rank))),
    }
    marker = _pathlib.Path(root) / f"pwned{rank}"
    bad = _pathlib.Path(root) / "bad"
    bad.mkdir(exist_ok=True)
    dist_checkpointing.save(sharded(_megatron_rng(rank), Touch(str(marker))), str(bad),
                            sharded_strategy=ckpt_mg.save_strategy())
    try:
        dist_checkpointing.load(sharded(None, 0), str(bad), sharded_strategy=ckpt_mg.load_strategy())
        seen["error"] = None
    except _cpuckpt.CpuckptError as e:
        seen["error"] = (type(e).__name__, str(e))
    seen["marker"] = marker.exists()
    return seen


def test_megatron_sharded_objects_load_safely_and_a_hostile_one_is_refused(run_ranks, tmp_path):
    pytest.importorskip("megatron.core")
    results = run_ranks(2, rank_megatron, str(tmp_path), timeout_s=180)
    for r in results:
        assert all(r[k] for k in ("random", "np", "torch", "opt", "w")), r
        assert r["error"] is not None and r["error"][0] == "UnsafeCheckpointError", r
        assert "pathlib.Path" in r["error"][1] and "extra" in r["error"][1], r
        assert not r["marker"], "a rank ran the checkpoint's pickled code"
    assert results[0]["error"] == results[1]["error"]


def test_load_latest_raises_a_refused_value_instead_of_falling_back(tmp_path):
    """A refused global is not damage: ``load_latest`` must not walk back to an older checkpoint (which
    holds values of the same kinds) nor report every checkpoint corrupt."""
    root = tmp_path / "root"
    marker = tmp_path / "pwned"
    cpuckpt.save({"w": torch.randn(64, 8), "evil": None, "step": 1}, root / "step_1", CFG, step=1)
    cpuckpt.save({"w": torch.randn(64, 8), "evil": Touch(str(marker)), "step": 2}, root / "step_2", CFG, step=2)
    with pytest.raises(UnsafeCheckpointError) as info:
        cpuckpt.load_latest(_targets(), root, CFG)
    assert "step_2" in str(info.value)
    assert not marker.exists(), "the checkpoint's pickled code ran"


def test_extra_safe_globals_for_one_load_leave_the_users_allow_list_as_it_was():
    """The adapters' extra classes are added for one load only; an entry the user had added stays afterwards
    (``torch.serialization.safe_globals`` alone removes it on exit: the DeepSpeed engine's load did)."""
    from cpuckpt.format.unpickle import with_safe_globals

    torch.serialization.add_safe_globals([Point])
    try:
        assert with_safe_globals(lambda: 7, [Point, collections.Counter]) == 7
        allowed = torch.serialization.get_safe_globals()
        assert Point in allowed and collections.Counter not in allowed
    finally:
        torch.serialization.clear_safe_globals()


def test_a_numpy_array_loads_when_another_library_allowed_numpy_dtype_itself():
    """megatron-core's import allows ``numpy.dtype`` and a few dtype classes; the pickle then names nothing
    torch refuses by name, yet the dtype class built at load time (Int64DType) is refused: the safe load must
    still allow numpy's own classes (it raised UnsafeCheckpointError naming nothing, in a full suite run)."""
    import io

    from cpuckpt.format.unpickle import load_value

    buf = io.BytesIO()
    torch.save({"arr": np.arange(5)}, buf)
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    with torch.serialization.safe_globals([np.ndarray, np.dtype, np.dtypes.UInt32DType, core.multiarray._reconstruct]):
        out = load_value(buf.getvalue(), "arr")
    assert out["arr"].tolist() == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------------------- .metadata that changes classes


def _poisoned(body: bytes, target: bytes, name: bytes, value: bytes) -> bytes:
    """``body`` (a protocol-4 pickle) preceded by: push the allowed global ``target``, BUILD on it with slot state
    ``{name: value global}``, pop it (what a hostile ``.metadata`` can do with allowed globals alone)."""
    assert body[:2] == b"\x80\x04"
    prefix = (b"c" + target + b"N}" + b"X" + len(name).to_bytes(4, "little") + name + b"c" + value
              + b"s\x86b0")  # SETITEM, TUPLE2, BUILD, POP
    return b"\x80\x04" + prefix + body[2:]


@pytest.mark.parametrize("target,name", [(b"pathlib\nPurePosixPath\n", b"is_absolute"),
                                         (b"torch.serialization\n_get_layout\n", b"__defaults__"),
                                         (b"torch.distributed.checkpoint.metadata\nMetadata\n", b"__eq__")])
def test_a_metadata_that_sets_attributes_of_an_allowed_class_or_function_changes_nothing(tmp_path, target, name):
    """The restricted unpickler filtered globals only: a ``.metadata`` could BUILD on an allowed class itself and
    change it for the whole process (``PurePosixPath.is_absolute = set`` let a load read a file outside the
    checkpoint, and ``ls`` of an untrusted root was enough to poison the process). Each load now gets stand-ins
    of its own for what can be changed."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from cpuckpt.backend.committed import check_complete
    from cpuckpt.format.unpickle import unpickle_metadata

    cpuckpt.save({"w": torch.zeros(4)}, tmp_path / "c", CFG)
    cpuckpt.save({"w": torch.full((4,), 42.0)}, tmp_path / "elsewhere", CFG)
    md = unpickle_metadata((tmp_path / "c" / ".metadata").read_bytes())
    for k, info in md.storage_data.items():  # every data path outside the checkpoint: refused while is_absolute works
        md.storage_data[k] = type(info)(str(tmp_path / "elsewhere" / info.relative_path), info.offset, info.length)
    before = (pathlib.PurePosixPath("/etc").is_absolute(), torch.serialization._get_layout.__defaults__,
              vars(Metadata).get("__eq__"))
    bad = _poisoned(pickle.dumps(md, protocol=4), target, name, b"builtins\nset\n")
    with contextlib.suppress(Exception):
        unpickle_metadata(bad)
    (tmp_path / "c" / ".cpuckpt.json").unlink()  # as a stock checkpoint: the reader parses it
    (tmp_path / "c" / ".metadata").write_bytes(bad)
    with pytest.raises(CheckpointCorrupt):
        cpuckpt.load({"w": torch.zeros(4)}, tmp_path / "c", CFG)
    check_complete(tmp_path / "c")  # listing it changes nothing either
    after = (pathlib.PurePosixPath("/etc").is_absolute(), torch.serialization._get_layout.__defaults__,
             vars(Metadata).get("__eq__"))
    assert after == before


def test_a_metadata_that_changes_a_member_of_an_allowed_enum_is_refused_and_the_member_restored(tmp_path):
    """REDUCE of an allowed enum class returns its process-wide member, and BUILD set its attributes: the pickle was
    refused, but ``_value_`` stayed 42, and every later save pickled a ``.metadata`` no load accepts."""
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from cpuckpt.format.unpickle import unpickle_metadata

    member = next(iter(_MEM_FORMAT_ENCODING))
    cpuckpt.save({"w": torch.zeros(4)}, tmp_path / "c", CFG)
    body = (tmp_path / "c" / ".metadata").read_bytes()
    assert body[:2] == b"\x80\x04"
    name = b"_value_"
    prefix = (b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n" + b"K" + bytes([member.value])
              + b"\x85R" + b"}X" + len(name).to_bytes(4, "little") + name + b"K*sb0")  # its _value_ = 42
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        unpickle_metadata(b"\x80\x04" + prefix + body[2:])
    assert member.value == member._value_ != 42
    cpuckpt.save({"w": torch.ones(4)}, tmp_path / "d", CFG)  # a later save pickles what a load accepts
    out = {"w": torch.zeros(4)}
    cpuckpt.load(out, tmp_path / "d", CFG)
    assert torch.equal(out["w"], torch.ones(4))


def test_a_metadata_that_changes_the_class_of_an_allowed_enums_member_is_refused_and_the_member_restored():
    """BUILD with slot state ``{"__class__": ...}`` on the shared ``WriteItemType.TENSOR`` made it another class for
    the process (its attributes unchanged): comparing, hashing or pickling it failed from then on."""
    import pickle

    from torch.distributed.checkpoint.planner import WriteItemType

    from cpuckpt.format.unpickle import unpickle_metadata

    member = WriteItemType.TENSOR
    name = b"__class__"
    bad = (b"\x80\x04ctorch.distributed.checkpoint.planner\nWriteItemType\n" + b"K" + bytes([member.value]) + b"\x85R"
           + b"N}X" + len(name).to_bytes(4, "little") + name
           + b"ctorch.distributed.checkpoint.metadata\nStorageMeta\n" + b"s\x86b.")
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        unpickle_metadata(bad)
    assert type(member) is WriteItemType and pickle.loads(pickle.dumps(member)) is member
