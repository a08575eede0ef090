"""Restart from a checkpoint root: load the newest checkpoint that loads cleanly, falling back past damage.

:func:`cpuckpt.find_latest` reads no checksums (one ``stat`` per file), so a checkpoint whose bytes
rotted after its commit is still "the latest". :func:`load_latest` loads it, and when the load's
checksums (``integrity.verify``) or sizes do not verify, loads the next newest instead, on every rank
together. Entry layer: above ``api`` (it calls :func:`cpuckpt.load`) and ``roots``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from cpuckpt.api import load
from cpuckpt.backend import collectives
from cpuckpt.config import Config, resolve_config
from cpuckpt.errors import CheckpointCorrupt, IntegrityError, UnsafeCheckpointError
from cpuckpt.paths import S3Url, checkpoint_path
from cpuckpt.roots import committed_once, list_checkpoints

__all__ = ["load_latest"]

logger = logging.getLogger(__name__)


def load_latest(
    state_dict: dict[str, Any],
    root: str | os.PathLike,
    config: Config | str | os.PathLike | dict | None = None,
    *,
    fallback_on_corrupt: bool = True,
    process_group: Any = None,
    planner: Any = None,
) -> Path | None:
    """Load the newest complete checkpoint under ``root`` into ``state_dict``; on damage, the next newest.

    Every rank calls it. Candidates are the complete checkpoints of ``root``, newest first
    (:func:`cpuckpt.find_latest`'s order), as rank 0 lists them (every rank tries the same ones). A
    load that fails with :class:`IntegrityError` (a chunk's crc32c differs, a file is short or missing,
    the checkpoint vanished) fails on every rank at once (:func:`cpuckpt.load` agrees failures across
    ranks, so a bad shard on one rank makes all fall back together); it is logged as a WARNING naming
    the checkpoint and why, and the next newest is loaded. Other failures (an I/O error, keys that do
    not match, a timeout) are raised: an older checkpoint would not fix them.

    ``state_dict`` afterwards holds exactly the loaded checkpoint: a failed load may have filled some
    tensors (in place) and replaced some non-tensor values, but the fallback load writes every value
    again (a load must cover every key of ``state_dict``, or it fails). If no candidate loads, the
    contents of ``state_dict`` are undefined: do not train from them.

    Args:
        state_dict: what to load into, as for :func:`cpuckpt.load`.
        root: the checkpoint root (its subdirectories are checkpoints).
        config: reader configuration, as for :func:`cpuckpt.load` (``integrity.verify: always``, the
            default, checks every chunk's crc32c; with ``off`` only sizes are checked).
        fallback_on_corrupt: False: a damaged newest checkpoint is raised, not skipped (one that does not verify,
            or one committed and incomplete since, newer than every complete one).
        process_group, planner: as for :func:`cpuckpt.load`.

    Returns:
        The checkpoint loaded (the same path on every rank), or None when ``root`` has no complete
        checkpoint (it does not exist, is empty, or holds only saves that never committed): a first
        run starts from scratch.

    Raises:
        CheckpointCorrupt: every complete checkpoint failed to load (each one's reason is in the
            message), or one that was committed is damaged and none loads: never an empty start over
            checkpoints that exist.
        IntegrityError: with ``fallback_on_corrupt=False``, the newest checkpoint does not verify.
        ConfigError: ``root`` is a URL other than ``s3://``.
        CpuckptError: any other failure of a load (the same on every rank).

    Example:
        >>> path = cpuckpt.load_latest(state_dict, "/ckpt")
        >>> if path is None:
        ...     pass  # first run: nothing saved yet
    """
    where = checkpoint_path(root, "checkpoint root")  # a directory, or an s3:// root
    root_path = where if isinstance(where, S3Url) else Path(where)
    cfg = resolve_config(config)
    group = collectives.checkpoint_group(process_group, cfg.timeout_s)
    names, damaged = _agreed_candidates(root_path, group)
    for name, why, newest in damaged:
        if newest and not fallback_on_corrupt:
            raise CheckpointCorrupt(f"{root_path / name}: committed, but incomplete now ({why}); not loading an older "
                                    "checkpoint (fallback_on_corrupt is off: repair or remove it, or turn it on)")
        logger.warning("cpuckpt: skipping %s: committed, but incomplete now (%s)", root_path / name, why)
    failures: list[str] = []
    for name in names:
        path = root_path / name
        try:
            load(state_dict, path, cfg, process_group=process_group, planner=planner)
        except UnsafeCheckpointError:
            raise  # a refused pickle global: an older checkpoint holds values of the same kinds
        except IntegrityError as e:
            if not fallback_on_corrupt:
                raise
            failures.append(f"{path}: {e}")
            logger.warning("cpuckpt: %s does not load cleanly (%s); falling back to the next newest checkpoint",
                           path, e)
            continue
        if failures:
            logger.warning("cpuckpt: loaded %s after %d newer checkpoint(s) failed to verify", path, len(failures))
        return path
    if failures or damaged:
        detail = "; ".join(failures + [f"{root_path / n}: {why}" for n, why, _ in damaged])
        raise CheckpointCorrupt(f"no checkpoint under {root_path} loads cleanly ({detail}); the state dict "
                                "may be partly overwritten: do not train from it")
    logger.info("cpuckpt: no complete checkpoint under %s: nothing loaded", root_path)
    return None


def _agreed_candidates(root: Path | S3Url, group: Any) -> tuple[list[str], list[tuple[str, str, bool]]]:
    """Rank 0's complete checkpoints (newest first) and committed-but-incomplete ones (name, why, whether newer than
    every complete one), given to every rank.

    One broadcast: ranks that scanned the root a moment apart (a save committing meanwhile) would
    otherwise try different checkpoints and wait for each other in different loads.
    """
    def listing() -> tuple[list[str], list[tuple[str, str, bool]]]:
        infos = list_checkpoints(root)  # oldest first, by the one order
        names = [c.path.name for c in reversed(infos) if c.complete]
        last = max((i for i, c in enumerate(infos) if c.complete), default=-1)
        # committed once (a .metadata is there) but incomplete now: damage after the commit, not a torn save
        return names, [(c.path.name, c.reason, i > last) for i, c in enumerate(infos)
                       if not c.complete and committed_once(c)]

    return collectives.from_rank(listing, group, f"listing the checkpoints of {root}")

