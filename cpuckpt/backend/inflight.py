"""The in-flight registry: this process's background saves that have not ended yet.

``async_save`` registers each handle; retention and the SIGTERM handler read the registry, so they
never delete a checkpoint that is being written nor abandon one without waiting. Holds handles
only: no threads, no I/O.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["InFlightSave", "pending", "track"]


class InFlightSave(Protocol):
    """What the registry needs of a save handle."""

    path: str

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> None: ...


_LOCK = threading.Lock()
_SAVES: list[InFlightSave] = []


def track(handle: InFlightSave) -> None:
    """Register a save that has started; it leaves the registry once ``handle.done()``."""
    with _LOCK:
        _SAVES[:] = [h for h in _SAVES if not h.done()]
        _SAVES.append(handle)


def pending() -> list[InFlightSave]:
    """The registered saves that have not ended (committed or failed), oldest first."""
    with _LOCK:
        _SAVES[:] = [h for h in _SAVES if not h.done()]
        return list(_SAVES)
