"""SIGKILL sweep: a saving process group is killed at many points; nothing committed is ever lost.

Each kill point gets a fresh checkpoint root holding two complete checkpoints, ``step_0000`` and
``step_0001`` (the *previous* one), and ``latest -> step_0001``. Then 1 or 2 real gloo ranks
(``run_ranks``) save step 2 into ``<root>/step_0002`` with ``checkpoint.update_latest``,
``keep_last: 2`` and ``clean_incomplete`` on, and are SIGKILLed:

- at a byte offset, through the ``io.backend: fault:KILL@<bytes>`` backend (the write that crosses
  the offset is written up to it, then the process dies), on one rank or on both;
- before a data file's final fsync (``fault:KILL@fsync``);
- at a named fault point of the commit path (``cpuckpt.faultpoint``), through the stage actions of
  ``CPUCKPT_TEST_HOOK="<stage>=kill"``: around every
  atomic rename (manifest parts, ``.cpuckpt.json``, ``.metadata``, ``latest``), after the old
  commit is cleared, after the parts are deleted, and half-way through retention's deletion of
  ``step_0000``;
- at a seeded random wall-clock delay while the rank saves several checkpoints in a row.

After each kill: ``find_latest`` returns the previous checkpoint or a checkpoint whose commit
completed before the kill, never a torn one; every checkpoint it can return loads bit-exact (byte
views of random-bit tensors, NaN payloads included); the previous checkpoint always loads
bit-exact; ``latest`` names a complete checkpoint; ``clean_incomplete`` then removes the torn
directory and nothing else. Points are drawn from ``CPUCKPT_SWEEP_SEED`` (default fixed), so a run
is reproducible; ``CPUCKPT_LONG_SWEEP=1`` draws ~5x more byte offsets and wall-clock kills.

By default (``representative``) every kind of kill point runs, each at its fixed offsets and every
stage, but with few seeded random byte offsets and wall-clock kills; the ``full`` sweeps are
``slow`` (``-m slow`` or ``CPUCKPT_SLOW=1``).

The ``fault:`` backends and the stage actions exist only because this module calls
``cpuckpt.testing.faults.install()`` when it is imported, in pytest and in every rank (the harness
loads the module by path in each rank, with the point's ``CPUCKPT_TEST_HOOK`` in its environment).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import cpuckpt
from cpuckpt.testing import faults

# io.backend "fault:KILL@..." and $CPUCKPT_TEST_HOOK: in the ranks too, which load this module by path
faults.install()

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SEED = int(os.environ.get("CPUCKPT_SWEEP_SEED", "20261129"))
LONG = os.environ.get("CPUCKPT_LONG_SWEEP") == "1"
CHUNK = 64 * 1024
BASE = {"io": {"chunk_bytes": CHUNK, "threads": 2, "backend": "buffered"}, "timeout_s": 30,
        "checkpoint": {"update_latest": True, "keep_last": 2, "clean_incomplete": True}}
FIGURES: dict[str, int] = {"points": 0, "killed": 0, "torn": 0, "committed_before_kill": 0, "lost": 0}


def _cfg(backend: str = "buffered") -> dict:
    return {**BASE, "io": {**BASE["io"], "backend": backend}}


def state(k: int, world: int, big: bool = False) -> dict:
    """Step ``k``'s state: per-rank keys (so every rank writes data) of random bit patterns."""
    g = torch.Generator().manual_seed(1000 * k + world)
    sd: dict = {"step": k}
    for r in range(world):
        n = 1 << 18 if big else 40_000
        sd[f"r{r}.w"] = torch.randint(0, 256, (4 * n,), generator=g, dtype=torch.uint8).view(torch.float32)
        sd[f"r{r}.h"] = torch.randint(0, 256, (2 * 3000,), generator=g, dtype=torch.uint8).view(torch.bfloat16)
        sd[f"r{r}.i"] = torch.randint(-9, 9, (777,), generator=g)
    return sd


def _rank_part(sd: dict, rank: int) -> dict:
    return {k: v for k, v in sd.items() if k == "step" or k.startswith(f"r{rank}.")}


def _loads_bitexact(path: Path, k: int, world: int, big: bool = False) -> bool:
    want = state(k, world, big)
    out = {n: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for n, v in want.items()}
    cpuckpt.load(out, path, _cfg())
    return all(torch.equal(out[n].view(torch.uint8), v.view(torch.uint8)) if isinstance(v, torch.Tensor)
               else out[n] == v for n, v in want.items())


# ------------------------------------------------------------------------------------ rank programs


def rank_save(root: str, k: int, world: int, backends: list[str], mode: str) -> str:
    """Save step ``k`` into ``<root>/step_<k>``; this rank's backend is ``backends[rank]``."""
    import torch.distributed as dist

    rank = dist.get_rank()
    sd = _rank_part(state(k, world), rank)
    path = Path(root) / f"step_{k:04d}"
    if mode == "async":
        h = cpuckpt.async_save(sd, path, _cfg(backends[rank]), step=k)
        h.wait()
    else:
        cpuckpt.save(sd, path, _cfg(backends[rank]), step=k)
    return "survived"


def rank_save_until_killed(root: str, k0: int, world: int, delay_s: float, nsaves: int) -> str:
    """Save steps k0, k0+1, ... back to back; a timer SIGKILLs this process after ``delay_s``."""
    import torch.distributed as dist

    rank = dist.get_rank()
    states = [_rank_part(state(k, world, big=True), rank) for k in range(k0, k0 + nsaves)]
    dist.barrier()
    if rank == 0:
        threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
    for k, sd in zip(range(k0, k0 + nsaves), states):
        cpuckpt.save(sd, Path(root) / f"step_{k:04d}", _cfg(), step=k)
    return "survived"


# ------------------------------------------------------------------------------------------ points


def _data_nbytes(tmp_path_factory, world: int) -> int:
    """Bytes one rank writes for step 2 (for choosing byte offsets)."""
    path = tmp_path_factory.mktemp("probe") / "p"
    cpuckpt.save(_rank_part(state(2, world), 0), path, _cfg())
    return (path / "__0_0.distcp").stat().st_size


STAGES_1 = ["clear-commit:done", "before-rename:__0_.cpuckpt-part.json", "after-rename:__0_.cpuckpt-part.json",
            "before-rename:.cpuckpt.json", "after-rename:.cpuckpt.json", "before-rename:.metadata",
            "after-rename:.metadata", "commit:parts-deleted", "before-rename:latest", "after-rename:latest",
            "retention:metadata-removed"]
STAGES_2 = ["clear-commit:done", "before-rename:__1_.cpuckpt-part.json", "after-rename:__1_.cpuckpt-part.json",
            "before-rename:.cpuckpt.json", "before-rename:.metadata", "after-rename:.metadata",
            "commit:parts-deleted", "after-rename:latest"]
# A commit is durable from the .metadata rename on; these stages come after it.
COMMITTED_STAGES = {"after-rename:.metadata", "commit:parts-deleted", "before-rename:latest", "after-rename:latest",
                    "retention:metadata-removed"}


def _points(nbytes_1: int, nbytes_2: int, full: bool = True) -> list[tuple]:
    """(id, world, backends, hook, mode), seeded and reproducible; ``full=False``: 2 (and 1) random offsets."""
    rng = random.Random(SEED)
    pts: list[tuple] = []
    n_rand = 120 if LONG else 20 if full else 2
    offsets = sorted({0, 1, 4095, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, nbytes_1 - 1,
                      *(rng.randrange(nbytes_1) for _ in range(n_rand))})
    for off in offsets:
        pts.append((f"w1-bytes{off}", 1, [f"fault:KILL@{off}"], "", "sync"))
    pts.append(("w1-fsync", 1, ["fault:KILL@fsync"], "", "sync"))
    pts += [(f"w1-{s}", 1, ["buffered"], f"{s}=kill", "sync") for s in STAGES_1]
    pts.append((f"w1-async-bytes{CHUNK + 7}", 1, [f"fault:KILL@{CHUNK + 7}"], "", "async"))
    pts += [(f"w1-async-{s}", 1, ["buffered"], f"{s}=kill", "async")
            for s in ("before-rename:__0_.cpuckpt-part.json", "before-rename:.metadata", "after-rename:.metadata")]
    n2 = 12 if LONG else 3 if full else 1
    for off in sorted({rng.randrange(nbytes_2) for _ in range(n2)}):
        pts.append((f"w2-rank0-bytes{off}", 2, [f"fault:KILL@{off}", "buffered"], "", "sync"))
        pts.append((f"w2-rank1-bytes{off}", 2, ["buffered", f"fault:KILL@{off}"], "", "sync"))
    pts.append(("w2-both-bytes", 2, [f"fault:KILL@{CHUNK + 3}"] * 2, "", "sync"))
    pts.append(("w2-rank1-fsync", 2, ["buffered", "fault:KILL@fsync"], "", "sync"))
    pts += [(f"w2-{s}", 2, ["buffered", "buffered"], f"{s}=kill", "sync") for s in STAGES_2]
    return pts


@pytest.fixture(scope="module")
def templates(tmp_path_factory, rank_runner) -> dict[int, Path]:
    """Per world size: a root with complete step_0000 and step_0001 (saved by that many real ranks)
    and latest -> step_0001."""
    out = {}
    for world in (1, 2):
        root = tmp_path_factory.mktemp(f"template{world}")
        for k in (0, 1):
            rank_runner(world, rank_save, str(root), k, world, ["buffered"] * world, "sync",
                        tmp_path=tmp_path_factory.mktemp("tmpl"), timeout_s=60)
        assert cpuckpt.read_latest(root) == root / "step_0001"
        assert sorted(p.name for p in (root / "step_0001").glob("*.distcp")) == [f"__{r}_0.distcp" for r in
                                                                                range(world)]
        out[world] = root
    return out


def _check_root(root: Path, world: int, *, big: bool = False) -> dict[str, int]:
    """The invariants after a kill; returns {"torn": n, "committed": n} for the figures.

    The previous checkpoint is step_0001 unless later saves committed (wall-clock runs, where
    retention may then delete step_0001, and a kill inside that deletion leaves its directory without
    ``.metadata``, never listed as complete): then it is the newest complete one below the torn save.
    """
    infos = cpuckpt.list_checkpoints(root)
    complete_names = sorted(i.path.name for i in infos if i.complete)
    prev = root / ("step_0001" if "step_0001" in complete_names else complete_names[-2])
    torn = [i.path for i in infos if not i.complete]
    latest = cpuckpt.find_latest(root)
    assert latest is not None and latest not in torn, f"find_latest returned {latest}; torn: {torn}"
    assert latest.name >= prev.name, f"find_latest went back to {latest}"
    k = int(latest.name.split("_")[1])
    assert _loads_bitexact(latest, k, world, big=big and k >= 2), f"{latest} does not load bit-exact"
    kp = int(prev.name.split("_")[1])
    assert _loads_bitexact(prev, kp, world, big=big and kp >= 2), "the previous checkpoint is damaged"
    for i in infos:  # every checkpoint reported complete really loads
        if i.complete and i.path not in (latest, prev):
            n = int(i.path.name.split("_")[1])
            assert _loads_bitexact(i.path, n, world, big=big and n >= 2), f"{i.path} is complete but broken"
    pointer = (root / "latest").read_text().strip()
    assert pointer in {i.path.name for i in infos if i.complete}, f"latest names {pointer!r}, not complete"
    removed = cpuckpt.clean_incomplete(root)
    assert set(torn) <= set(removed)
    assert cpuckpt.find_latest(root) == latest and _loads_bitexact(prev, kp, world, big=big and kp >= 2)
    committed = sum(1 for i in infos if i.complete and i.path.name >= "step_0002")
    return {"torn": len(torn), "committed": committed}


def _run_point(rank_runner, tmp_path: Path, templates, point: tuple) -> None:
    pid, world, backends, hook, mode = point
    root = tmp_path / pid.replace(":", "_").replace("/", "_")
    shutil.copytree(templates[world], root)
    env = {"CPUCKPT_TEST_HOOK": hook} if hook else {}
    FIGURES["points"] += 1
    try:
        rank_runner(world, rank_save, str(root), 2, world, backends, mode, tmp_path=tmp_path, env=env,
                    timeout_s=60, grace_s=0.5)
    except AssertionError as e:  # RankError: a rank died (or raised after its peer died)
        results = getattr(e, "results", None)
        assert results is not None, e
        died = [r for r, res in results.items() if "exit code -9" in res.get("message", "")]
        assert died, f"{pid}: no rank was SIGKILLed: {e}"
        FIGURES["killed"] += 1
    else:
        pytest.fail(f"{pid}: the kill point was never reached (the save completed)")
    fig = _check_root(root, world)
    should_commit = hook.split("=")[0] in COMMITTED_STAGES
    assert fig["committed"] == (1 if should_commit else 0), f"{pid}: {fig}"
    FIGURES["torn"] += fig["torn"]
    FIGURES["committed_before_kill"] += fig["committed"]
    shutil.rmtree(root)


SWEEP = ["representative", pytest.param("full", marks=pytest.mark.slow)]


@pytest.mark.xdist_group("kill_sweep")  # on one worker: the templates (module fixture, ~9 s) made once
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("sweep", SWEEP)
def test_kill_sweep(rank_runner, tmp_path_factory, templates, capsys, sweep, world):
    world_nbytes = {w: _data_nbytes(tmp_path_factory, w) for w in (1, 2)}
    points = _points(world_nbytes[1], world_nbytes[2], full=sweep == "full")
    assert len(points) >= (45 if sweep == "full" else 36)
    points = [p for p in points if p[1] == world]  # one test per world size
    FIGURES.update(dict.fromkeys(FIGURES, 0))
    t0 = time.monotonic()
    failures = []
    for point in points:
        tmp = tmp_path_factory.mktemp("kill")
        try:
            _run_point(rank_runner, tmp, templates, point)
        except AssertionError as e:
            failures.append(f"{point[0]}: {str(e)[:2000]}")
            FIGURES["lost"] += 1
        shutil.rmtree(tmp, ignore_errors=True)
    with capsys.disabled():
        print(f"\nkill sweep ({sweep}, world {world}, seed {SEED}): {len(points)} deterministic kill points, "
              f"{FIGURES['killed']} killed, "
              f"{FIGURES['torn']} torn saves never returned, {FIGURES['committed_before_kill']} committed before "
              f"the kill and loaded bit-exact, {FIGURES['lost']} lost, {time.monotonic() - t0:.1f} s")
    assert not failures, "\n".join(failures)


@pytest.mark.xdist_group("kill_sweep")  # on one worker: the templates (module fixture, ~9 s) made once
@pytest.mark.parametrize("sweep", SWEEP)
def test_wall_clock_kills(rank_runner, tmp_path_factory, templates, capsys, sweep):
    rng = random.Random(SEED + 1)
    n = 30 if LONG else 6 if sweep == "full" else 2  # alternately 1 and 2 ranks
    killed = torn = committed = 0
    for j in range(n):
        world = 1 if j % 2 == 0 else 2
        tmp = tmp_path_factory.mktemp("wall")
        root = tmp / "root"
        shutil.copytree(templates[world], root)
        delay = rng.uniform(0.02, 0.4)
        try:
            rank_runner(world, rank_save_until_killed, str(root), 2, world, delay, 40, tmp_path=tmp, timeout_s=60,
                        grace_s=0.5)
        except AssertionError as e:
            assert getattr(e, "results", None) is not None, e
            killed += 1
        fig = _check_root(root, world, big=True)
        torn += fig["torn"]
        committed += fig["committed"]
        shutil.rmtree(tmp, ignore_errors=True)
    with capsys.disabled():
        print(f"\nwall-clock kills (seed {SEED + 1}): {n} runs, {killed} killed mid-run, {torn} torn saves never "
              f"returned, {committed} checkpoints committed before the kill loaded bit-exact, 0 lost")
    assert killed == n, "some runs finished all their saves before the timer fired"


def test_kill_backend_specs():
    from cpuckpt.testing.faults import KillingBackend
    from cpuckpt.transfer.files import get_backend

    b = get_backend("fault:KILL@65536", ".")
    assert isinstance(b, KillingBackend) and b.kill_after_bytes == 65536 and not b.kill_fsync
    b = get_backend("fault:kill@fsync", ".")
    assert isinstance(b, KillingBackend) and b.kill_fsync
    with pytest.raises(cpuckpt.ConfigError, match="KILL@65536"):
        get_backend("fault:KILL@soon", ".")
