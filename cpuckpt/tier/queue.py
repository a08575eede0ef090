"""The trainer -> writer-process protocol: one directory of request and outcome files per rank.

Files, not pipes or a socket: a request must outlive the trainer that made it (a SIGKILLed trainer's
writer still finishes what it owes) and a restarted trainer must see what its predecessor left.

``<queue>/<seq>.json`` is a :class:`PersistRequest` (written atomically: tmp + rename);
``<queue>/<seq>.done`` or ``<seq>.failed`` is the writer's outcome (JSON). A request with neither
is *owed*. ``<queue>/stop`` asks the writer to exit once nothing is owed (normal shutdown).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Outcome", "PersistQueue", "PersistRequest"]


@dataclass(frozen=True)
class PersistRequest:
    """Persist this rank's part of the memory checkpoint in ``slot`` (save ``save_id``) to ``dest``."""

    seq: int
    slot: str
    save_id: str
    step: int | None
    dest: str
    rank: int
    world_size: int
    coordinator: bool
    config: dict[str, Any]  # the core Config as a dict (the writer process builds its own)
    trainer_pid: int
    trainer_lock: str  # the trainer's rank lock: held while the trainer lives (a zombie holds none)
    # "persist" (to dest) or "replicate" (the slot to each of ``partners``: [host, port] pairs; ``source`` is
    # this node's key, ``token`` the job's replica token); see cpuckpt.tier.replica
    kind: str = "persist"
    partners: tuple = ()
    source: str = ""
    token: str = ""
    # kind "files" (a file set: an adapter's own files committed by a marker, cpuckpt.tier.formats): ``files`` are
    # this rank's ([name relative to slot and dest, FileEntry as a dict], ...); ``marker`` is the marker's name (its
    # JSON "save_id" in the slot is the memory commit; the coordinator copies it into dest last); ``saving`` a file
    # that marks dest as being written (created before any byte, removed by the commit); ``pointer`` an optional
    # [path, text] written atomically after the durable commit, unless it names a file set of a newer step
    files: tuple = ()
    marker: str = ""
    saving: str = ""
    pointer: tuple = ()


@dataclass(frozen=True)
class Outcome:
    """What the writer did with one request."""

    seq: int
    ok: bool
    error: str = ""
    seconds: float = 0.0
    nbytes: int = 0


class PersistQueue:
    """One rank's queue directory (created 0700 by the trainer)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def create(self) -> PersistQueue:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self

    # -- trainer side ---------------------------------------------------------------------------
    def next_seq(self) -> int:
        seqs = [int(p.stem) for p in self.path.glob("*.json") if p.stem.isdigit()]
        return max(seqs, default=0) + 1

    def put(self, request: PersistRequest) -> None:
        _write_json(self.path / f"{request.seq:08d}.json", dataclasses.asdict(request))

    def request_stop(self) -> None:
        _write_json(self.path / "stop", {"stop": True})

    def cancel(self, seq: int, why: str) -> None:
        """The trainer withdraws a request (its memory save failed): the writer skips or abandons it."""
        self.finish(Outcome(seq, False, error=f"cancelled: {why}"))

    def clear_stop(self) -> None:
        (self.path / "stop").unlink(missing_ok=True)

    def outcome(self, seq: int) -> Outcome | None:
        for suffix in (".done", ".failed"):
            try:
                data = json.loads((self.path / f"{seq:08d}{suffix}").read_text())
            except (FileNotFoundError, ValueError):
                continue
            return Outcome(**data)
        return None

    # -- both -----------------------------------------------------------------------------------
    def _finished_seqs(self, names: set[str]) -> list[int]:
        return sorted({int(n.split(".")[0]) for n in names
                       if n.endswith((".done", ".failed")) and n.split(".")[0].isdigit()})

    def owed(self) -> list[PersistRequest]:
        """Requests without an outcome, oldest first (one directory listing; only owed requests are read)."""
        names = set(os.listdir(self.path))
        finished = set(self._finished_seqs(names))
        out = []
        for name in sorted(names):
            stem = name[: -len(".json")]
            if not name.endswith(".json") or not stem.isdigit() or int(stem) in finished:
                continue
            try:
                out.append(PersistRequest(**json.loads((self.path / name).read_text())))
            except (OSError, ValueError, TypeError):
                continue  # a torn request cannot exist (atomic rename); a foreign file is ignored
        return out

    def requests(self) -> list[PersistRequest]:
        """Every request still in the queue (owed or finished, not yet pruned), oldest first."""
        out = []
        for name in sorted(os.listdir(self.path)):
            if name.endswith(".json") and name[: -len(".json")].isdigit():
                try:
                    out.append(PersistRequest(**json.loads((self.path / name).read_text())))
                except (OSError, ValueError, TypeError):
                    continue  # pruned meanwhile, or a foreign file
        return out

    def finished(self) -> list[int]:
        """Sequence numbers that have an outcome, oldest first (a directory listing; nothing is read)."""
        return self._finished_seqs(set(os.listdir(self.path)))

    def outcomes(self, seqs: list[int] | None = None) -> list[Outcome]:
        """The outcomes of ``seqs`` (default: every finished request), oldest first."""
        out = []
        for seq in sorted(self.finished() if seqs is None else seqs):
            outcome = self.outcome(seq)
            if outcome is not None:
                out.append(outcome)
        return out

    def prune(self, keep: int = 8) -> None:
        """Trainer: drop finished requests but the newest ``keep`` (the queue must not grow with the run)."""
        finished = self.finished()
        for seq in finished[:-keep] if keep else finished:
            for suffix in (".json", ".done", ".failed"):
                (self.path / f"{seq:08d}{suffix}").unlink(missing_ok=True)

    def stop_requested(self) -> bool:
        return (self.path / "stop").exists()

    # -- writer side ----------------------------------------------------------------------------
    def finish(self, outcome: Outcome) -> None:
        _write_json(self.path / f"{outcome.seq:08d}{'.done' if outcome.ok else '.failed'}", dataclasses.asdict(outcome))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """tmp + rename in the same directory: a reader sees the whole file or none (RAM root: no fsync)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps(data).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
