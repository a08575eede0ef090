"""Named fault points: places in the commit path where a test may act. A no-op unless a test installs a handler.

Production code calls :func:`hit` at each stage (``before-rename:<name>``, ``fsync-dir:<name>`` between the
rename and the directory's fsync, ``after-rename:<name>``,
``clear-commit:done``, ``commit:parts-deleted``, ``retention:metadata-removed``,
``megatron-worker:rank<r>``, ``persist-chunk:<file>:<chunk>`` between reading a chunk of a memory
image and writing it to the durable file, ``replicate:step<N>`` before a writer sends step N's replica,
``s3-part:<file>:<chunk>`` before a chunk is uploaded as a part to object storage; on object storage
``before-rename:.metadata``/``after-rename:.metadata`` surround the conditional PUT that commits;
``s3-complete:<name>`` between the HEAD and the GET of a prefix's ``.metadata`` in ``check_complete``;
``clean:incomplete:<name>`` before cleaning deletes an incomplete ``s3://`` prefix).
Nothing a user can configure (YAML, environment) installs a handler:
only code does, through :func:`set_handler` (``cpuckpt.testing.faults.install`` in the test-suite).
Unset, :func:`hit` costs one global read.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["get_handler", "hit", "set_handler"]

Handler = Callable[[str], None]

# Per process: tests install it once for every thread that hits a fault point (worker processes get it
# pickled). Must not be set by product code.
_HANDLER: Handler | None = None


def hit(stage: str) -> None:
    """Reach the fault point ``stage``: the installed handler (if any) may sleep, raise or kill here."""
    handler = _HANDLER
    if handler is not None:
        handler(stage)


def set_handler(handler: Handler | None) -> Handler | None:
    """Install ``handler`` (``None`` removes it) for this process; returns the previous one."""
    global _HANDLER
    previous, _HANDLER = _HANDLER, handler
    return previous


def get_handler() -> Handler | None:
    """The installed handler, e.g. to hand it (picklable) to a worker process started by a framework."""
    return _HANDLER
