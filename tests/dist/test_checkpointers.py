"""Two ``cpuckpt.Checkpointer``s in one process (two models saving to two roots), on 2 real gloo ranks.

What is proven, with real files and no mocks:

- each stream reuses its own plan, resolved items and file layout while the two alternate saves of
  two different structures (one stream shared by both would plan every save with DCP: the cached
  structure would always be the other model's);
- one stream's save held in its commit (its commit hook waits) neither holds back the other
  stream's next call (each has its own ``max_in_flight: 1`` bound) nor its commit (each has its own
  committer), and ``cpuckpt.wait_all`` still waits for the held one;
- closing one stream leaves the other's caches and saves untouched, and the closed one refuses to save;
- every checkpoint loads bit-exact with the values of its own call.
"""

from __future__ import annotations

import threading
from typing import Any

import _helpers as H
import torch

BASE = {"io": {"chunk_bytes": "64KiB", "threads": 2, "backend": "buffered"}, "timeout_s": 30,
        "async": {"max_in_flight": 1}}


class _Model:
    """A state whose tensors are updated in place between saves, as training does."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tensors = {k: torch.randn(*shape, generator=g) for k, shape in shapes.items()}
        self.step = 0

    def train(self) -> None:
        self.step += 1
        for t in self.tensors.values():
            t.add_(1.0)

    def state(self) -> dict[str, Any]:
        return {"model": self.tensors, "step": self.step}

    def expected(self) -> dict[str, Any]:
        return {"model": {k: v.clone() for k, v in self.tensors.items()}, "step": self.step}


def _check(path: str, want: dict[str, Any]) -> None:
    import cpuckpt

    out = {"model": {k: H.poison(v) for k, v in want["model"].items()}, "step": -1}
    cpuckpt.load(out, path, BASE)
    assert out["step"] == want["step"], (path, out["step"], want["step"])
    for k, v in want["model"].items():
        H.assert_bitexact(out["model"][k], v, f"{path}:{k}")


def _held_commit(released: threading.Event) -> Any:
    """A ``CommitHook`` (``async_save(commit_hook=)``): the coordinator's ordinary commit, once ``released`` is set."""
    import torch.distributed as dist

    def commit(writer: Any, gathered: Any, group: Any, coordinator: int) -> Any:
        if not released.wait(60):
            raise RuntimeError("the held commit was never released")
        outcome = None
        if writer.is_coordinator:
            writer.commit_deferred(gathered)
        box = [outcome]
        dist.broadcast_object_list(box, src=coordinator, group=group)
        return box[0]

    return commit


def rank_two_streams(root: str) -> dict[str, Any]:
    import cpuckpt
    from cpuckpt.errors import CpuckptError

    policy = _Model({"w1": (300, 257), "b1": (257,)}, seed=1)
    value = _Model({"v1": (128, 65), "v2": (65, 3), "vb": (3,)}, seed=2)
    a, b = cpuckpt.Checkpointer(), cpuckpt.Checkpointer()
    out: dict[str, Any] = {"a": [], "b": []}
    for step in range(3):  # interleaved: a, b, a, b, a, b
        for name, model, ckpt in (("a", policy, a), ("b", value, b)):
            want = model.expected()
            h = ckpt.async_save(model.state(), f"{root}/{name}/{step}", BASE, step=step)
            h.staged.wait()
            model.train()  # the checkpoint keeps the values of the call
            h.wait()
            out[name].append((h.stats.planned, h.stats.resolved, h.stats.layout))
            _check(f"{root}/{name}/{step}", want)

    # a's next save is held in its commit; b saves and commits meanwhile (max_in_flight 1 each).
    released = threading.Event()
    want_a = policy.expected()
    held = a.async_save(policy.state(), f"{root}/a/held", BASE, commit_hook=_held_commit(released))
    held.staged.wait()
    want_b = value.expected()
    hb = b.async_save(value.state(), f"{root}/b/meanwhile", BASE)
    hb.wait()
    out["held_while_b_committed"] = not held.done()
    out["pending_a"] = len(a.pending())
    released.set()
    cpuckpt.wait_all()  # every stream of the process: a's held save too
    out["held_done"] = held.done()
    _check(f"{root}/a/held", want_a)
    _check(f"{root}/b/meanwhile", want_b)

    # Closing a leaves b's caches and saves as they were.
    a.close()
    want_b = value.expected()
    h = b.async_save(value.state(), f"{root}/b/after", BASE)
    h.wait()
    out["b_after_close"] = (h.stats.planned, h.stats.resolved)
    _check(f"{root}/b/after", want_b)
    try:
        a.async_save(policy.state(), f"{root}/a/closed", BASE)
        out["closed_refused"] = False
    except CpuckptError as e:
        out["closed_refused"] = "close" in str(e)
    b.close()
    return out


def test_two_checkpointers_keep_their_own_caches_bounds_and_committers(run_ranks, tmp_path):
    results = run_ranks(2, rank_two_streams, str(tmp_path / "ck"), timeout_s=240)
    for r in results:
        for name in ("a", "b"):
            assert r[name][0] == ("dcp", "planner", "planned"), (name, r[name])
            assert r[name][1:] == [("reused", "cached", "cached")] * 2, (name, r[name])
        assert r["held_while_b_committed"] and r["pending_a"] == 1, r
        assert r["held_done"], r
        assert r["b_after_close"] == ("reused", "cached"), r
        assert r["closed_refused"], r
        assert not (tmp_path / "ck" / "a" / "closed" / ".metadata").exists()
