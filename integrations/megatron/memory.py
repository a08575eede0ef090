"""Megatron-LM checkpoints through cpuckpt's memory tier (``megatron: {memory_tier: true}``).

Megatron-LM already has two kinds of saves, and this maps both onto :class:`cpuckpt.MemoryTier`:

- **Non-persistent global saves** (``--non-persistent-save-interval N --non-persistent-ckpt-type
  global [--non-persistent-global-ckpt-dir D]``) go to ``D/iter_<N>`` (default ``D`` =
  ``<save>/non_persistent``), which Megatron-LM loads when it is newer than the newest persistent
  checkpoint (it compares the two directories' ``latest_checkpointed_iteration.txt``). Here they are
  memory saves: the bytes go into a ring slot of the RAM root (device-to-host straight into reused,
  pinned images), and ``D/iter_<N>`` becomes a symbolic link to that slot. Megatron-LM's own pruning
  of ``D`` (``cleanup_old_non_persistent_checkpoint``) is replaced: the ring is the retention. When
  a slot is reused, the links to it are removed first, and ``D``'s tracker is moved back to the
  newest checkpoint still linked if it named one of them (a tracker never names a slot being
  overwritten).
- **Persistent saves** (``--save-interval``, ``<save>/iter_<N>``) are memory saves plus a persist
  request: the trainer stalls for the device-to-host copy only, the rank's writer process writes the
  durable copy, and Megatron's checkpoint worker waits for the writer's outcome, so Megatron's
  finalize (``metadata.json``, then ``<save>/latest_checkpointed_iteration.txt``) runs only once the
  checkpoint is durable. (A restart before the next memory save therefore reads that checkpoint from
  the durable root: its slot is not linked into ``D``.)

A memory save needs no worker: when the queue its request goes to is watched by cpuckpt (Megatron-LM's, through
the hook), the request carries no ``async_fn`` and the watchdog finalizes it once its commit ended on every rank
(:data:`.guard.DONE_MARK`); on an unwatched queue the worker waits for the commit as for any cpuckpt save.

Memory-only saves never advance ``<save>/latest_checkpointed_iteration.txt``. Megatron-core writes
``common.pt`` (and, at finalize, ``metadata.json``) into the directory it was given; for a memory
save rank 0 moves what is there into the slot before replacing the directory by the link.
A restart needs nothing from cpuckpt: Megatron-LM reads the trackers and loads ``D/iter_<N>``
through the link (a fresh process reads the slot's files from RAM).

Everything here runs on each node's leader (rank 0 on one node) unless it says otherwise; the tier itself is
collective.

Across nodes (ranks on several RAM roots, :mod:`cpuckpt.tier.nodes`) everything Megatron-LM reads from ``D`` is
there on every node: ``D`` must be node-local (each node its own, e.g. under ``/dev/shm``; a ``D`` that several
nodes share is refused with a ``ConfigError`` on every rank at the first save), each node's leader names its own
slot ``D/iter_<N>``, each node's slot holds its ranks' data files, its own ``.metadata`` and node copies of
replicated items (the core tier), and a copy of Megatron's own files: ``common.pt`` (rank 0's bytes, broadcast
at the save) and, once Megatron finalizes the save, ``metadata.json``; each leader then writes its ``D``'s
tracker (:meth:`MegatronMemory.finalized`). At a restart Megatron-LM reads every rank's tracker and all-reduces
the iteration, so the trackers must agree before it reads them: :meth:`MegatronMemory.prepare_restart`
(collective; the Megatron-LM hook runs it before ``load_checkpoint``) agrees on the newest memory checkpoint that
every node holds or gets back from a partner's replica (``memory.replicas``; restored first, reading nothing from
``--save``), gives every node's slot Megatron's files, and makes every ``D`` name it (or name nothing: the
persistent tracker of ``--save`` then wins, and a changed topology reshards from there).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpuckpt.backend.collectives import from_every_rank, from_rank
from cpuckpt.backend.commit import clear_commit
from cpuckpt.backend.committed import check_complete
from cpuckpt.config import Config
from cpuckpt.errors import ConfigError, IntegrityError
from cpuckpt.tier.formats import missing_files
from cpuckpt.tier.memory import MemoryTier
from cpuckpt.tier.queue import PersistRequest
from cpuckpt.transfer.files import write_atomic

from .compat import replace_function
from .guard import finalize_saves_under, is_watched

__all__ = ["TRACKER", "MegatronMemory", "Route", "restart_before_load"]

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_COMMON = "common.pt"  # megatron-core's common (non-sharded) state, written into a save's directory by rank 0
MEGATRON_METADATA = "metadata.json"  # megatron-core writes it into a checkpoint directory when it finalizes the save
_ITER = re.compile(r"iter_(\d+)$")


class Route:
    """Where one Megatron save goes: ``memory`` (non-persistent) or ``durable`` (persistent)."""

    def __init__(self, kind: str, step: int, path: Path) -> None:
        self.kind, self.step, self.path = kind, step, path


class MegatronMemory:
    """Routes Megatron-LM's saves into a :class:`MemoryTier` of the job (one per trainer process).

    Args:
        save_dir: Megatron-LM's ``--save`` (the durable root).
        non_persistent_dir: where Megatron-LM puts non-persistent global checkpoints.
        config: the core cpuckpt config (its ``memory:`` section configures the tier).
    """

    def __init__(self, save_dir: str | os.PathLike, non_persistent_dir: str | os.PathLike, config: Config, *,
                 queue_of: Callable[[], Any] | None = None) -> None:
        self.queue_of = queue_of  # Megatron's async save queue (its pending saves), for finalize_before_reuse
        self._unfinalized: list[list[bool]] = []  # per routed save not finalized yet: [finalized] (see track)
        self.save_dir = Path(os.path.abspath(save_dir))
        self.np_dir = Path(os.path.abspath(non_persistent_dir))
        if self.np_dir == self.save_dir:
            raise ConfigError(f"the non-persistent checkpoint directory must differ from --save ({self.save_dir})")
        self.config = config
        self._tier: MemoryTier | None = None
        self._restarted = False

    # -- routing --------------------------------------------------------------------------------
    @property
    def ring_dirs(self) -> tuple[Path, Path]:
        """The directories whose ``iter_<N>`` saves take a slot of the ring: the non-persistent one and ``--save``."""
        return self.np_dir, self.save_dir

    @property
    def pending_allowed(self) -> int:
        """How many of the newest saves into :attr:`ring_dirs` (either kind) may still be pending (not finalized
        by Megatron) when the next one starts: the next save reuses the slot of the save ``slots`` saves back, so
        that one (and every older one) must be finalized first (its ``metadata.json`` and tracker written while
        its slot still holds it); the ``slots - 1`` newer ones go on, each in its own slot."""
        return self.config.memory.slots - 1

    def finalize_before_reuse(self) -> None:
        """Before every save into the ring (either kind; every rank): Megatron finalizes the pending saves but
        the newest :attr:`pending_allowed` (:func:`.guard.finalize_saves_under`), so the save whose slot is
        about to be refilled has its ``metadata.json`` and tracker written while the slot still holds it.

        Raises:
            ConfigError: more saves are still not finalized than that, and no queue (``queue_of``) is known to
                finalize them (a caller of the strategy that finalizes its own queue too late); on every rank
                alike (Megatron finalizes collectively).
        """
        queue = self.queue_of() if self.queue_of is not None else None
        if queue is not None:
            finalize_saves_under(queue, self.ring_dirs, self.pending_allowed)
        self._unfinalized = [s for s in self._unfinalized if not s[0]]
        if len(self._unfinalized) > self.pending_allowed:
            raise ConfigError(
                f"megatron memory tier: {len(self._unfinalized)} earlier saves into the ring are not finalized, and "
                f"the next save would refill the slot of one of them (memory.slots {self.config.memory.slots}); "
                "finalize the async queue before each save (maybe_finalize_async_calls) or give MegatronMemory "
                "its queue (queue_of)")

    def queue_watched(self) -> bool:
        """Whether the queue this job's saves go to (``queue_of``) is watched by cpuckpt (:func:`.guard.is_watched`):
        then its memory saves are finalized by the watchdog, in the trainer, with no worker process."""
        return self.queue_of is not None and is_watched(self.queue_of())

    @property
    def finalize_before_next_log(self) -> bool:
        """Whether each memory save is finalized before the next iteration is logged, waiting for its commit
        (``memory.max_uncommitted: 1``, on a watched queue): the look before Megatron-LM's ``training_log`` of
        N + 1 (:func:`.guard.finalize_before_log`; without one, its finalize at the top of N + 1) writes D's tracker
        for N, so a kill after the log of N + 1 restarts from N (one iteration lost) — not while a persistent save's
        call is ahead in the queue (its persist is not waited for), nor when Megatron-LM's logits saver moved the
        finalize functions."""
        return self.config.memory.max_uncommitted == 1  # as configured: 0 (slots - 1) is 1 too with 2 slots

    def track(self) -> list[bool]:
        """A routed save's finalized flag: its finalize sets ``flag[0] = True`` (see :meth:`finalize_before_reuse`)."""
        flag = [False]
        self._unfinalized.append(flag)
        return flag

    def prunes(self, save_dir: str | os.PathLike) -> bool:
        """Whether Megatron-LM's pruning of ``save_dir`` is the ring's (:meth:`cleanup`)."""
        return Path(os.path.abspath(save_dir)) == self.np_dir

    def route(self, checkpoint_dir: str | os.PathLike) -> Route | None:
        """The route of a save to ``checkpoint_dir``; None: not Megatron's ``iter_<N>`` under either root."""
        path = Path(os.path.abspath(checkpoint_dir))
        match = _ITER.match(path.name)
        if match is None:
            return None
        if path.parent == self.np_dir:
            return Route("memory", int(match.group(1)), path)
        if path.parent == self.save_dir:
            return Route("durable", int(match.group(1)), path)
        return None

    @property
    def tier(self) -> MemoryTier:
        """The job's tier, made at the first routed save (collective: every rank saves together)."""
        if self._tier is None:
            # Megatron's finalize reports each persist's outcome (the worker waits for it), so the tier
            # does not raise it again at the next save.
            tier = MemoryTier(self.save_dir, self.config, report_persist_failures=False)
            if not tier.nodes.single:
                try:
                    shared = _shared_by_nodes(self.np_dir, tier)
                except BaseException:
                    tier.abandon()  # no collective (an interrupt reaches one rank only); its RAM root kept
                    raise
                if shared:  # agreed (one all-gather): every rank raises together
                    # its RAM root kept: at a restart it may hold the run before's newest checkpoints
                    tier.abandon()
                    raise ConfigError(
                        f"megatron.memory_tier across {tier.nodes.nodes} nodes: the non-persistent checkpoint "
                        f"directory {self.np_dir} is shared by several nodes (or on a network filesystem on some "
                        "node, whose cached listings could hide that); each node names its own RAM root's "
                        "slots there, so it must be node-local: set --non-persistent-global-ckpt-dir to a path on "
                        "each node's own storage (e.g. under /dev/shm)")
            self._tier = tier
        return self._tier

    def save(self, state_dict: dict[str, Any], route: Route, *, planner: Any = None, plan_key: Any = None,
             ordering: str = "host") -> tuple[Any, PersistRequest | None]:
        """Memory save (plus a persist request for a durable route); collective. Returns (handle, request).
        ``ordering`` as for :func:`cpuckpt.async_save` (``stream``: the caller orders its writes on the GPU)."""
        tier = self.tier
        durable = route.kind == "durable"
        # across nodes every node's slot gets rank 0's common.pt (megatron-core wrote it into D/iter_N on node 0)
        given = self._megatron_bytes(route) if route.kind == "memory" and not tier.nodes.single else {}
        handle = tier.save(state_dict, route.step, name=route.path.name, planner=planner, plan_key=plan_key,
                           persist=durable, dest=route.path, ordering=ordering,
                           before_fill=lambda slot: self._link(route, slot, given) if self.names else None)
        return handle, tier.last_persist

    @property
    def keeps_replicas(self) -> bool:
        """Across nodes a save keeps every replica (not only the main one), so that the core tier writes each node's
        own copy of replicated tensors into its slot (:mod:`cpuckpt.tier.nodecopies`). Makes the tier (collective)."""
        return not self.tier.nodes.single

    @property
    def names(self) -> bool:
        """Whether this rank names its node's slots in ``D`` (the node's leader; rank 0 on one node)."""
        return self.tier.nodes.is_leader

    def _megatron_bytes(self, route: Route) -> dict[str, bytes]:
        """Collective: rank 0's Megatron files of ``route`` (``common.pt``; not ``metadata.json``, an earlier
        save's), broadcast to every rank. Small: megatron-core's common state."""
        return from_rank(lambda: {e.name: e.read_bytes() for e in _megatron_files(route.path)
                                   if e.is_file() and e.name != MEGATRON_METADATA},
                          self.tier.group, f"reading Megatron's files of {route.path}")

    def finalized(self, route: Route) -> None:
        """Megatron finalized the memory save of ``route`` on every rank (cpuckpt's finalize step, every rank): across
        nodes each node's leader writes what megatron-core and Megatron-LM write on rank 0 only, into its own slot
        and ``D``: ``metadata.json`` (megatron-core's ``save_config``), then ``D``'s tracker. No collective."""
        if route.kind != "memory" or self._tier is None or self._tier.nodes.single or not self.names:
            return
        _write_megatron_config(route.path)
        write_atomic(self.np_dir / TRACKER, str(route.step).encode(), fsync=False)

    def prepare_restart(self) -> int | None:
        """Collective, across nodes, before Megatron-LM reads its trackers (every rank; once per process): the
        newest checkpoint of both tiers that every node can load. A memory one (every node holds it, or gets it
        back from a partner's replica, restored now: :meth:`cpuckpt.MemoryTier.restore_planned`) gets Megatron's
        files on every node and every ``D`` names it (link and tracker), so Megatron-LM loads it from RAM on every
        rank; otherwise every ``D``'s tracker goes, and Megatron-LM loads ``--save``'s (resharding if the topology
        changed). Returns the memory checkpoint's iteration, or None. On one node only the names of slots saved
        across nodes go (a changed topology: :meth:`_drop_partial_links`), the ring's next save goes past the slot
        ``D``'s tracker names (:meth:`_tracked_slot`), and None is returned."""
        tier = self.tier
        if self._restarted:
            return None
        self._restarted = True
        if tier.nodes.single:
            def check() -> int | None:
                self._drop_partial_links()
                return self._tracked_slot()

            k = from_rank(check, tier.group, f"checking the memory checkpoints in {self.np_dir}")
            if k is not None:  # Megatron-LM loads it (or --save's newer one): the ring's next save goes past it
                tier.resume_after(tier.slots[k])
            return None
        slot = None
        for k in self._restart_order():  # agreed: the same slots in the same order on every rank, newest first
            found = tier.slots[k]
            try:  # collective; IntegrityError on every rank alike when the restore from a replica fails
                tier.restore_planned(found, keep_plans=True)
            except IntegrityError as e:
                logger.warning("cpuckpt memory tier: %s cannot be restored from a replica (%s); trying the next "
                               "newest checkpoint", found, e)
                continue
            slot = found
            break
        tier.restore_planned(slot if slot is not None else self.save_dir)  # the other plans go
        if slot is not None:
            tier.resume_after(slot)
            self._share_megatron_files(slot)
        def name() -> int | None:  # each node's leader names it; every rank waits for every node's (failures alike)
            step = tier.step_of(slot) if slot is not None else None  # reads the manifest: may fail on one node
            if not self.names:
                return step
            self.np_dir.mkdir(parents=True, exist_ok=True)
            for link, _, _ in self._links():
                link.unlink(missing_ok=True)
            if slot is not None and step is not None:
                os.symlink(slot, self.np_dir / f"iter_{step:07d}", target_is_directory=True)
                write_atomic(self.np_dir / TRACKER, str(step).encode(), fsync=False)
            else:
                (self.np_dir / TRACKER).unlink(missing_ok=True)
            return step

        step = from_every_rank(name, tier.group, f"naming the restart's memory checkpoint in {self.np_dir}")[tier.rank]
        logger.info("cpuckpt memory tier: restart across %d nodes: %s", tier.nodes.nodes,
                    f"iteration {step} from memory ({slot})" if slot is not None else
                    f"no memory checkpoint every node holds; Megatron-LM loads {self.save_dir}")
        return step

    def _restart_order(self) -> list[int]:
        """Collective, across nodes: the indices of the slots a restart may load, newest first, none older than the
        iteration ``--save``'s tracker names (Megatron-LM loads the newer of its two trackers; rank 0's list, broadcast:
        a durable step a writer commits meanwhile cannot send the ranks different ways). Megatron-LM loads only what
        its finalize recorded: a slot counts only where some node's copy holds ``common.pt`` (megatron-core's common
        state: a persistent save's slot has none; its durable copy, once finalized, is ``--save``'s) and
        ``metadata.json`` (written by Megatron's finalize: a save committed in memory but not finalized yet is not a
        checkpoint Megatron-LM knows)."""
        tier = self.tier
        slots = [found for found in tier.own_candidates() if found in tier.slots]  # collective; newest first

        def order() -> list[int]:
            durable = _tracked_iteration(self.save_dir)
            # the step listed, not rank 0's slot's: a replaced node's slot is empty until its restore from a replica
            steps = [c.step if (c := tier.listed(found)) is not None and c.step is not None else -1 for found in slots]
            return [tier.slots.index(found) for found, step in zip(slots, steps) if durable is None or step >= durable]

        agreed: list[int] = from_rank(order, tier.group, "ordering the memory checkpoints for the restart")
        def files_of_slots() -> list[list[str]]:  # each node's leader: the Megatron files of each of its slots
            return [sorted(e.name for e in _megatron_files(d) if e.is_file()) if self.names else [] for d in tier.slots]

        every = from_every_rank(files_of_slots, tier.group, "listing Megatron's files of the memory slots")
        usable = []
        for k in agreed:
            held = set().union(*(set(names[k]) for names in every))
            if {MEGATRON_COMMON, MEGATRON_METADATA} <= held:
                usable.append(k)
            else:
                logger.info("cpuckpt memory tier: %s holds no %s on any node (%s): not a checkpoint Megatron-LM "
                            "can load from memory", tier.slots[k],
                            " and ".join(n for n in (MEGATRON_COMMON, MEGATRON_METADATA) if n not in held),
                            "a persistent save" if MEGATRON_COMMON not in held else "not finalized")
        return usable

    def _tracked_slot(self) -> int | None:
        """The index of the slot ``D``'s tracker names through its link (None: none, or not one of the tier's). The
        slot the tier would fill next is the one after its newest commit, which may be a save Megatron never
        finalized (a kill in between): Megatron-LM loads the tracked one, older, and the first save after the restart
        must not refill it."""
        tracked = _tracked_iteration(self.np_dir)
        link = self.np_dir / f"iter_{tracked:07d}" if tracked is not None else None
        if link is None or not link.is_symlink():
            return None
        target = os.path.realpath(link)
        return next((k for k, d in enumerate(self.tier.slots) if os.path.realpath(d) == target), None)

    def _drop_partial_links(self) -> None:
        """One node after a run across nodes: a slot linked in ``D`` that lacks files its ``.metadata`` names (it
        holds one node's ranks' files) would fail Megatron-LM's load midway; its names go (the tracker moves back,
        or goes: ``--save``'s tracker then wins, resharding as needed), with a warning."""
        for link, step, target in self._links():
            missing = missing_files(target)
            if missing:
                logger.warning("cpuckpt memory tier: %s (iteration %d) was saved across nodes and lacks %d file(s) of "
                               "this job's ranks (%s, ...): ignored (the topology changed)", link, step, len(missing),
                               missing[0])
                self._unlink_slot(target)

    def _share_megatron_files(self, slot: Path) -> None:
        """Collective: every node's leader's ``slot`` gets Megatron's files (``common.pt``, ``metadata.json``) from
        the lowest rank whose node's slot has them (a slot restored from a replica has only cpuckpt's files)."""
        tier = self.tier
        every = from_every_rank(lambda: sorted(e.name for e in _megatron_files(slot) if e.is_file()) if self.names
                                else [], tier.group, f"listing Megatron's files of {slot.name}")
        mine = set(every[tier.rank])
        names = set().union(*(set(m) for m in every))
        holder = next((r for r, m in enumerate(every) if set(m) == names), 0)
        files = from_rank(lambda: {e.name: e.read_bytes() for e in _megatron_files(slot) if e.is_file()}, tier.group,
                          f"reading Megatron's files of {slot.name} on rank {holder}", src=holder)

        def write() -> None:
            for name, data in files.items() if self.names else ():
                if name not in mine:
                    write_atomic(slot / name, data, fsync=False)

        from_every_rank(write, tier.group, f"writing Megatron's files into {slot.name}")

    def close(self) -> None:
        """End of training: stop the writers and remove the RAM root (Megatron's own final save is the
        durable one; a memory-only checkpoint cannot be persisted as a Megatron checkpoint here)."""
        if self._tier is not None:
            tier, self._tier = self._tier, None
            tier.close(persist_newest=False)
            if tier.nodes.is_leader:
                self._remove_links()

    # -- the non-persistent directory (rank 0) ------------------------------------------------------
    def _link(self, route: Route, slot: Path, files: dict[str, bytes] | None = None) -> None:
        """Before ``slot`` is refilled: unlink its old names; a memory route then names it ``D/iter_<N>``, with
        Megatron's files moved in from the directory megatron-core wrote them to (rank 0), or, across nodes, from
        ``files`` (rank 0's bytes)."""
        self.np_dir.mkdir(parents=True, exist_ok=True)
        incoming = self.np_dir / f".incoming-{route.path.name}"
        if route.kind == "memory":  # megatron-core already wrote common.pt into the directory it was given
            if incoming.exists():  # a crash between these steps left it
                _remove(incoming)
            incoming.mkdir()
            given = route.path
            for entry in _megatron_files(given):
                if entry.name == MEGATRON_METADATA:  # megatron-core writes it only when it finalizes this save: one
                    _remove(entry)  # here is an earlier save's (a real directory replayed), never this one's
                    continue
                _move(entry, incoming / entry.name)  # through a link left into a slot, it sits in the RAM root
            _remove(given)
            for name, data in (files or {}).items():  # across nodes: rank 0's common.pt in every node's slot
                if not (incoming / name).exists():
                    write_atomic(incoming / name, data, fsync=False)
        self._unlink_slot(slot)
        clear_commit(slot, fsync=False)  # no name and no tracker may see the slot's old checkpoint from here on
        for entry in _megatron_files(slot):  # the previous checkpoint's common.pt, metadata.json, ...
            _remove(entry)
        if route.kind == "memory":
            for entry in list(incoming.iterdir()):
                _move(entry, slot / entry.name)
            incoming.rmdir()
            os.symlink(slot, route.path, target_is_directory=True)

    def _unlink_slot(self, slot: Path) -> None:
        """Remove every ``D/iter_*`` link to ``slot``; a tracker naming one of them moves back."""
        removed: set[int] = set()
        real_slot = Path(os.path.realpath(slot))  # the links resolve symlinks in the RAM root's path too
        for link, step, target in self._links():
            if target == real_slot:
                link.unlink()
                removed.add(step)
        tracker = self.np_dir / TRACKER
        try:
            named = int(tracker.read_text().strip())
        except (FileNotFoundError, ValueError):
            return
        if named not in removed:
            return
        # a checkpoint Megatron has finalized (its metadata.json written), never one still pending: a restart
        # reading the tracker would find a directory megatron-core cannot load
        remaining = [step for _, step, target in self._links()
                     if (target / MEGATRON_METADATA).is_file() and check_complete(target).complete]
        if remaining:
            write_atomic(tracker, str(max(remaining)).encode(), fsync=False)
            logger.info("cpuckpt memory tier: %s reuses the slot of iteration %d; %s now names %d",
                        slot.name, named, tracker, max(remaining))
        else:
            tracker.unlink(missing_ok=True)
            logger.info("cpuckpt memory tier: %s reuses the slot of iteration %d; no older memory checkpoint "
                        "is left, %s removed (a restart loads the newest persistent checkpoint)", slot.name,
                        named, tracker)

    def _links(self) -> list[tuple[Path, int, Path]]:
        """(link, iteration, resolved target) of every ``iter_*`` link in ``D``."""
        out = []
        if not self.np_dir.is_dir():
            return out
        for link in self.np_dir.iterdir():
            match = _ITER.match(link.name)
            if match and link.is_symlink():
                out.append((link, int(match.group(1)), Path(os.path.realpath(link))))
        return out

    def _remove_links(self) -> None:
        """The RAM root is gone: links into it and the tracker that names them would dangle."""
        for link, _, _ in self._links():
            link.unlink(missing_ok=True)
        (self.np_dir / TRACKER).unlink(missing_ok=True)

    def cleanup(self, save_dir: str | os.PathLike) -> bool:
        """Megatron-LM's ``cleanup_old_non_persistent_checkpoint`` for ``D``: the ring is the retention.
        Only links whose slot no longer holds a complete checkpoint go. Returns False for another dir."""
        if not self.prunes(save_dir):
            return False
        for link, _, target in self._links():
            if not target.is_dir():
                link.unlink(missing_ok=True)
        try:
            named = int((self.np_dir / TRACKER).read_text().strip())
        except (FileNotFoundError, ValueError):
            named = None
        for entry in self.np_dir.iterdir() if named is not None else ():  # real directories older than the
            match = _ITER.match(entry.name)  # tracker's (``when_full: disk`` saves, runs without the tier)
            if match and not entry.is_symlink() and entry.is_dir() and int(match.group(1)) < named:
                shutil.rmtree(entry, ignore_errors=True)
        return True


def restart_before_load(module: Any, memory_of: Callable[[], MegatronMemory]) -> bool:
    """Wrap Megatron-LM's ``module.load_checkpoint`` (``megatron.training.checkpointing``, and every ``megatron.*``
    module that imported it by name) so that every rank first runs :meth:`MegatronMemory.prepare_restart`: across
    nodes the trackers Megatron-LM reads must agree before it reads them. Returns whether it wrapped (or had)."""
    original = getattr(module, "load_checkpoint", None)
    if original is None:
        logger.warning("cpuckpt: %s has no load_checkpoint(): a restart across nodes does not resume from memory",
                       getattr(module, "__name__", module))
        return False
    if getattr(original, "_cpuckpt_restart", False):
        return True

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        memory_of().prepare_restart()  # once per process; nothing to do on one node
        return original(*args, **kwargs)

    load_checkpoint._cpuckpt_restart = True  # type: ignore[attr-defined]
    replace_function(module, "load_checkpoint", original, load_checkpoint)
    return True


def _move(src: Path, dest: Path) -> None:
    """``os.replace``, or, when ``dest`` is on another filesystem (the RAM root in /dev/shm, --save on disk), a copy
    that appears whole under its name (written to a temporary name, then renamed), then ``src`` removed."""
    try:
        os.replace(src, dest)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        if src.is_dir():
            shutil.move(src, dest)
        else:
            write_atomic(dest, src.read_bytes(), fsync=False)
            src.unlink()


def _megatron_files(directory: Path) -> list[Path]:
    """What Megatron wrote into a checkpoint directory (``common.pt``, ``metadata.json``, ...): everything
    but cpuckpt's data files (``__<rank>_<i>.distcp``) and hidden files (``.metadata``, manifests)."""
    if not directory.is_dir():
        return []
    return [e for e in directory.iterdir() if not e.name.startswith((".", "__"))]


def _tracked_iteration(directory: Path) -> int | None:
    """The iteration Megatron-LM's tracker in ``directory`` names (None: none, or not a number)."""
    try:
        return int((directory / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def _write_megatron_config(checkpoint_dir: Path) -> None:
    """``metadata.json`` as megatron-core's finalize writes it for cpuckpt's strategies (torch_dist, version 1)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    save_config(CheckpointingConfig("torch_dist", 1), str(checkpoint_dir))


# Filesystems whose directories other nodes may see: refused for D outright, since their clients cache directory
# listings (NFS: acdirmin, 30 s by default), so another node's name left there may not be seen in time.
_NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "ceph", "glusterfs",
                        "fuse.glusterfs", "fuse.sshfs", "9p", "afs", "ocfs2", "gfs2", "panfs", "wekafs")


def network_filesystem(path: Path, mounts: str | None = None) -> str | None:
    """The type of the network filesystem ``path`` is on (from ``/proc/self/mounts``: the longest mount point
    above it), or None (a local one, or no mount table to read)."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return None
    where = os.path.realpath(path)
    best, kind = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind if kind in _NETWORK_FILESYSTEMS else None


def _shared_by_nodes(np_dir: Path, tier: MemoryTier) -> bool:
    """Collective: whether several nodes' leaders see one ``np_dir`` (a shared filesystem), or one is on a network
    filesystem (:func:`network_filesystem`: its listings are cached, so the test below could miss another node).
    Each leader removes the names an earlier start left, then (once every leader did) leaves its node's name, then
    (once every one is there) counts the names of this start's token; each step one all-gather, which also agrees
    the answer and any leader's failure."""
    token = from_rank(lambda: os.urandom(8).hex(), tier.group, "drawing a token")
    prefix = ".cpuckpt-node-"
    key = hashlib.sha256(tier.nodes.keys[tier.rank].encode()).hexdigest()[:16]
    mine = np_dir / f"{prefix}{token}-{key}"

    def clear() -> None:  # each leader: the names an earlier start left
        np_dir.mkdir(parents=True, exist_ok=True)
        for stale in np_dir.glob(f"{prefix}*"):
            if not stale.name.startswith(f"{prefix}{token}"):
                stale.unlink(missing_ok=True)

    def count() -> bool:  # each leader: another node's name seen, or a network filesystem
        seen = len(list(np_dir.glob(f"{prefix}{token}-*")))
        mine.unlink(missing_ok=True)
        return seen > 1 or network_filesystem(np_dir) is not None

    # every step on every rank (leaders act): a failure on one node is raised on all, no rank left in a barrier
    for step, what in ((clear, "clearing"), (mine.touch, "leaving"), (count, "counting")):
        found = from_every_rank(lambda step=step: step() if tier.nodes.is_leader else None, tier.group,
                                f"{what} the node names in {np_dir}")
    return any(bool(f) for f in found)
