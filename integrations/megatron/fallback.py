"""Restart past damage: load the newest Megatron checkpoint that loads cleanly, else the next newest.

A root in Megatron-LM's layout holds ``iter_<iteration, 7 digits>/`` directories and the tracker file
``latest_checkpointed_iteration.txt`` (written once a save finalized). The candidates are its
*complete* iteration directories, newest first: cpuckpt's completeness check
(:func:`cpuckpt.backend.committed.check_complete`: ``.metadata`` committed and readable, every data
file the manifest lists there with its size) plus megatron-core's ``metadata.json`` (written when the
save finalized), no newer than the tracker's iteration when there is a tracker (a newer directory is
a save Megatron-LM never finalized). A load that fails with
:class:`~cpuckpt.errors.IntegrityError` (:class:`~cpuckpt.errors.CheckpointCorrupt`: a chunk's crc32c;
a short or missing file) fails on every rank at once (``cpuckpt.load`` agrees failures across ranks,
so a bad file of one rank moves them all), is logged as a WARNING naming the directory and why, and
the next newest candidate is loaded, by every rank together. Nothing on disk changes (the tracker
stays). No verification pass runs before a load: with nothing damaged, the cost is one load.

Two entry points:

- :func:`load_latest`, for megatron-core's ``dist_checkpointing`` directly (no Megatron-LM needed);
- :func:`fall_back_on_corrupt`, which the Megatron-LM hook (:mod:`.hook`) applies to
  ``megatron.training.checkpointing.load_checkpoint`` with ``megatron: {fallback_on_corrupt: true}``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from cpuckpt.backend.collectives import checkpoint_group, from_rank
from cpuckpt.backend.committed import check_complete
from cpuckpt.errors import CheckpointCorrupt, IntegrityError, UnsafeCheckpointError
from cpuckpt.paths import local_path

from .compat import replace_function

__all__ = ["TRACKER", "Candidate", "LatestLoad", "fall_back_on_corrupt", "load_latest", "next_candidate"]

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's get_checkpoint_tracker_filename
_ITER = re.compile(r"^iter_(\d{7,})$")
# The directory the Megatron-LM hook's load strategy loads (hook.py). Per process, as the load_checkpoint
# it wraps is (one function of megatron.training, loads run one at a time on the trainer's thread).
_LOADING: list[str | None] = [None]


class Candidate(NamedTuple):
    """A complete iteration directory. ``rank`` orders directories of equal iteration across roots
    (Megatron-LM prefers a non-persistent checkpoint of the same iteration: it ranks higher)."""

    iteration: int
    rank: int
    path: str

    @property
    def key(self) -> tuple[int, int]:
        return self.iteration, self.rank


class LatestLoad(NamedTuple):
    """What :func:`load_latest` loaded: ``dist_checkpointing.load``'s state dict, its iteration and directory."""

    state_dict: Any
    iteration: int
    path: Path


def tracker_iteration(root: str | os.PathLike) -> int | None:
    """The iteration ``root``'s tracker names; None when there is no tracker.

    Raises:
        ValueError: the tracker names no iteration (Megatron-LM's ``release``, garbage).
    """
    try:
        text = (Path(root) / TRACKER).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text)


def _complete(path: Path, tracked: bool) -> tuple[bool, str, bool]:
    """(complete, why not, committed in this same look: incomplete then means damaged since). ``tracked``: the
    root's tracker names this iteration or a later one, so megatron-core finalized it (``metadata.json``, then the
    tracker); without that, a save cpuckpt committed but megatron-core never finalized is torn, not damaged."""
    c = check_complete(path)
    finalized = (path / "metadata.json").is_file()  # written after cpuckpt's commit, before the tracker moves
    committed = (c.committed or c.unreadable) and (finalized or tracked)
    if not c.complete:
        return False, c.reason, committed
    if not finalized:
        return False, "no metadata.json (megatron-core never finalized the save)", committed
    return True, "", committed


def _scan(roots: Sequence[tuple[Path, bool]], below: tuple[int, int] | None) -> tuple[Candidate | None, list[str]]:
    """Rank 0's side of :func:`next_candidate`."""
    names: list[tuple[tuple[int, int], Path, bool]] = []  # (iteration, rank), directory, named by its tracker
    damaged: list[str] = []
    for rank, (root, need_tracker) in enumerate(roots):
        try:
            cap = tracker_iteration(root)
        except (ValueError, OSError) as e:  # "release", garbage: not a root of iterations to fall back in
            damaged.append(f"{root}: its tracker {TRACKER} names no iteration ({e})")
            continue
        if cap is None and need_tracker:
            continue
        try:
            entries = list(os.scandir(root))
        except FileNotFoundError:
            continue
        for entry in entries:
            m = _ITER.match(entry.name)
            if m and entry.is_dir(follow_symlinks=True) and (cap is None or int(m.group(1)) <= cap):
                key = (int(m.group(1)), rank)
                if below is None or key < below:
                    names.append((key, Path(entry.path), cap is not None))
    for key, path, tracked in sorted(names, key=lambda kp: kp[0], reverse=True):
        ok, why, committed = _complete(path, tracked)
        if ok:
            return Candidate(key[0], key[1], str(path)), damaged
        if committed:  # damage after the commit, not a torn save
            damaged.append(f"{path}: committed, but incomplete now ({why})")
    return None, damaged


def next_candidate(roots: Sequence[tuple[str | os.PathLike, bool]], below: tuple[int, int] | None = None,
                   group: Any = None) -> tuple[Candidate | None, list[str]]:
    """The newest complete iteration directory of ``roots`` ranking below ``below``, the same on every rank.

    ``roots``: ``(root, needs_tracker)`` pairs, lowest rank first (a root whose tracker is required but
    missing offers nothing). Collective over ``group`` (the checkpoint gloo group; None: this process
    alone): rank 0 scans (one ``stat`` per file and one ``.metadata`` read per directory it looks at,
    newest first, until one is complete) and broadcasts. Also returns, for the WARNING, the directories
    passed over that were committed but are incomplete now.

    Raises:
        StorageIOError: the scan failed on rank 0 (a root it cannot list, an entry it cannot ``stat``), on
            every rank at once (:func:`~cpuckpt.backend.collectives.from_rank`), not after the group's timeout;
            ``CpuckptError`` for another failure.
    """
    paths = [(Path(local_path(r, "checkpoint root")), bool(t)) for r, t in roots]
    return from_rank(lambda: _scan(paths, below), group,
                      f"listing the Megatron iterations of {', '.join(str(p) for p, _ in paths)}")


def load_latest(sharded_state_dict: dict[str, Any] | Callable[[], dict[str, Any]], root: str | os.PathLike,
                config: Any = None, *, sharded_strategy: Any = None, fallback_on_corrupt: bool | None = None,
                **load_kwargs: Any) -> LatestLoad | None:
    """``dist_checkpointing.load`` of the newest complete ``iter_*`` of ``root``; on damage, of the next newest.

    Every rank calls it. See the module docstring for the candidates and the fallback. Tensors a
    failed load filled in place are written again by the fallback load (it covers every key of the
    sharded state dict, or it fails), and only the successful load's state dict is returned, so no
    data of a damaged checkpoint remains. ``dist_checkpointing.load`` leaves the sharded state dict
    it is given unchanged, so one dict serves every attempt; ``sharded_state_dict`` may also be a
    function building it (``lambda: model.sharded_state_dict()``), called once per attempt.

    Args:
        sharded_state_dict: what to load, or a function returning it.
        root: the checkpoint root (``iter_XXXXXXX`` directories, optionally the tracker file).
        config: as for :func:`.load_strategy` (its ``megatron:`` block may hold ``fallback_on_corrupt``).
        sharded_strategy: the load strategy; default ``load_strategy(config)`` (only cpuckpt's verifies
            checksums: with another strategy, damage surfaces as whatever that strategy raises).
        fallback_on_corrupt: default the config's ``megatron.fallback_on_corrupt`` (true). False: the
            newest complete checkpoint's ``IntegrityError`` is raised.
        load_kwargs: passed to ``dist_checkpointing.load`` (``strict``, ``validate_access_integrity``).

    Returns:
        :class:`LatestLoad` (the same iteration and path on every rank), or None when ``root`` holds no
        complete iteration directory (a first run).

    Raises:
        CheckpointCorrupt: no candidate loads, or committed ones are damaged and none loads (each
            reason in the message): never a fresh start over checkpoints that exist.
        IntegrityError: with ``fallback_on_corrupt`` false, the newest does not verify, or was committed and is
            incomplete since (``CheckpointCorrupt``).
    """
    from megatron.core import dist_checkpointing

    from .settings import split_config
    from .strategy import CpuckptLoadStrategy

    cfg, options = split_config(config)
    fallback = options.fallback_on_corrupt if fallback_on_corrupt is None else fallback_on_corrupt
    strategy = sharded_strategy if sharded_strategy is not None else CpuckptLoadStrategy(cfg)
    group = checkpoint_group(None, cfg.timeout_s)
    failures: list[str] = []
    damaged: list[str] = []
    below: tuple[int, int] | None = None
    while True:
        found, passed = next_candidate([(root, False)], below, group)
        if passed and not fallback:  # committed, damaged since, newer than what would load: the newest is damaged
            raise CheckpointCorrupt(f"{passed[0]}; not loading past it (fallback_on_corrupt is off: repair or remove "
                                    "it, or turn it on)")
        _warn_damaged(passed)
        damaged += passed
        if found is None:
            break
        sd = sharded_state_dict() if callable(sharded_state_dict) else sharded_state_dict
        try:
            state = dist_checkpointing.load(sd, found.path, strategy, **load_kwargs)
        except UnsafeCheckpointError:
            raise  # a refused pickle global: an older checkpoint holds values of the same kinds
        except IntegrityError as e:
            if not fallback:
                raise
            failures.append(f"{found.path}: {e}")
            logger.warning("cpuckpt: %s does not load cleanly (%s); falling back to the next newest checkpoint",
                           found.path, e)
            below = found.key
            continue
        if failures:
            logger.warning("cpuckpt: loaded %s after %d newer checkpoint(s) failed to verify", found.path,
                           len(failures))
        return LatestLoad(state, found.iteration, Path(found.path))
    if failures or damaged:
        raise CheckpointCorrupt(f"no checkpoint under {root} loads cleanly ({'; '.join(failures + damaged)}); "
                                "tensors of the sharded state dict may be partly overwritten: do not train from them")
    logger.info("cpuckpt: no complete iteration directory under %s: nothing loaded", root)
    return None


def _warn_damaged(passed: list[str]) -> None:
    for why in passed:
        logger.warning("cpuckpt: skipping %s", why)


# ----------------------------------------------------------------------------------- Megatron-LM
def fall_back_on_corrupt(module: Any, importers: list[Any] | None = None) -> bool:
    """Wrap ``module.load_checkpoint`` (``megatron.training.checkpointing``) so that a load that fails
    with ``IntegrityError`` loads the next newest complete iteration instead; returns whether it did.

    Megatron-LM picks the iteration in ``_load_base_checkpoint`` from ``read_metadata(tracker)`` (the
    persistent tracker of ``--load``; with ``--non-persistent-ckpt-type global`` first the one of the
    non-persistent directory, preferred when its iteration is not older). The wrapper calls
    ``load_checkpoint`` unchanged; after a failure it calls it again with ``read_metadata`` answering
    the next candidate's iteration for those trackers (no file changes), until one loads.

    No partial data remains: the failure is raised inside ``dist_checkpointing.load``, before
    ``load_checkpoint`` set anything from the checkpoint (model and optimizer ``load_state_dict``,
    the scheduler, RNG states, ``args.consumed_*``, the iteration it returns all come after it). What
    the failed load did write is tensor data in place, and the retry runs ``load_checkpoint`` from
    the start: it builds the sharded state dict from the model and optimizer again and loads every
    tensor of it (a load covers every key, or it fails), then sets all of the above from the
    fallback checkpoint; ``set_loaded_iteration`` records the fallback's iteration.

    Not retried (the error is raised): an iteration asked for with ``--ckpt-step``, a ``release``
    checkpoint, a failure outside cpuckpt's load strategy, and a directory outside the roots above.

    ``importers``: modules that hold ``load_checkpoint`` under that name (default: every loaded
    ``megatron.*`` module; ``megatron.training.training`` imports it by name).
    """
    original = getattr(module, "load_checkpoint", None)
    missing = [n for n in ("load_checkpoint", "read_metadata", "get_checkpoint_tracker_filename", "get_args")
               if getattr(module, n, None) is None]
    if missing:
        logger.warning("cpuckpt: %s has no %s(): a damaged newest checkpoint is not fallen back from (the load "
                       "fails); this Megatron-LM is newer or older than cpuckpt knows",
                       getattr(module, "__name__", module), ", ".join(missing))
        return False
    if getattr(original, "_cpuckpt_fallback", False):
        return True

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        _LOADING[0] = None
        try:
            return original(*args, **kwargs)
        except UnsafeCheckpointError:
            raise  # a refused pickle global: an older checkpoint holds values of the same kinds
        except IntegrityError as e:
            failed, first = _LOADING[0], e
        return _retry(module, original, args, kwargs, failed, first)

    load_checkpoint._cpuckpt_fallback = True  # type: ignore[attr-defined]
    replace_function(module, "load_checkpoint", original, load_checkpoint, importers)
    return True


def _roots(module: Any, margs: Any, load_arg: str) -> list[tuple[str, bool]]:
    """Megatron-LM's roots, lowest rank first: ``--load`` (or ``load_arg``), then the global non-persistent one."""
    load_dir = getattr(margs, load_arg, None)
    roots: list[tuple[str, bool]] = []
    if load_dir:
        roots.append((os.path.abspath(load_dir), True))
    if getattr(margs, "non_persistent_ckpt_type", None) == "global":
        np_dir = getattr(margs, "non_persistent_global_ckpt_dir", None) or (
            os.path.join(load_dir, getattr(module, "_NON_PERSISTENT_CKPT_SUBDIR", "non_persistent")) if load_dir
            else None)
        if np_dir:
            roots.append((os.path.abspath(np_dir), True))
    return roots


def _retry(module: Any, original: Any, args: tuple, kwargs: dict, failed: str | None, first: IntegrityError) -> Any:
    margs = module.get_args()
    load_arg = kwargs.get("load_arg", args[3] if len(args) > 3 else "load")
    roots = _roots(module, margs, load_arg)
    key = _key_of(failed, roots)
    if key is None or getattr(margs, "ckpt_step", None):
        why = ("--ckpt-step names the iteration" if key is not None else
               f"the damaged checkpoint ({failed or 'unknown'}) is not an iter_* directory of {[r for r, _ in roots]}")
        logger.warning("cpuckpt: the checkpoint does not load cleanly (%s); no fallback: %s", first, why)
        raise first
    group = checkpoint_group(None, None)
    failures = [f"{failed}: {first}"]
    logger.warning("cpuckpt: %s does not load cleanly (%s); falling back to the next newest checkpoint", failed, first)
    below: tuple[int, int] = key
    while True:
        found, passed = next_candidate(roots, below, group)
        _warn_damaged(passed)
        failures += passed
        if found is None:
            raise CheckpointCorrupt(f"no checkpoint Megatron-LM could load loads cleanly ({'; '.join(failures)}); "
                                    "the model and optimizer may be partly overwritten: do not train from "
                                    "them") from first
        # --load's tracker answers the candidate's iteration; the non-persistent one too when the candidate is
        # there (Megatron-LM then prefers it), else -1 (no non-persistent checkpoint: --load's is loaded)
        trackers = {os.path.abspath(module.get_checkpoint_tracker_filename(r)):
                    (found.iteration if i in (0, found.rank) else -1, False) for i, (r, _) in enumerate(roots)}
        real = module.read_metadata

        def read_metadata(tracker_filename: str, _trackers: dict = trackers, _real: Any = real) -> Any:
            return _trackers.get(os.path.abspath(tracker_filename)) or _real(tracker_filename)

        module.read_metadata = read_metadata
        _LOADING[0] = None
        try:
            result = original(*args, **kwargs)
        except UnsafeCheckpointError:
            raise  # a refused pickle global: an older checkpoint holds values of the same kinds
        except IntegrityError as e:
            failures.append(f"{found.path}: {e}")
            logger.warning("cpuckpt: %s does not load cleanly (%s); falling back to the next newest checkpoint",
                           found.path, e)
            below = found.key
            continue
        finally:
            module.read_metadata = real
        logger.warning("cpuckpt: loaded %s after %d newer checkpoint(s) failed to verify; the tracker file still "
                       "names the damaged one (a later save replaces it)", found.path, len(failures))
        return result


def _key_of(path: str | None, roots: Sequence[tuple[str, bool]]) -> tuple[int, int] | None:
    if path is None:
        return None
    p = Path(os.path.abspath(path))
    m = _ITER.match(p.name)
    if m is None:
        return None
    for i, (root, _) in enumerate(roots):
        if str(p.parent) == root:
            return int(m.group(1)), i
    return None
