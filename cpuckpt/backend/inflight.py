"""The in-flight registry: this process's save streams, each with the background saves it has not ended.

Each stream (a :class:`cpuckpt.Checkpointer`) keeps its own in-flight saves, bound and order; this
registry only lists the live streams, because its readers ask about the whole process: retention
never deletes a checkpoint that any stream is writing, the SIGTERM handler waits for every stream's
saves, and ``wait_all``/Ctrl-C reach every stream. Streams are held weakly (one nobody holds and
nothing is saving is gone). Holds references only: no threads, no I/O.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Protocol

__all__ = ["InFlightSave", "SaveStream", "pending", "register", "streams", "unregister", "wait_for_writers_of"]


class InFlightSave(Protocol):
    """What the registry's readers need of a save handle."""

    path: str

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> None: ...

    def wait_ended(self, timeout: float | None = None) -> None: ...


class SaveStream(Protocol):
    """What the registry needs of a stream of saves."""

    def pending(self) -> list[InFlightSave]: ...

    def wait_all(self, timeout: float | None = None) -> None: ...

    def cancel_all(self, reason: BaseException | None = None) -> None: ...


_LOCK = threading.Lock()
# Per process because its readers are: retention, the SIGTERM handler and wait_all must see every
# stream's saves. It must not hold saves itself (each stream does) nor keep a stream alive.
_STREAMS: weakref.WeakSet[SaveStream] = weakref.WeakSet()  # type: ignore[type-arg]


def register(stream: SaveStream) -> None:
    """List ``stream`` (it has started a save); registering it again does nothing."""
    with _LOCK:
        _STREAMS.add(stream)


def unregister(stream: SaveStream) -> None:
    """Take a closed ``stream`` off the list."""
    with _LOCK:
        _STREAMS.discard(stream)


def streams() -> list[SaveStream]:
    """The live streams, in no particular order."""
    with _LOCK:
        return list(_STREAMS)


def pending() -> list[InFlightSave]:
    """Every stream's saves that have not ended (committed or failed), each stream's oldest first."""
    return [h for s in streams() for h in s.pending()]


def _same_place(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)


def wait_for_writers_of(path: str, timeout: float | None = None) -> None:
    """Block until no save of this process is still writing ``path``: each has ended, committed or failed (its
    failure stays its own caller's to see). A save into a directory another save is still writing would clear
    and rewrite the files under it, and the earlier save's commit would then name a mix of both (with
    ``async.max_in_flight`` above one, a trainer saving to one "last" directory does this)."""
    for handle in pending():
        if _same_place(handle.path, path):
            handle.wait_ended(timeout)
