"""What a checkpoint root holds, by name and order: shared by local roots (``roots``) and object-storage roots
(``s3roots``). Pure: no I/O."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from cpuckpt.paths import S3Url

__all__ = ["CHECKPOINT_FILE", "LATEST_NAME", "LEFTOVER_FILE", "LOADING_PREFIX", "REMOVING_PREFIX", "CheckpointInfo",
           "ordered"]

LATEST_NAME = "latest"
LOADING_PREFIX = ".cpuckpt-loading-"
# a DeepSpeed tag ``cpuckpt clean`` moved aside to delete it: never a checkpoint, never listed
REMOVING_PREFIX = ".cpuckpt-removing-"
# Names a save of cpuckpt or stock DCP leaves in a checkpoint directory (FORMAT.md section 1).
_TMP = r"(\.metadata|\.cpuckpt\.json|__\d+_\.cpuckpt-part\.json)\.tmp"
CHECKPOINT_FILE = re.compile(
    r"^(\.metadata|\.cpuckpt\.json|__\d+_\d+\.distcp|__\d+_\.cpuckpt-part\.json|\.cpuckpt-probe-[0-9a-f]{32}"
    rf"|{_TMP}|\.cpuckpt-loading-.+)$"
)
LEFTOVER_FILE = re.compile(rf"^({_TMP}|__\d+_\.cpuckpt-part\.json|\.cpuckpt-probe-[0-9a-f]{{32}})$")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory (or ``s3://`` prefix) under a root, as ``list_checkpoints`` sees it."""

    path: Path | S3Url  # a directory, or an s3:// prefix
    complete: bool
    step: int | None  # from the manifest; None for stock DCP checkpoints and incomplete ones
    mtime: float  # of .metadata when complete, else of the directory
    reason: str  # why it is incomplete ("" when complete)
    unreadable: bool = False  # it could not be read (not missing): complete or not is unknown; never deleted
    committed: bool = False  # its commit marker was there when it was inspected (``Completeness.committed``)


T = TypeVar("T")


def ordered(items: Iterable[T], step: Callable[[T], int | None], committed: Callable[[T], float],
            name: Callable[[T], str]) -> list[T]:
    """``items`` (checkpoints of one root) oldest first, by the one rule that ``find_latest``,
    retention and ``cpuckpt ls`` share.

    The rule: a checkpoint with a step ranks by ``(step, commit time, name)``. A checkpoint without
    one (a stock ``dcp.save``, a ``StorageWriter`` given no step) counts as having the highest step
    among the checkpoints committed before it (none: below every step), then its commit time decides.
    So a step-less checkpoint ranks above everything committed before it, and a checkpoint committed
    after it ranks above it unless that one has a lower step than those (a late persist of an older
    step). Steps alone would rank a step-less checkpoint below any stepped one, however old; commit
    times alone would let a late persist of an older step win. The result is a total order (one key
    per checkpoint), so every caller agrees.
    """
    items = list(items)
    by_time = sorted(range(len(items)), key=lambda i: (committed(items[i]), name(items[i])))
    effective: dict[int, int] = {}
    highest = -1  # below every real step (steps are >= 0)
    for i in by_time:
        s = step(items[i])
        effective[i] = s if s is not None else highest
        if s is not None:
            highest = max(highest, s)
    keys = {i: (effective[i], committed(items[i]), name(items[i])) for i in range(len(items))}
    return [items[i] for i in sorted(range(len(items)), key=keys.__getitem__)]
