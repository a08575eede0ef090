"""The memory tier: checkpoints committed in a node-local RAM root, persisted by a writer process per rank.

A save copies each rank's shard straight into a *reused image* (a preallocated, mapped and, with
CUDA, pinned file of the RAM root: :mod:`cpuckpt.tier.images`) and commits it in memory the
way every cpuckpt save commits (manifest, then ``.metadata``, after every rank's bytes are in), so a
memory checkpoint is an ordinary checkpoint directory: ``cpuckpt.load``, ``verify``, ``ls`` and stock
``FileSystemReader`` read it. The RAM root holds ``memory.slots`` such directories (``slot-<k>``), used
in a ring. Every save whose step is a multiple of ``memory.persist_every`` is then persisted to the
durable root by this rank's writer process (:mod:`cpuckpt.tier.persister`), which commits the
durable copy without any collective and outlives the trainer. The writer starts when it is first needed: at
the first persist or replica request (at construction only when an earlier trainer's persists are still owed,
or when this node receives its partners' replicas), so a tier that never persists starts no process.

"Returned", "committed in memory" and "durable" are three events: ``save`` returns per the staging
contract of :func:`cpuckpt.async_save` (``handle.staged``), ``handle.wait()`` is the memory commit,
and :meth:`MemoryTier.persisted` says whether a step is durable.

A slot is *held* while a persist of it is owed; a save that finds its slot held follows
``memory.when_full``. Ranks agree on that, and on a dead writer, in one all-reduce per save.

Across nodes (ranks in several RAM roots: :mod:`cpuckpt.tier.nodes`) each node's slot holds its own
ranks' images and is committed by its node's leader, complete for the ranks it holds; a restart loads a
memory checkpoint only when every rank's node holds the files that rank reads, else a durable one.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cpuckpt.api import load
from cpuckpt.backend.collectives import agree_or_raise, checkpoint_group, from_every_rank, peers
from cpuckpt.backend.commit import clear_commit
from cpuckpt.backend.committed import check_complete, read_manifest
from cpuckpt.backend.reader import ReadStats, StorageReader
from cpuckpt.background import AsyncSaveHandle, Checkpointer
from cpuckpt.config import CheckpointConfig, Config, MemoryConfig, resolve_config
from cpuckpt.errors import (
    CheckpointCorrupt,
    CheckpointTimeoutError,
    ConfigError,
    CpuckptError,
    IntegrityError,
    UnsafeCheckpointError,
)
from cpuckpt.format.manifest import FileEntry
from cpuckpt.paths import S3Url, checkpoint_path, local_path
from cpuckpt.roots import committed_once, inspect_checkpoint, install_sigterm_handler, list_checkpoints
from cpuckpt.tier.copier import CopyProcess
from cpuckpt.tier.formats import Committed, DcpSlots, SlotFormat, missing_files
from cpuckpt.tier.images import AllocatedAhead, ImageSet
from cpuckpt.tier.nodecopies import with_node_copies
from cpuckpt.tier.nodes import NodeMap, agree_held, held_saves, node_commit, node_key
from cpuckpt.tier.queue import PersistQueue, PersistRequest
from cpuckpt.tier.ramroot import RamRoot, acquire_lock, durable_name, job_id_for, leaving_marker, leaving_pid
from cpuckpt.tier.recovery import Replication, Restore, agree_available, node_copies, slots_present
from cpuckpt.tier.replica import DRAIN_S
from cpuckpt.transfer.staging import caller_device

__all__ = ["MemoryTier", "WriterDiedError"]

logger = logging.getLogger(__name__)


class WriterDiedError(CpuckptError):
    """A rank's writer process ended while it owed persists (raised on every rank)."""


class PersistError(CpuckptError):
    """A persist to the durable root failed (raised on every rank at the next save)."""


class MemoryTier:
    """Memory checkpoints of one job in a RAM root, persisted to ``durable_root`` by writer processes.

    Args:
        durable_root: where persisted checkpoints go (``<durable_root>/<name>``, name ``step_<step>``).
        config: a :class:`Config`, YAML path, dict or None; its ``memory`` section configures the tier.
        process_group: the trainer's group (cpuckpt uses gloo groups over the same ranks).
        report_persist_failures: raise a failed persist at the next save (False: the adapter reports outcomes).
        slot_format: what a complete checkpoint is (:mod:`cpuckpt.tier.formats`): DCP directories by default
            (:meth:`save`); an adapter that writes its own files passes its own and uses :meth:`claim_slot` and
            :meth:`commit_files` instead of :meth:`save` (across nodes it writes a node listing per slot:
            :mod:`cpuckpt.tier.nodefiles`).

    The writer process starts at the first persist or replica request, not here (see the module docstring).

    Example:
        >>> tier = cpuckpt.MemoryTier("/ckpt", {"memory": {"persist_every": 4}})
        >>> path = tier.find_latest()
        >>> if path is not None:
        ...     tier.load(state, path)       # restores a lost node's slot from a replica first, if planned
        >>> h = tier.save(state, step)   # returns once staged; h.wait(): committed in memory
        >>> tier.close()                 # newest checkpoint made durable, RAM root removed
    """

    def __init__(self, durable_root: str | os.PathLike, config: Config | str | os.PathLike | dict | None = None,
                 *, process_group: Any = None, report_persist_failures: bool = True,
                 slot_format: SlotFormat | None = None) -> None:
        # A URL would silently become a local directory named "gs:" (cpuckpt.paths): refused before anything;
        # s3:// is a prefix in object storage (the writers persist with tier.s3persist).
        where = checkpoint_path(durable_root, "memory tier durable root")
        self.config = resolve_config(config)
        self._config_dict = self.config.to_dict()  # what every request carries: built once, not per save
        # False: the caller awaits every persist itself and reports its outcome (the Megatron adapter's
        # finalize does), so a failed persist is not raised a second time at the next save.
        self.report_persist_failures = report_persist_failures
        # What a complete checkpoint is in a slot and in the durable root: DCP directories (save()), or an
        # adapter's own file sets (claim_slot() / commit_files(), the DeepSpeed adapter's tags).
        self.format: SlotFormat = slot_format if slot_format is not None else DcpSlots()
        m = self.config.memory
        self.max_uncommitted = self._max_uncommitted(m)  # checked before anything is made
        if m.root:
            local_path(m.root, "memory.root (the memory tier's RAM root)")
        if isinstance(where, S3Url) and not isinstance(self.format, DcpSlots):
            raise ConfigError(f"memory tier durable root {where}: only DCP checkpoints persist to object storage "
                              f"({type(self.format).__name__} needs a directory)")
        self.durable_root: Path | S3Url = where if isinstance(where, S3Url) else Path(where)
        self.process_group = process_group
        self.saves = Checkpointer(process_group)  # this tier's stream of saves: its caches, bound, committer
        self.dist = dist.is_available() and dist.is_initialized()
        self.group = checkpoint_group(process_group, self.config.timeout_s) if self.dist else None
        self.rank = dist.get_rank(self.group) if self.dist else 0
        self.world_size = dist.get_world_size(self.group) if self.dist else 1
        self.root = self._open_root(m)
        # One RAM root per node (cpuckpt.tier.nodes): each node's slots hold its own ranks' images, and each
        # node commits its own copy of a save when the ranks span several.
        self.nodes = NodeMap.gather(node_key(self.root.path), self.rank, self.world_size, self.group)
        self._node_commit = None if self.nodes.single else node_commit(self.nodes)
        self.loads: list[tuple[Path, ReadStats]] = []  # (path, read statistics) of every load, oldest first
        # Memory saves: no fsync (RAM), and no `latest`/retention in the RAM root (those follow the durable commit).
        # Saves overlap, each in its own slot: a save every step overlaps the commit of the ones before it instead
        # of waiting for them. save() first waits (without raising) until fewer than memory.max_uncommitted older
        # saves are running, before the slot changes, so one slot always holds the newest committed save; the
        # engine's own bound (one per slot) is where a failed save nobody waited for is raised, as for any stream.
        self.memory_config = dataclasses.replace(
            self.config, io=dataclasses.replace(self.config.io, fsync=False), checkpoint=CheckpointConfig(),
            async_=dataclasses.replace(self.config.async_, max_in_flight=m.slots))
        self._slot_saves: dict[int, AsyncSaveHandle] = {}  # the last memory save into each slot
        self.slots = [self.root.path / f"slot-{k}" for k in range(m.slots)]
        for d in self.slots:
            d.mkdir(mode=0o700, exist_ok=True)
        # a full RAM filesystem is refused before an image grows (headroom kept), never a SIGBUS mid-copy
        # memory.copy_process: this rank's copy process checksums the images (and copies a device snapshot into
        # them, which it pins itself: the trainer's process then pins nothing).
        # on a CUDA machine a copy process that will copy device snapshots makes torch and its CUDA context ready as
        # it starts (-1: no device in use yet, torch only), beside the trainer's reservation, not at the first image
        # it pins; elsewhere it only ever checksums, without torch
        warm = None
        if m.copy_process and self.config.staging.device_snapshot and torch.cuda.is_available():
            device = caller_device()
            warm = -1 if device is None else device
        self.copier = (CopyProcess(self.rank, self.root.path / f"copier-{self.rank}.log",
                                   threads=self.config.io.threads, timeout_s=self.config.timeout_s, warm_device=warm)
                       if m.copy_process else None)
        pin = self.config.staging.pin and not (self.copier is not None and self.config.staging.device_snapshot)
        self.images = [ImageSet(d, pin=pin, before_grow=self.root.check_space, copier=self.copier)
                       for d in self.slots]
        if self.copier is not None:
            self.copier.start()  # its interpreter and imports take seconds: now, not at the first save
        self.queue = PersistQueue(self.root.path / f"queue-{self.rank}").create()
        self._writer: subprocess.Popen | None = None
        self._adopted: int | None = None  # the pid of an earlier trainer's writer this one adopted (its stop cleared)
        self._replication: Replication | None = None  # memory.replicas across nodes; set once the writers listen
        self._pending: dict[Path, list[Restore]] = {}  # slots to restore from another node's copy before a load
        try:  # a listing that fails on any rank fails on every rank: what this tier took is let go first
            newest_in_memory = next((path for path in self.own_candidates() if path in self.slots), None)
        except BaseException:
            self._let_go()  # no writer was started or adopted yet: an earlier trainer's is left to its work
            raise
        self._next = self._agree_next(self._slot_after(newest_in_memory))
        self._last: _LastSave | None = None  # the newest memory save (close() and SIGTERM persist it if needed)
        self.last_persist: PersistRequest | None = None
        self.last_replica: PersistRequest | None = None  # a file set's replica request (commit_files)
        self._prepared: threading.Thread | None = None  # the background preparation of the other slots' images
        self._prepare_lock = threading.Lock()
        self._prepare_decided = threading.Event()  # the first save ended: preparation started or not needed
        self._closing = threading.Event()
        self._respawn_failed: CpuckptError | None = None
        # replica directories of nodes this one no longer receives from (Replication.departed), removed once every
        # own slot was claimed by this run (_drop_departed_replicas); the slots claimed so far
        self._departed: list[Path] = []
        self._claimed_slots: set[int] = set()
        self._reported = set(self.queue.finished())  # outcomes already seen (an earlier trainer's too)
        self._cancel_uncommitted_requests()
        stale_replicas = self._withdraw_replica_requests()
        self._drop_stale_images()
        # The writer starts when it is first needed (its interpreter costs a core for seconds, and a tier that never
        # persists needs none): at the first persist or replica request, now if an earlier trainer's persists are
        # still owed (it finishes them), and now for a node that receives its partners' replicas.
        replicating = bool(m.replicas) and not self.nodes.single
        self._start_writer_agreed(bool(self.queue.owed()) or replicating)
        if replicating:
            pid = self._ensure_writer()  # the one started (or adopted) just above
            self._replication = Replication.start(self.nodes, self.root.path, pid, m.replicas, self.group,
                                                  self.config.timeout_s)
            self._requeue_replicas(self._replication, stale_replicas)
            if self.nodes.is_leader:
                self._departed = self._replication.departed(self.root.path)

    def _start_writer_agreed(self, needed: bool) -> None:
        """Collective, at construction: start this rank's writer when ``needed``; when any rank's cannot start, every
        rank raises WriterDiedError at once (the failing rank its own, the others one naming it) instead of the
        others waiting in the next collective until the group's timeout. What this tier took is let go first."""
        started = self._try_start_writer() if needed else None
        (failed,) = self._agree([self.rank + 1 if started is not None else 0])  # the highest failing rank, plus 1
        if not failed:
            return
        self.abandon()
        if started is not None:
            raise started
        raise WriterDiedError(f"rank {self.rank}: rank {failed - 1}'s writer process could not be started (see its "
                              f"writer-{failed - 1}.log); the memory tier of {self.durable_root} was not opened")

    def abandon(self) -> None:
        """Let go of what the tier took, with no collective, before any save: its writer is asked to stop (one
        adopted finishes what an earlier trainer owed first), its copy process ends, its images are unmapped and its
        trainer lock released. The RAM root stays: it may hold the only copy of a checkpoint. For a constructor that
        fails, and an adapter whose start fails right after the tier was made (on one rank or on all: an interrupt
        between collectives reaches one rank only, where a collective close would pair with the others' next
        collective)."""
        self._stop_writer()
        self._let_go()

    def _let_go(self) -> None:
        """:meth:`abandon` but for the writer: the saves' stream, the copy process, the images, the trainer lock."""
        self.saves.close()
        if self.copier is not None:
            self.copier.close()
        for images in self.images:
            images.close()
        self.root.close()

    @staticmethod
    def _max_uncommitted(m: MemoryConfig) -> int:
        """Memory saves in flight when one returns (``memory.max_uncommitted``; 0: ``slots - 1``, at least 1).

        One slot fewer than the ring: with every slot in flight, every slot's commit is cleared at once, and a job
        killed then restarts with no memory checkpoint at all (tests/dist/test_lost_work.py reproduced a restart
        from scratch that way). With ``slots - 1``, the slot of the newest committed save is never refilled before
        a newer save is committed. (With one slot, each save clears the only one: no bound helps.)

        Raises:
            ConfigError: more than ``max(1, slots - 1)`` (the case above).
        """
        most = max(1, m.slots - 1)
        if m.max_uncommitted > most:
            raise ConfigError(f"memory.max_uncommitted is {m.max_uncommitted}; with memory.slots {m.slots} it must "
                              f"be at most {most}: with every slot in flight a kill can leave no complete memory "
                              "checkpoint")
        return m.max_uncommitted or most

    def _wait_uncommitted_below(self, n: int) -> None:
        """Wait until fewer than ``n`` of this tier's saves are running (the oldest first), without raising their
        failures: the engine's bound, :meth:`AsyncSaveHandle.wait` and an adapter's finalize report those, alike on
        every rank (a raise here would reach the Megatron adapter before its finalize, bypassing its
        ``on_failure``). Every rank waits for the same saves, whose outcome is agreed: no collective needed."""
        running = self.saves.pending()
        for handle in running[: max(0, len(running) - n + 1)]:
            handle.wait_ended()

    # -- paths ----------------------------------------------------------------------------------
    @property
    def trainer_lock(self) -> Path:
        return self.root.path / f".rank-{self.rank}.lock"

    def _slot_after(self, path: Path | None) -> int:
        """The ring's next slot after ``path`` (slot 0 when ``path`` is not a slot): it must not be overwritten."""
        return (self.slots.index(path) + 1) % len(self.slots) if path in self.slots else 0

    def _open_root(self, m: MemoryConfig) -> RamRoot:
        """This rank's RAM root, opened on every rank or failed on every rank with the same error (collective): a rank
        refused alone (a stale trainer of that rank still holds it) must not leave the others waiting in the next
        collective while it goes on (an adapter that warns and trains on would pair its collectives with theirs)."""
        root, error = None, None
        try:
            root = RamRoot.open(m.root or None, m.job or job_id_for(self.durable_root), self.rank,
                                headroom_bytes=m.headroom_bytes, durable=durable_name(self.durable_root))
        except BaseException as e:  # an interrupt too: raised as itself once the peers learned of it
            if self.group is None:
                raise
            error = e
        try:
            agree_or_raise(error, self.rank, self.group, "opening the memory tier's RAM root")
        except BaseException:
            if root is not None:
                root.close()
            raise
        assert root is not None
        return root

    def _agree_next(self, k: int) -> int:
        """Across nodes every rank must fill the same slot index (a node's leader commits its own slot-k)."""
        return k if self.nodes.single else self._agree([k])[0]

    # -- the writer process -----------------------------------------------------------------------
    def _ensure_writer(self) -> int:
        """This rank's writer pid: the one running (an earlier trainer's is adopted), else a new one started now.

        The new writer's lock is taken here and handed to the child (``--lock-fd``), so from the moment this returns
        the writer counts as alive (its interpreter and imports take seconds; requests wait in the queue meanwhile),
        and a writer that dies while it starts releases the lock with its last descriptor.

        Raises:
            WriterDiedError: the writer process could not be started.
        """
        lock_path = self.root.writer_lock_path(self.rank)
        running = self.root.writer_alive(self.rank)
        if running is not None and running != self._adopted and (self._writer is None or running != self._writer.pid):
            # an earlier trainer's writer, to adopt: a stop that trainer asked for (killed during close) must not
            # end it while it serves this one; cleared before its leaving mark is looked at (serve's second look),
            # once (a stop this trainer asks for later, closing, stands)
            self._adopted = running
            self.queue.clear_stop()
        pid = self._writer_not_leaving(lock_path, running)
        fd = acquire_lock(lock_path) if pid is None else None
        if fd is not None:  # no writer lives: a leaving mark is an ended writer's (its pid may come again)
            leaving_marker(lock_path).unlink(missing_ok=True)
        if fd is None:
            pid = self.root.writer_alive(self.rank)
            if pid is not None:
                if self._writer is None or pid != self._writer.pid:
                    logger.info("cpuckpt memory tier: rank %d adopts writer pid %d (still persisting for an earlier "
                                "trainer)", self.rank, pid)
                return pid
            raise WriterDiedError(f"rank {self.rank}: {lock_path} is held by a process that is gone; see "
                                  "`cpuckpt clean --ram`")
        self.queue.clear_stop()
        try:
            log = open(self.root.path / f"writer-{self.rank}.log", "ab")  # the child's; closed here after Popen
            try:
                self._writer = subprocess.Popen(
                    [sys.executable, "-m", "cpuckpt.tier.persister", "--queue", str(self.queue.path),
                     "--lock", str(lock_path), "--lock-fd", str(fd), "--trainer-lock", str(self.trainer_lock)]
                    + self._listen_args(),
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    close_fds=True, pass_fds=(fd,))
            finally:
                log.close()
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{self._writer.pid}\n".encode(), 0)  # lock_holder names the writer, not this trainer
        except OSError as e:
            raise WriterDiedError(f"rank {self.rank}: the writer process could not be started: {e}") from e
        finally:
            os.close(fd)  # the child holds the lock now (the same open file description)
        logger.info("cpuckpt memory tier: rank %d writer pid %d starting, RAM root %s", self.rank, self._writer.pid,
                    self.root.path)
        return self._writer.pid

    def _listen_args(self) -> list[str]:
        """A node leader's writer receives the partners' replicas (``memory.replicas``; cpuckpt.tier.replica)."""
        m = self.config.memory
        if not m.replicas or self.nodes.single or not self.nodes.is_leader:
            return []
        return ["--listen", m.replica_host or socket.gethostname(), "--root", str(self.root.path),
                "--headroom", str(m.headroom_bytes), "--timeout", str(self.config.timeout_s)]

    def _writer_running(self) -> bool:
        """The rank's writer holds its lock (taken for it before it started: see :meth:`_ensure_writer`)."""
        if self.root.writer_alive(self.rank) is not None:
            return True
        if self._writer is not None:
            self._writer.poll()  # reap it
        return False

    def start_writer(self) -> int:
        """Start this rank's writer process now, before the first persist needs it (a job that will persist calls
        it before it trains): its interpreter and imports take seconds, which the first persist would otherwise
        spend with its slot held. Returns its pid (an earlier trainer's writer still running is adopted).

        Raises:
            WriterDiedError: the writer process could not be started.
        """
        return self._ensure_writer()

    def writer_pid(self) -> int | None:
        """The pid of this rank's writer process, or None when none runs.

        A writer starts at the first persist or replica request (see :meth:`_ensure_writer`), or at
        :meth:`start_writer`, so a tier that never persists (``memory.persist_every: 0``, no replicas) and is not
        asked to start one never has one. A query: it starts nothing.

        Raises:
            WriterDiedError: the writer this tier started has exited (see ``writer-<rank>.log`` in the RAM root).
        """
        pid = self.root.writer_alive(self.rank)
        if pid is None and self._writer is not None:
            code = self._writer.poll()
            raise WriterDiedError(f"rank {self.rank}: the writer process exited (code {code}); see "
                                  f"{self.root.path}/writer-{self.rank}.log")
        return pid

    def _writer_dead_with_debts(self) -> bool:
        """A dead writer that owed nothing lost nothing (the next request starts one). One that owed is a failure."""
        return bool(not self._writer_running() and self.queue.owed())

    def _new_persist_failures(self) -> list[str]:
        """Failed persists this rank has not reported yet (cancelled ones are the trainer's own doing)."""
        finished = self.queue.finished()
        new = self.queue.outcomes([seq for seq in finished if seq not in self._reported])  # only new ones are read
        self._reported = set(finished)
        self.queue.prune(keep=max(8, 3 * len(self.slots)))  # replicated() reads a ring's worth of outcomes
        for o in new:
            if o.error.startswith("replica:"):  # a missing replica is no lost checkpoint: training goes on
                logger.warning("cpuckpt memory tier: request %d: %s", o.seq, o.error)
        return [f"persist request {o.seq} failed: {o.error}" for o in new
                if not o.ok and not o.error.startswith(("cancelled", "replica:"))]

    def _drop_departed_replicas(self, k: int) -> None:
        """After slot ``k`` was claimed: once every own slot has been claimed by this run, the replicas of nodes this
        node no longer receives from go. They would hold RAM beyond the bound ((slots + K x slots) x shard) for good,
        and no checkpoint they belong to can be assembled any more: this node's part of it is gone from its slots.
        Decided from what this process claimed (no reads of the RAM root on the save path)."""
        self._claimed_slots.add(k)
        if len(self._claimed_slots) < len(self.slots):
            return
        for d in self._departed:
            logger.info("cpuckpt memory tier: removing %s (a replica of a node this one no longer receives from; "
                        "every own slot holds a save of this run)", d)
            shutil.rmtree(d, ignore_errors=True)
        self._departed = []

    def _drop_stale_images(self) -> None:
        """Images no committed checkpoint of this job can use any more (a rank beyond today's world, a file
        an older layout had) would hold RAM for nothing: this rank removes its own, rank 0 departed ranks'.
        A slot's committed files stay (a restart loads them); an uncommitted slot's are only reused.
        Across nodes, a node's leader removes every image of a rank that is not on this node now (a restart
        that moved ranks, or changed the world, restores from the durable tier), unless that rank's writer
        here still runs (it may be persisting from them)."""
        here = set(self.nodes.node_ranks)
        for slot in self.slots:
            manifest = read_manifest(slot) if check_complete(slot).complete else None
            keep = set(manifest.files) if manifest is not None else None
            owners = {int(o) for o in (f.name[2:].split("_", 1)[0] for f in slot.glob("__*_*.distcp")) if o.isdigit()}
            # a writer of this root may still persist the slot's checkpoint (it needs its .metadata and manifest)
            persisting = any(self.root.writer_alive(k) is not None for k in owners | here)
            for f in slot.glob("__*_*.distcp"):
                owner = f.name[2:].split("_", 1)[0]
                if not owner.isdigit():
                    continue
                mine, departed = int(owner) == self.rank, int(owner) >= self.world_size and self.rank == 0
                moved = (not self.nodes.single and self.nodes.is_leader and int(owner) not in here
                         and self.root.writer_alive(int(owner)) is None)
                if (mine and keep is not None and f.name not in keep) or moved or (departed and (keep is None or
                                                                                               f.name not in keep)):
                    if keep is not None and f.name in keep and not persisting:  # the tier's own decision, not
                        clear_commit(slot, fsync=False)  # damage: no longer a checkpoint (a restart must not take it
                        keep = None  # for a damaged one)
                    logger.info("cpuckpt memory tier: removing stale image %s", f)
                    f.unlink(missing_ok=True)

    def _cancel_uncommitted_requests(self) -> None:
        """At start (this trainer holds the rank's lock, so its predecessor is gone): a request whose save
        never committed in memory can never be persisted; withdraw it so it holds no slot and no writer."""
        for req in self.queue.owed():
            committed = self.format.committed(Path(req.slot))
            if committed is None or committed.save_id != req.save_id:
                self.queue.cancel(req.seq, "its save never committed in memory (the trainer ended first)")

    def _withdraw_replica_requests(self) -> list[PersistRequest]:
        """At start, before the writer runs: an earlier trainer's owed replicas name its partners' endpoints of
        then, which a relaunch's writers no longer listen on (each send would retry a dead port for
        ``CONNECT_RETRY_S``, holding the queue and the slot). Withdrawn here, re-requested for today's
        partners once they are known (:meth:`_requeue_replicas`)."""
        stale = [req for req in self.queue.owed() if req.kind == "replicate"]
        for req in stale:
            self.queue.cancel(req.seq, "an earlier trainer's replica (its partners' endpoints are gone); "
                                       "re-requested for the current partners")
        return stale

    def _requeue_replicas(self, rep: Replication, stale: list[PersistRequest]) -> None:
        """The withdrawn replicas whose slot still holds their save, sent to today's partners."""
        if not self.nodes.is_leader or not rep.partners:
            return
        for req in stale:
            slot = Path(req.slot)
            committed = self.format.committed(slot)
            if committed is None or committed.save_id != req.save_id:
                continue
            self._put(dataclasses.replace(
                self._persist_request(slot, req.save_id, req.step, slot), kind="replicate",
                partners=tuple((e.host, e.port) for e in rep.partners), source=self.nodes.keys[self.rank],
                token=rep.token, marker=req.marker))

    def _held(self, slot: Path) -> bool:
        return any(r.slot == str(slot) for r in self.queue.owed())

    def _agree(self, flags: list[int]) -> list[int]:
        """Every rank's maximum of ``flags`` (one all-reduce). Waited in slices of at most 10 ms, not in one blocking
        call: a rank waiting for a late one still gets Ctrl-C (KeyboardInterrupt) at once; the group's own
        timeout (``timeout_s``) bounds the wait."""
        group = peers(self.group) if self.dist else None
        if group is None:
            return flags
        t = torch.tensor(flags, dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
        pause = 0.0001  # doubles up to 10 ms: a save's agreement adds microseconds, a long wait polls slowly
        while not work.is_completed():
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        work.wait()  # raises the collective's error, if any
        return [int(x) for x in t.tolist()]

    # -- saving ---------------------------------------------------------------------------------
    def save(self, state_dict: dict[str, Any], step: int, *, name: str | None = None, planner: Any = None,
             plan_key: Hashable | None = None, persist: bool | None = None, dest: str | os.PathLike | None = None,
             before_fill: Callable[[Path], None] | None = None, ordering: str = "host") -> AsyncSaveHandle:
        """Save ``state_dict`` into the next memory slot; persist it if ``step`` is a multiple of
        ``memory.persist_every``. Collective: every rank calls it with the same step.

        ``persist`` True/False overrides ``persist_every`` for this save; ``dest`` is where a persist (or a
        ``when_full: disk`` save) goes, default ``<durable_root>/<name>``; ``before_fill(slot)`` runs on every
        rank once the slot is chosen, before a byte of it changes (adapters name the slot their own way).
        :attr:`last_persist` is the persist request this save made, or None. ``ordering`` as for
        :func:`cpuckpt.async_save` (``stream``: returns once the GPU copies are enqueued; order writes to
        the saved tensors after ``handle.wait_stream()``).

        Returns the handle of the memory save (or of a durable save, ``when_full: disk``).

        Raises:
            WriterDiedError: some rank's writer died owing persists (``on_writer_failure: raise``).
        """
        name = name or f"step_{step}"
        if dest is None:
            dest = self.durable_root / name
        else:
            where = checkpoint_path(dest, "memory tier save destination")
            dest = where if isinstance(where, S3Url) else Path(where)
        self.last_persist = None
        # Before anything changes a slot (the adapter's before_fill, a leader's clear_commit): with fewer than
        # memory.max_uncommitted older saves running, the newest committed save's slot is never the one refilled.
        self._wait_uncommitted_below(self.max_uncommitted)
        replicas = self._replication is not None and self.nodes.is_leader and bool(self._replication.partners)
        claimed = self._claim(step, needs_writer=replicas or self._persist_due(step, persist))
        if claimed is None:
            return self.saves.async_save(state_dict, dest, self.config, step=step, planner=planner,
                                         plan_key=plan_key, ordering=ordering)
        k, token = claimed
        slot = self.slots[k]
        # A restore planned into this slot (candidates) would now overwrite this save: dropped on every rank
        # (every rank fills the same slot index).
        self._pending.pop(slot, None)
        previous = self._slot_saves.get(k)
        if previous is not None:  # its commit must not land after this save cleared the slot; its failure, if it
            previous.wait_ended()  # failed, is its wait()'s and the in-flight bound's to report (every rank alike)
            del self._slot_saves[k]
        if before_fill is not None:  # an adapter's naming: its failure on any rank is every rank's (agreed)
            failure: BaseException | None = None
            try:
                before_fill(slot)
            except Exception as e:  # reported on every rank just below
                failure = e
            (any_failed,) = self._agree([int(failure is not None)])
            if any_failed:
                raise CpuckptError(f"rank {self.rank}: preparing {slot} for step {step} failed" +
                                   (f": {failure}" if failure else " on another rank (see its log)")) from failure
        slot_planner, slot_key = planner, plan_key
        if not self.nodes.single:
            # Replicated items: one copy per node, so each node's slot holds what its ranks load (nodecopies).
            slot_planner = with_node_copies(planner, self.nodes.keys)
            slot_key = None if planner is not None and plan_key is None else ("node-copies", self.nodes.keys,
                                                                               plan_key)
            if self.nodes.is_leader:
                # Each node's slot is made incomplete by its own leader before any byte of it changes (the
                # coordinator clears only its own); async_save's planning collective orders this before every fill.
                clear_commit(slot, fsync=False)
        handle = self.saves.async_save(state_dict, slot, self.memory_config, step=step,
                            planner=slot_planner, plan_key=slot_key, sink=self.images[k],
                            save_id=token, commit_hook=self._node_commit,
                            ordering=ordering)
        self._slot_saves[k] = handle
        self._next = (k + 1) % len(self.slots)
        images = self.images[k]
        handle.add_done_callback(lambda error: images.drop_unclaimed() if error is None else None)
        if self.config.memory.prepare_slots and not self._prepare_decided.is_set():
            device = caller_device()  # the saving thread's: the callback runs on the committer's
            handle.add_done_callback(lambda error, k=k: self._prepare_slots(k, device) if error is None
                                     else self._prepare_decided.set())
        if self._replication is not None and self.nodes.is_leader and self._replication.partners:
            self._request_replica(self._replication, handle, step, slot)
        requested = self._persist_due(step, persist)
        if requested:
            self.last_persist = self._request_persist(handle, step, dest, slot)
        # after the request: SIGTERM's handler reads both
        self._last = _LastSave(step, slot, self._persist_request(slot, handle.save_id, step, dest, seq=0), requested)
        return handle

    def _claim(self, step: int | None, *, needs_writer: bool = False) -> tuple[int, str] | None:
        """Collective: (the next slot's index, a save id common to every rank), once no persist holds that slot;
        None when one does and ``memory.when_full`` is disk (the save goes to the durable root instead).

        Raises:
            PersistError: some rank's persist failed (reported once; ``report_persist_failures``).
            WriterDiedError: some rank's writer died owing persists (``on_writer_failure: raise``), or could not
                be respawned.
            CheckpointTimeoutError: the slot is still held after ``timeout_s`` (``when_full: wait``).

        ``needs_writer``: this save will send this rank's writer a request, so the writer is started now if none
        runs, and a start that fails on any rank fails the save on every rank (``WriterDiedError``) before a byte
        moves, instead of on that rank alone after its save began.
        """
        # one that died owing is on_writer_failure's to handle below
        start_failed = self._try_start_writer() if needs_writer and not self._writer_dead_with_debts() else None
        k = self._next
        slot = self.slots[k]
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            # One all-reduce: a dead writer anywhere, a failed persist anywhere, a held slot anywhere, and a
            # save id common to all ranks (the maximum of random numbers).
            failed = self._new_persist_failures() if self.report_persist_failures else []
            expired = time.monotonic() > deadline
            dead, persist_failed, held, expired, respawn_failed, token = self._agree(
                [int(self._writer_dead_with_debts()), int(bool(failed)), int(self._held(slot)), int(expired),
                 int(self._respawn_failed is not None or start_failed is not None),
                 secrets.randbits(62)])  # not `random`: the trainer's own random stream stays untouched
            if respawn_failed and start_failed is not None:
                raise start_failed
            if respawn_failed:
                raise WriterDiedError(f"rank {self.rank}: a writer process could not be started or respawned"
                                      + (f": {self._respawn_failed}" if self._respawn_failed else " (on another rank)"))
            if persist_failed:
                # A save with a failed part is never committed: every rank withdraws what it still owes, so that
                # the coordinator's writer stops waiting (timeout_s) for a part that never comes.
                for req in self.queue.owed():
                    if req.kind != "replicate":
                        self.queue.cancel(req.seq, "a persist failed on some rank")
                raise PersistError(f"rank {self.rank}: " + ("; ".join(failed) if failed else
                                   f"another rank's persist to {self.durable_root} failed (see its log)"))
            if dead:
                self._writer_failed()
                continue
            if not held:
                if self._departed:
                    self._drop_departed_replicas(k)
                return k, f"{self.root.job[:24]}-{token:016x}"
            if self.config.memory.when_full == "disk":
                logger.warning("cpuckpt memory tier: every slot is held by a persist; step %s goes to the durable "
                               "root directly", step)
                return None
            if expired:  # agreed: every rank raises together
                raise CheckpointTimeoutError(f"memory tier: {slot} still held by a persist after "
                                             f"{self.config.timeout_s} s (when_full: wait)")
            logger.info("cpuckpt memory tier: step %s waits for the persist of %s", step, slot.name)
            time.sleep(0.01)

    # -- file sets: an adapter that writes its own files into a slot (the DeepSpeed adapter) ----------
    def claim_slot(self, step: int | None = None) -> tuple[Path, str] | None:
        """Collective: the slot an adapter's next memory checkpoint goes into, and its save id (the same on every
        rank), for adapters that write their own files (``slot_format`` names what a complete one is).

        The adapter fills the slot (its files through the slot's images, ``images[k]``, a sink of the save
        engine), commits it in memory with its marker, then calls :meth:`commit_files` on every rank. A slot
        claimed but never committed stays as it was until its next use. Raises as :meth:`save` does.

        Returns:
            (slot directory, save id), or None when every slot is held by a persist and ``memory.when_full`` is
            disk: that checkpoint goes to the durable root, as without the tier.
        """
        replicas = self._replication is not None and self.nodes.is_leader and bool(self._replication.partners)
        claimed = self._claim(step, needs_writer=replicas or self._persist_due(step, None))
        if claimed is None:
            return None
        k, save_id = claimed
        self._pending.pop(self.slots[k], None)  # a restore planned into this slot would overwrite this save
        return self.slots[k], save_id

    def commit_files(self, slot: Path, save_id: str, step: int | None, dest: str | os.PathLike, *,
                     files: dict[str, FileEntry], marker: str, saving: str = "",
                     pointer: tuple[str | os.PathLike, str] | None = None,
                     persist: bool | None = None) -> PersistRequest | None:
        """After the adapter committed ``slot`` in memory (its marker, naming ``save_id``, is written): the ring
        moves on, and this rank's persist of ``files`` to ``dest`` is queued when ``step`` is a multiple of
        ``memory.persist_every`` (``persist`` overrides). Every rank calls it, with its own ``files`` (names
        relative to ``slot`` and ``dest``; a rank without files still sends its empty part). Rank 0's writer
        commits ``dest``: the slot's ``marker`` copied last, then ``pointer`` ([path, text]) written unless it
        names a file set of a newer step (:func:`cpuckpt.tier.persister.persist_files`). No collective. Across
        nodes each node's leader commits its own slot (its node listing, :mod:`cpuckpt.tier.nodefiles`, then the
        marker), and with ``memory.replicas`` its writer also sends the slot to the partners once committed
        (:attr:`last_replica`: the request, for the adapter to withdraw when the commit fails).

        Returns:
            The persist request queued (its outcome: :meth:`persisted`, :meth:`wait_persisted`), or None.
        """
        slot, dest = Path(slot), Path(dest)
        if slot not in self.slots:
            raise ValueError(f"{slot} is not a slot of the memory tier in {self.root.path}")
        k = self.slots.index(slot)
        self.images[k].drop_unclaimed()  # every file of the slot's save was claimed by now
        request = dataclasses.replace(
            self._persist_request(slot, save_id, step, dest), kind="files", marker=marker, saving=saving,
            files=tuple((name, dataclasses.asdict(e)) for name, e in sorted(files.items())),
            pointer=(str(pointer[0]), pointer[1]) if pointer is not None else ())
        self._next = (k + 1) % len(self.slots)
        requested = self._persist_due(step, persist)
        self.last_persist = self.last_replica = None
        if requested:
            self._put(request)
            self.last_persist = request
        rep = self._replication
        if rep is not None and self.nodes.is_leader and rep.partners:  # across nodes: this node's slot to partners
            self.last_replica = dataclasses.replace(
                self._persist_request(slot, save_id, step, slot), kind="replicate", marker=marker,
                partners=tuple((e.host, e.port) for e in rep.partners), source=self.nodes.keys[self.rank],
                token=rep.token)
            self._put(self.last_replica)
        self._last = _LastSave(step, slot, request, requested)
        if self.config.memory.prepare_slots and not self._prepare_decided.is_set():
            self._prepare_slots(k, caller_device())
        return self.last_persist

    def resume_after(self, path: str | os.PathLike) -> None:
        """The checkpoint at ``path`` was loaded (by the adapter): the ring's next save must not overwrite it.
        Collective across nodes, like :meth:`load_latest`."""
        path = Path(path)
        self._next = self._agree_next(self._slot_after(path) if path in self.slots else self._next)

    def _holds(self, last: _LastSave) -> bool:
        """The save ``last`` is still the complete checkpoint of its slot."""
        committed = self.format.committed(last.slot)
        return committed is not None and committed.save_id == last.request.save_id

    def _persisted_save(self, last: _LastSave) -> bool:
        """The save ``last`` itself (its save id) is committed at its persist destination. A durable checkpoint of the
        same step from another save (a rewind, a rerun to the same step) is not it, and is overwritten; in object
        storage, where objects are written once, it cannot be: then nothing is to do, and a warning says so."""
        dest = checkpoint_path(last.request.dest)
        if isinstance(dest, S3Url):
            from cpuckpt.tier.s3persist import committed_save_id
            from cpuckpt.transfer.objstore import open_store

            committed = committed_save_id(open_store(self.config.s3, threads=1), dest)
            if committed is not None and committed != last.request.save_id:
                logger.warning("cpuckpt memory tier: step %s is not persisted at close: %s holds another save's "
                               "checkpoint of that step (objects are written once)", last.step, dest)
            return committed is not None
        durable = self.format.committed(Path(dest))
        return durable is not None and durable.save_id == last.request.save_id

    def _persist_due(self, step: int | None, persist: bool | None) -> bool:
        """``persist`` when given, else whether ``step`` is a multiple of ``memory.persist_every`` (0: never; a
        save without a step is persisted whenever persisting is on)."""
        if persist is not None:
            return persist
        every = self.config.memory.persist_every
        return bool(every) and (step is None or step % every == 0)

    def _prepare_slots(self, k: int, device: int | None) -> None:
        """Once slot ``k`` holds a committed save: reserve, map and pin the other slots' missing images to
        the same sizes on a background thread (a first save into a slot otherwise pays it: ~2.8 s for 5 GB
        on the H200). A slot owed to a persist is left alone, and so is every image that exists here (a job
        may be filling it). A slot holding a complete checkpoint (a restart finds the ring full) is prepared
        only when its files already have those sizes: mapping and pinning them leaves every byte as it is,
        and the relaunch's first save into each such slot had paid it (1.1-2.3 s for 5 GB on the H200)."""
        sizes = {n: img.nbytes for n in self.images[k].names if (img := self.images[k].get(n)) is not None}

        def run() -> None:
            try:
                if device is not None:  # pinned under the saving thread's device (its context), as a save would
                    torch.cuda.set_device(device)
                for j, images in enumerate(self.images):
                    if j == k or self._held(self.slots[j]):
                        continue
                    if self.format.committed(self.slots[j]) is not None and not _sized_as(self.slots[j], sizes):
                        continue
                    for name, nbytes in sizes.items():
                        if self._closing.is_set():
                            return
                        images.prepare(name, nbytes, chunk_bytes=self.config.io.chunk_bytes)
                        self._prepare_copier(images, name, device)
            except CpuckptError as e:  # e.g. the RAM root's headroom: the save that needs the image says so
                logger.warning("cpuckpt memory tier: preparing the slots' images ahead failed: %s", e)

        with self._prepare_lock:  # one preparation per tier; none once close() began
            if self._prepared is None and not self._closing.is_set():
                # not a daemon: the exit waits for it (a daemon thread pinning at finalization aborts the process)
                self._prepared = threading.Thread(target=run, name=f"cpuckpt-prepare-{self.rank}")
                self._prepared.start()
        self._prepare_decided.set()

    def _prepare_copier(self, images: ImageSet, name: str, device: int | None) -> bool:
        """The copy process maps and pins an image ahead of its first save (when it copies into it), under the
        trainer's ``device``. True when asked."""
        img = images.get(name)
        if self.copier is None or not self.config.staging.device_snapshot or img is None:
            return False
        try:
            self.copier.prepare(lambda: images.describe([img]), self.config.io.chunk_bytes, device)
        except CpuckptError as e:  # the save that needs it starts a new process and says so
            logger.warning("cpuckpt memory tier: rank %d: preparing %s in the copy process failed: %s", self.rank,
                           img.path, e)
            return False
        return True

    def _wait_copier_pinned(self, asked: list[int]) -> None:
        """The reserving thread (the job's, before it trains) waits for the copy process to have pinned the reserved
        images of sizes ``asked``: pinned while the job trained, they held up its first saves (a Megatron-LM run on an
        H100: the first saves committed 3.6-5.7 s after their calls, iterations 3-5 took 4.5, 1.2 and 1.2 s, and a save
        every 8 iterations waited 1.7 s at its third). Bounded by 30 s plus 2 s per GB (it pinned 2.0-2.1 GB/s), at
        most ``timeout_s``: well within the framework's collective timeouts, which the other ranks wait under meanwhile.
        A failure or the bound is a warning (each save pins what it still needs)."""
        copier = self.copier
        if copier is None or not asked:
            return
        bound = min(self.config.timeout_s, 30.0 + 2.0 * sum(asked) / 1e9)
        t0 = time.monotonic()
        try:
            done = copier.wait_prepared(bound)
        except CpuckptError as e:
            logger.warning("cpuckpt memory tier: rank %d: waiting for the copy process to pin the reserved images "
                           "failed: %s", self.rank, e)
            return
        if done:  # what it could not pin (its log says) the first saves pin
            logger.info("cpuckpt memory tier: rank %d: the copy process went through the %d reserved image(s) in "
                        "%.2f s", self.rank, len(asked), time.monotonic() - t0)
        else:
            logger.warning("cpuckpt memory tier: rank %d: the copy process had not pinned the %d reserved image(s) "
                           "after %.0f s; training goes on (the first saves pin what is missing)", self.rank,
                           len(asked), bound)

    def reserve(self, shard_nbytes: int) -> int:
        """Before the first save (a job calls it before it trains): reserve, map and pin every free slot's image
        for this rank's shard of about ``shard_nbytes`` bytes, so that no save pays for it while the job trains
        (~1-1.8 s per 5 GB slot on the H200, on the trainer's thread: the spikes at the first saves); with a copy
        process that copies from a device snapshot, that process pins them instead, and this waits for it. The
        first save into a slot truncates its image to the real size (a larger one maps it again). A slot holding a
        checkpoint, or an image, is left alone; a tier of other files (DeepSpeed's: :meth:`reserve_files`), or
        across nodes, reserves nothing here. Returns how many images it made; a RAM filesystem too small is a
        warning here (the save that needs the space raises it)."""
        if shard_nbytes <= 0 or not isinstance(self.format, DcpSlots):
            return 0
        return self._reserve_images({f"__{self.rank}_0.distcp": shard_nbytes})  # one data file per rank (its plan)

    def reserve_files(self, sizes: Mapping[str, int]) -> int:
        """As :meth:`reserve`, for a caller that knows the names of this rank's files and about their sizes (a tier of
        DeepSpeed's files: their names are DeepSpeed's). On the caller's thread, before training: a reservation on a
        thread beside a training job did not end before its first saves (13.6 GB take 4.7-5.9 s per slot on the H200)
        and held the driver while it pinned. Nothing across nodes. Returns how many images it made."""
        if not self.nodes.single:
            logger.info("cpuckpt memory tier: across nodes no image is reserved ahead (each node's slot holds files of "
                        "every rank of the node); the first saves make them")
        return self._reserve_images(sizes)

    def _drop_unclaimed_images(self) -> None:
        """Local, at exit: reserved images no save claimed are removed (never a collective: other ranks may be gone)."""
        for images in self.images:
            images.drop_unclaimed()

    def _reserve_images(self, sizes: Mapping[str, int]) -> int:
        """Reserve ``sizes`` (image name: bytes) in every free slot of a single-node tier; stops at close or at the
        RAM filesystem's limit (a warning: the save that needs the space raises it). The files' pages are allocated
        first, side by side (:meth:`_allocate_ahead`); mapping and pinning follow here, on the caller's thread (its
        device), or in the copy process, waited for here. Images still unclaimed when the process exits without
        :meth:`close` (a job that fails before its first save) are removed then: they hold no checkpoint. Returns how
        many it made."""
        wanted = {name: nbytes for name, nbytes in sizes.items() if nbytes > 0}
        if not self.nodes.single or self._closing.is_set() or not wanted:
            return 0
        free = [(slot, images) for slot, images in zip(self.slots, self.images)
                if self.format.committed(slot) is None and not self._held(slot)]
        made = 0
        asked: list[int] = []  # sizes of the images the copy process was asked to pin
        ahead = AllocatedAhead()  # files made and allocated first, each taken below (or removed at the end)
        try:
            self._allocate_ahead(free, wanted, ahead)
            for slot, images in free:
                for name, nbytes in wanted.items():
                    if self._closing.is_set():  # closed: its root and queue may be gone
                        return made
                    try:
                        if images.reserve(name, nbytes, chunk_bytes=self.config.io.chunk_bytes,
                                          allocated=ahead.allocated(slot / name)):
                            made += 1
                            # the copy process pins it (waited for below): its first save re-registers only the
                            # segment past its real size (pinning.stale)
                            if self._prepare_copier(images, name, caller_device()):
                                asked.append(nbytes)
                    except CpuckptError as e:
                        logger.warning("cpuckpt memory tier: reserving %d bytes for %s in %s ahead of the first save "
                                       "failed: %s", nbytes, name, slot, e)
                        self._wait_copier_pinned(asked)
                        return made
            self._wait_copier_pinned(asked)
            return made
        finally:
            ahead.close()
            if made and not self._closing.is_set():  # again is harmless: close() unregisters every registration
                atexit.register(self._drop_unclaimed_images)

    def _allocate_ahead(self, free: list[tuple[Path, ImageSet]], wanted: Mapping[str, int],
                        ahead: AllocatedAhead) -> None:
        """The new images' files made and their pages allocated side by side (:class:`AllocatedAhead`; 3 x 2 GiB
        through :meth:`reserve`: 1.43 -> 0.72-0.79 s on the 2-core CPU box; 3 x 5.2 GB took 4.1 s of a Megatron-LM
        run's start on the H200, one after the other). Only where every file of this node's ranks fits at once
        (this rank's total times its node's ranks, against the headroom): else the reservation allocates each, one
        after the other, as many as fit."""
        files = [(slot / name, images, nbytes) for slot, images in free for name, nbytes in wanted.items()
                 if images.get(name) is None and not os.path.lexists(slot / name)]
        if len(files) < 2:
            return
        try:
            self.root.check_space(sum(n for *_, n in files) * len(self.nodes.node_ranks))
        except CpuckptError:
            return
        ahead.allocate(files)

    def wait_prepared(self, timeout_s: float | None = None) -> bool:
        """Wait for the background preparation of the slots' images (started after the first committed save);
        True when it ended, or none will run (``prepare_slots`` off, or the first save failed)."""
        if not self.config.memory.prepare_slots or self._last is None:
            return True
        deadline = time.monotonic() + (self.config.timeout_s if timeout_s is None else timeout_s)
        if not self._prepare_decided.wait(max(0.0, deadline - time.monotonic())):
            return False
        with self._prepare_lock:  # made and started under it
            prepared = self._prepared
        if prepared is not None:
            prepared.join(max(0.0, deadline - time.monotonic()))
            return not prepared.is_alive()
        return True

    def _request_persist(self, handle: AsyncSaveHandle, step: int | None, dest: Path, slot: Path) -> PersistRequest:
        """Queue the persist now (the writer waits for the memory commit); a failed save cancels it."""
        req = self._persist_request(slot, handle.save_id, step, dest)
        self._put(req)

        def cancel_if_failed(error: BaseException | None) -> None:
            if error is not None:
                self.queue.cancel(req.seq, f"the memory save failed: {error}")

        handle.add_done_callback(cancel_if_failed)
        return req

    def _request_replica(self, rep: Replication, handle: AsyncSaveHandle, step: int | None, slot: Path) -> None:
        """Queue the copy of this node's slot to the partners: the writer sends it once committed in memory.
        The slot stays held until then, so the ring never overwrites a slot being copied."""
        req = dataclasses.replace(self._persist_request(slot, handle.save_id, step, slot), kind="replicate",
                                  partners=tuple((e.host, e.port) for e in rep.partners),
                                  source=self.nodes.keys[self.rank], token=rep.token)
        self._put(req)
        handle.add_done_callback(lambda error: None if error is None else
                                 self.queue.cancel(req.seq, f"the memory save failed: {error}"))

    def _writer_not_leaving(self, lock_path: Path, pid: int | None) -> int | None:
        """The running writer's pid (``pid``, as just found), or None. A writer that marked itself leaving (its
        trainer was gone and nothing was owed; it may still drain a replica transfer, no longer serving its queue)
        is waited for until it ends, or until it withdraws the mark (it saw this trainer's lock and serves on),
        never adopted."""
        deadline = time.monotonic() + DRAIN_S + 30
        while pid is not None and leaving_pid(lock_path) == pid:
            if time.monotonic() > deadline:
                raise WriterDiedError(f"rank {self.rank}: writer pid {pid} has been ending for {DRAIN_S + 30:.0f} s "
                                      f"and still holds {lock_path}; see its log in {self.root.path}")
            time.sleep(0.05)
            pid = self.root.writer_alive(self.rank)
        return pid

    def _try_start_writer(self) -> CpuckptError | None:
        """:meth:`_ensure_writer`, its failure returned for the caller to agree on with the other ranks."""
        try:
            self._ensure_writer()
        except CpuckptError as e:
            return e
        return None

    def _put(self, req: PersistRequest) -> None:
        """Queue ``req`` for this rank's writer, starting the writer first if none runs."""
        self._ensure_writer()
        self.queue.put(req)

    def _persist_request(self, slot: Path, save_id: str, step: int | None, dest: Path,
                         seq: int | None = None) -> PersistRequest:
        return PersistRequest(seq=self.queue.next_seq() if seq is None else seq, slot=str(slot), save_id=save_id,
                              step=step, dest=str(dest), rank=self.rank, world_size=self.world_size,
                              coordinator=self.rank == 0, config=self._config_dict, trainer_pid=os.getpid(),
                              trainer_lock=str(self.trainer_lock))

    def _writer_failed(self) -> None:
        msg = ("a writer process of the memory tier died owing persists (see writer-<rank>.log in "
               f"{self.root.path})")
        if self.config.memory.on_writer_failure == "raise":
            raise WriterDiedError(f"rank {self.rank}: {msg}")
        logger.error("cpuckpt memory tier: %s; respawning it (it redoes what was owed)", msg)
        try:
            self._ensure_writer()
        except CpuckptError as e:  # agreed on at the next round: every rank raises then
            self._respawn_failed = e

    # -- state ----------------------------------------------------------------------------------
    def persisted(self, step: int) -> bool:
        """Whether step ``step`` has a complete durable checkpoint."""
        return any(d.step == step for d in self.format.durable(self.durable_root))

    def replicated(self, step: int) -> bool:
        """Whether this node's memory checkpoint of ``step`` has a committed copy on every partner node
        (``memory.replicas``): its node leader's writer reported every partner's commit. A failed replica
        is only a warning in the log (training goes on); this says whether the copy exists.

        False when no replica was requested (replicas off, one node), it is still owed (see
        :meth:`wait_persisted`) or it failed. A partner keeps one copy per slot, replaced by the next save into
        that slot, so only the newest ``memory.slots`` steps can be True. No collective: any rank of the node
        reads its leader's queue (the RAM root is shared).
        """
        if not self.config.memory.replicas or self.nodes.single:
            return False
        queue = PersistQueue(self.root.path / f"queue-{self.nodes.leader}")
        try:
            asked = [r for r in queue.requests() if r.kind == "replicate" and r.step == step]
        except OSError:
            return False
        if not asked:
            return False
        newest = max(asked, key=lambda r: r.seq)
        outcome = queue.outcome(newest.seq)
        if outcome is None or not outcome.ok:
            return False
        held = self.format.committed(Path(newest.slot))  # the slot since reused: its partners' copies were replaced
        return held is not None and held.save_id == newest.save_id

    def wait_persisted(self, timeout_s: float | None = None) -> None:
        """Wait until this rank's writer owes nothing: every persist and, on a node's leader, every replica it
        was asked for has an outcome (raises if the writer dies owing). Not collective, and it reports no
        outcome: :meth:`persisted` and :meth:`replicated` say what exists; a failed persist raises
        :class:`PersistError` at the next save or at :meth:`close`. Polls in 10 ms slices (Ctrl-C is prompt).

        Raises:
            WriterDiedError: the writer exited owing.
            CheckpointTimeoutError: still owed after ``timeout_s`` (default ``timeout_s``).
        """
        deadline = time.monotonic() + (self.config.timeout_s if timeout_s is None else timeout_s)
        while self.queue.owed():
            if not self._writer_running():
                raise WriterDiedError(f"rank {self.rank}: the writer process died owing persists")
            if time.monotonic() > deadline:
                raise CheckpointTimeoutError(f"rank {self.rank}: persists still owed after the timeout")
            time.sleep(0.01)

    def find_latest(self) -> Path | S3Url | None:
        """The newest checkpoint complete in either tier (memory first on equal steps); torn images never.

        Collective: every rank gets the checkpoint rank 0 found (a durable commit landing between two ranks' scans
        must not send them different ways). A query: it changes nothing in any RAM root; a memory checkpoint a lost
        node gets back from a replica is restored by :meth:`load` of the path returned here (load it with
        ``tier.load``, not ``cpuckpt.load``).
        """
        found = self._agreed_candidates()
        return found[0] if found else None

    def candidates(self, state_dict: dict[str, Any] | None = None, *, planner: Any = None) -> list[Path | S3Url]:
        """Every complete checkpoint of both tiers, newest first (memory before durable on equal steps; of two memory
        saves of one step, the later commit first), as this rank sees them: on one node no collective, so ranks that
        list a moment apart may differ (:meth:`find_latest` and :meth:`load_latest` agree on rank 0's).

        Across nodes (ranks in several RAM roots) it is collective: a memory checkpoint is listed only
        when every rank's node holds the files that rank needs (its load plan of ``state_dict`` with
        ``planner`` when given, else its own files); the path listed is this rank's node's slot. With
        ``memory.replicas`` a checkpoint a node lost is listed when another node holds a copy for it; the
        copy is planned here and sent only by :meth:`load` of that path (nothing here writes), and only
        where it overwrites nothing newer (:func:`cpuckpt.tier.recovery.agree_available`).
        """
        return [path for _, path in self._listing(state_dict, planner)]

    def own_candidates(self, state_dict: dict[str, Any] | None = None, *, planner: Any = None) -> list[Path | S3Url]:
        """Collective: :meth:`candidates` as each rank lists them (across nodes: its own node's slots), where a
        listing that fails on one rank (the durable root unreadable there: a stale mount, object storage refusing) is
        raised on every rank alike, not left to the others' next collective and its timeout. For a caller that
        agrees on the order itself (rank 0's, or the collective agreement across nodes)."""
        return [path for _, path in self._agreed_listing(state_dict, planner)]

    def _agreed_listing(self, state_dict: dict[str, Any] | None,
                        planner: Any) -> list[tuple[Hashable, Path | S3Url]]:
        """Collective: this rank's :meth:`_listing`; a failure on any rank is raised on every rank."""
        listing: list[tuple[Hashable, Path | S3Url]] = []
        error: BaseException | None = None
        try:
            listing = self._listing(state_dict, planner)
        except BaseException as e:  # raised alike on every rank, not while the others wait in a collective
            error = e
        agree_or_raise(error, self.rank, self.group, f"listing the checkpoints of "
                       f"{self.durable_root} and the memory tier")
        return listing

    def _agreed_candidates(self, state_dict: dict[str, Any] | None = None, *,
                           planner: Any = None) -> list[Path | S3Url]:
        """Collective: :meth:`candidates` as rank 0 lists them, the same checkpoints in the same order on every rank
        (one broadcast; across nodes each rank's path of a memory checkpoint is its own node's slot).

        Each rank's own listing is not enough: a writer of the previous trainer committing a durable checkpoint
        between two ranks' scans would make them load different checkpoints, silently (restart.py agrees the
        core's candidates the same way).
        """
        listing = self._agreed_listing(state_dict, planner)
        if not self.dist or peers(self.group) is None:
            return [path for _, path in listing]
        box: list[Any] = [listing if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        mine = dict(listing)
        # a memory checkpoint by this rank's slot (across nodes every rank lists the same ones: agreed above); one
        # this rank did not list is rank 0's path: on one node the slots and the durable root are shared
        return [mine.get(key, path) for key, path in box[0]]

    def _listing(self, state_dict: dict[str, Any] | None, planner: Any) -> list[tuple[Hashable, Path | S3Url]]:
        """:meth:`candidates` with a key naming each alike on every rank: ("memory", step, save id) or
        ("durable", path)."""
        # (step, tier, commit time, name, key, path): memory before durable on equal steps, and two memory saves of
        # one step (a rewind: the abandoned one may still sit in another slot) by commit time, as rootinfo.ordered
        found: list[tuple[int, int, float, str, Hashable, Path | S3Url]]
        if self.nodes.single:
            found = [(c.step, 1, c.created, str(d), ("memory", c.step, c.save_id), d) for d in self.slots
                     if (c := self.format.committed(d)) is not None and c.step is not None and not self._partial(d)]
        else:
            mine = held_saves(self.slots, self.rank, self.world_size, state_dict, planner)
            if self.config.memory.replicas:  # own slots, or a copy another node holds (restored before the load)
                leader = self.nodes.is_leader
                copies = node_copies(self.root.path, self.slots, self.rank, self.world_size) if leader else []
                present = slots_present(self.slots) if leader else {}
                held, self._pending = agree_available(self.nodes, mine, copies, present, self.slots, self.group)
            else:
                held = agree_held(mine, self.world_size, self.group)
            found = [(step, 1, self._created(slot, save_id), str(slot), ("memory", step, save_id), slot)
                     for (step, save_id), slot in held.items()]
        found += [(d.rank, 0, 0.0, str(d.path), ("durable", str(d.path)), d.path)
                  for d in self.format.durable(self.durable_root)]
        return [(f[4], f[5]) for f in sorted(found, key=lambda f: f[:4], reverse=True)]

    def _created(self, slot: Path, save_id: str) -> float:
        """When save ``save_id`` (listed in ``slot``) was committed: its manifest's time (0.0 when unknown, e.g. a
        restore from another node's copy planned into ``slot``)."""
        held = self.listed(slot)
        return held.created if held is not None and held.save_id == save_id else 0.0

    def _partial(self, slot: Path) -> bool:
        """One node after a run across nodes: a slot holding only that node's ranks' files (the same answer on
        every rank: it reads the slot's files only) is no checkpoint this job can load; warned about, not listed."""
        missing = missing_files(slot) if isinstance(self.format, DcpSlots) else []
        if missing:
            logger.warning("cpuckpt memory tier: %s was saved across nodes and lacks %d file(s) of this job's ranks "
                           "(%s, ...): ignored (the topology changed)", slot, len(missing), missing[0])
        return bool(missing)

    def load_latest(self, state_dict: dict[str, Any], *, planner: Any = None) -> Path | None:
        """Restart: load the newest checkpoint that loads cleanly, falling back to the next on damage.

        A checkpoint whose checksums or sizes do not verify (:class:`IntegrityError`, raised by the load on
        every rank), or that was committed and is incomplete now (a data file truncated or missing: never listed),
        is skipped with a warning naming why, so a damaged newest checkpoint costs some steps instead of becoming
        NaNs or a crash loop. Returns the path loaded, or None (nothing to load).

        Raises:
            CheckpointCorrupt: checkpoints exist but none loads, or none is complete but some were committed and are
                damaged since (a data file truncated or missing): never an empty start over them.
            UnsafeCheckpointError: a value names a global a safe load refuses (not damage: no fallback).
        """
        found = self._agreed_candidates(state_dict, planner=planner)
        plan = dict(self._pending)  # a fallback's restore was planned with the rest: kept for it
        damaged = self._agreed_damaged()  # never listed: one newer than the checkpoint loaded is named below
        failures: list[str] = []
        for path in found:
            self._pending = {path: plan[path]} if path in plan else {}
            try:
                self.load(state_dict, path, planner=planner)
            except UnsafeCheckpointError:
                raise  # an older checkpoint holds values of the same kinds
            except IntegrityError as e:
                logger.warning("cpuckpt memory tier: %s does not verify (%s); falling back to the next newest",
                               path, e)
                failures.append(f"{path}: {e}")
                continue
            self.resume_after(path)
            loaded = self.step_of(path)
            for where, why, step in damaged:  # skipped: newer than the one loaded, or of no known step
                if step is None or loaded is None or step >= loaded:
                    logger.warning("cpuckpt memory tier: skipped %s (step %s): committed, but incomplete now (%s)",
                                   where, step, why)
            return path
        if failures or damaged:
            raise CheckpointCorrupt(
                f"no memory or durable checkpoint of {self.durable_root} loads cleanly ("
                + "; ".join(failures + [f"{where}: committed, but incomplete now ({why})" for where, why, _ in damaged])
                + ("); the state dict may be partly overwritten: do not train from it" if failures else
                   "); not starting from scratch over committed checkpoints"))
        return None

    def _agreed_damaged(self) -> list[tuple[str, str, int | None]]:
        """Collective: (where, why, step) of every checkpoint committed once (its ``.metadata`` is there) but
        incomplete now (a data file truncated or missing), in every node's slots (its leader looks) and in the durable
        root (rank 0 looks), on every rank alike (one all-gather). A restart raises over them rather than start from
        scratch, as ``cpuckpt.load_latest`` does. Only DCP checkpoints tell: another format's slot is complete or
        not."""
        if not isinstance(self.format, DcpSlots):
            return []
        def look() -> list[tuple[str, str, int | None]]:
            found: list[tuple[str, str, int | None]] = []
            if self.nodes.is_leader:
                found += [(str(slot), status.reason, status.step) for slot in self.slots
                          if (status := check_complete(slot)).committed and not status.complete]
            if self.rank == 0:
                found += [(str(c.path), c.reason, c.step) for c in list_checkpoints(self.durable_root)
                          if not c.complete and committed_once(c)]
            return found

        every = from_every_rank(look, self.group,
                                f"looking for damaged checkpoints of {self.durable_root} and the memory tier")
        return [item for items in every for item in items]

    def load(self, state_dict: dict[str, Any], path: str | os.PathLike, *, planner: Any = None) -> None:
        """``cpuckpt.load`` of ``path``; a memory checkpoint this process saved is copied straight from its
        mapped (pinned) images, with no file read. Collective, like ``cpuckpt.load``.

        A path :meth:`candidates` (or :meth:`find_latest`) listed as restorable from another node's replica
        is restored first (collective; :class:`IntegrityError` on every rank when it fails). Every other
        planned restore is dropped: a plan holds only until another checkpoint is loaded or its slot saved.
        Read statistics of every load: :attr:`loads`.
        """
        where = checkpoint_path(path)
        path = where if isinstance(where, S3Url) else Path(where)  # s3://: a durable checkpoint in object storage
        if isinstance(path, S3Url):
            self._pending = {}  # no restore targets object storage; every plan is dropped, as below
        else:
            self.restore_planned(path)
        images = {}
        for d, image_set in zip(self.slots, self.images):
            if d == path:
                images = {n: img for n in image_set.names if (img := image_set.get(n)) is not None}
        reader = StorageReader(path, self.config, mapped=images)
        try:
            load(state_dict, path, self.config, process_group=self.process_group, planner=planner,
                 storage_reader=reader)
        finally:
            self.loads.append((path, reader.last_stats))

    def listed(self, path: str | os.PathLike) -> Committed | None:
        """The checkpoint :meth:`candidates` listed at ``path``: the one its slot holds or, when a restore from
        another node's copy is planned into it, the one that restore brings (None: neither)."""
        restores = self._pending.get(Path(path))
        if restores:
            return Committed(restores[0].source.step, restores[0].source.save_id)
        return self.format.committed(Path(path))

    def restore_planned(self, path: str | os.PathLike, *, keep_plans: bool = False) -> None:
        """Collective, before ``path`` is loaded: run the restore :meth:`candidates` planned for it (a lost node's
        slot sent back from another node's copy; :class:`IntegrityError` on every rank when it fails) and drop every
        other plan (``keep_plans``: keep them, for a fallback to an older candidate when this one fails; call it
        again without, for the path loaded, to drop them). :meth:`load` calls it; an adapter that loads with its
        own reader (DeepSpeed, Megatron) calls it first."""
        path = Path(path)
        restores = self._pending.pop(path, None)
        if not keep_plans:
            self._pending = {}
        if restores is not None:
            self._restore(path, restores)

    def _restore(self, path: Path, restores: list[Restore]) -> None:
        """Collective: copy the checkpoint a lost node's ``path`` should hold from another node's copy."""
        if self._replication is None:
            raise IntegrityError(f"rank {self.rank}: {path} needs a restore from a replica, but replication is off")
        self._replication.restore(restores, self.group)

    def step_of(self, path: str | os.PathLike) -> int | None:
        """The step recorded in the manifest of checkpoint ``path`` (memory or durable), or None (none recorded).
        For a path planned for a restore, read it after :meth:`load`: before, the slot holds what it held."""
        where = checkpoint_path(path)
        if isinstance(where, S3Url):
            return inspect_checkpoint(where).step
        manifest = read_manifest(Path(where))
        return manifest.step if manifest is not None else None

    # -- shutdown -------------------------------------------------------------------------------
    def install_sigterm_handler(self, grace_s: float | None = None) -> Any:
        """On SIGTERM: wait for in-flight saves, make the newest memory checkpoint durable, then chain on.

        Within ``grace_s`` (default ``checkpoint.sigterm_grace_s``): in-flight saves commit, then this
        rank asks its writer to persist the newest memory checkpoint unless that step was already
        requested (a multiple of ``memory.persist_every``: then it waits for that), and waits for its
        writer to owe nothing. No collective runs in the handler; the coordinator's writer commits once
        every rank's part arrived (ranks that never got SIGTERM never send theirs: bounded by
        ``timeout_s``). Then the previous handler runs (see :func:`cpuckpt.install_sigterm_handler`).
        Call from the main thread. Returns the previous handler.
        """
        return install_sigterm_handler(grace_s, self.config, then=self._persist_newest_before)

    def _persist_newest_before(self, deadline: float) -> None:
        last = self._last
        if last is not None and not last.requested and self._holds(last):
            logger.warning("SIGTERM: persisting step %s from memory to %s", last.step, last.request.dest)
            self._put(dataclasses.replace(last.request, seq=self.queue.next_seq()))
        self.wait_persisted(max(0.001, deadline - time.monotonic()))

    def close(self, *, persist_newest: bool = True, remove_root: bool = True) -> None:
        """Normal exit: the newest memory checkpoint is made durable, the writer stops, the RAM root goes.

        Collective: each node's leader removes its node's root after every rank is done. Every wait is
        agreed across ranks in short slices, so one rank's failure ends every rank's wait at once (the
        coordinator's writer would otherwise wait ``timeout_s`` for a part that never comes), and every rank
        raises the same class.

        Raises:
            PersistError: a persist failed on some rank (the RAM root is then kept).
            WriterDiedError: some rank's writer died owing persists.
            CheckpointTimeoutError: persists still owed after ``timeout_s`` on some rank.
            CpuckptError: an in-flight save failed (the same error on every rank).
        """
        errors: list[CpuckptError] = []  # this rank's; every decision below is agreed first
        try:
            self.saves.wait_all()
        except CpuckptError as e:
            errors.append(e)
        self._wait_owed_agreed(errors)
        last = self._last
        due = (persist_newest and last is not None and last.step is not None and self._holds(last)
               and not self._persisted_save(last))
        # also: all owed persists done, every rank sees one durable root; the newest is persisted only where every
        # rank can send its part (else the coordinator's writer would wait timeout_s for the missing one)
        bad, any_not_due = self._agree([int(bool(errors)), int(not due)])
        if due and any_not_due and not bad:
            logger.warning("cpuckpt memory tier: rank %d: step %s is not persisted at close: another rank's slot no "
                           "longer holds it, or that rank finds it durable already (see its log)", self.rank,
                           last.step if last is not None else None)
        if not bad and not any_not_due and last is not None:
            # the writer may start only now (persist_every 0): its start is agreed before any request
            started = self._try_start_writer()
            (start_failed,) = self._agree([int(started is not None)])
            if start_failed:  # no rank asks: the coordinator's writer would wait timeout_s for the missing part
                errors.append(started or WriterDiedError(
                    f"rank {self.rank}: another rank's writer could not start to persist the newest memory "
                    f"checkpoint (see its log); it stays in {self.root.path}"))
            else:
                self._put(dataclasses.replace(last.request, seq=self.queue.next_seq()))
            self._wait_owed_agreed(errors)  # collective: every rank waits, requested or not
        self._stop_writer()
        with self._prepare_lock:  # from here on no preparation starts
            self._closing.set()
            prepared = self._prepared
        if prepared is not None:  # it stops after the image in hand: nothing maps or pins past this point
            deadline = time.monotonic() + self.config.timeout_s
            while prepared.is_alive() and time.monotonic() < deadline:
                prepared.join(0.1)
            if prepared.is_alive():
                logger.warning("cpuckpt memory tier: rank %d: the slots' preparation did not stop within %s s",
                               self.rank, self.config.timeout_s)
        try:  # its saves were waited for above: this ends its committer and frees its caches and buffers
            self.saves.close()
        except CpuckptError as e:
            errors.append(e)
        if self.copier is not None:
            self.copier.close()  # its saves were waited for above
        atexit.unregister(self._drop_unclaimed_images)
        for images in self.images:
            images.close()
        self.root.close()
        # One error class on every rank (also: every rank has let go of the root): the gravest any rank has.
        mine = max((_gravity(e) for e in errors), default=0)
        (agreed,) = self._agree([mine])
        if agreed:  # the RAM root stays: it may hold the only copy of the newest checkpoint
            own = next((e for e in errors if _gravity(e) == agreed), None)
            if own is not None:
                raise own
            cls = _GRAVEST[agreed - 1]
            raise cls(f"rank {self.rank}: another rank's {_WHAT[cls]} (see its log); the memory checkpoints stay "
                      f"in {self.root.path}")
        if remove_root and self.nodes.is_leader:
            try:
                self.root.remove()
            except CpuckptError as e:  # e.g. a forked child still holds a lock: leave it to `cpuckpt clean --ram`
                logger.warning("cpuckpt memory tier: RAM root %s left in place (%s); `cpuckpt clean --ram` removes "
                               "it once nothing holds it", self.root.path, e)

    def _wait_owed_agreed(self, errors: list[CpuckptError]) -> None:
        """Collective: wait until no rank's writer owes anything, or until some rank has failed: its persist
        failed, its writer died owing, or ``timeout_s`` passed. Agreed every 50 ms (one all-reduce), so that
        every rank stops together; on a failure each rank withdraws what it still owes (a save with a failed
        part is never committed) so its writer stops waiting too, and appends its own errors to ``errors``."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            # Seen even where the adapter reports outcomes itself (report_persist_failures false: Megatron's
            # finalize): a failed part must stop every rank's wait, or the coordinator's writer waits for it.
            failed = self._new_persist_failures()
            owed = bool(self.queue.owed())
            dead = owed and not self._writer_running()
            expired = owed and time.monotonic() > deadline
            any_owed, any_failed, any_dead, any_expired = self._agree(
                [int(owed), int(bool(failed)), int(dead), int(expired)])
            if failed and self.report_persist_failures:
                errors.append(PersistError(f"rank {self.rank}: " + "; ".join(failed)))
            if dead:
                errors.append(WriterDiedError(f"rank {self.rank}: the writer process died owing persists (see "
                                              f"{self.root.path}/writer-{self.rank}.log)"))
            if expired:
                errors.append(CheckpointTimeoutError(f"rank {self.rank}: persists still owed after "
                                                     f"{self.config.timeout_s} s"))
            if any_failed or any_dead or any_expired:
                why = ("a persist failed" if any_failed else "a writer died owing" if any_dead else
                       "persists owed past the timeout")
                for req in self.queue.owed():
                    self.queue.cancel(req.seq, f"close(): {why} on some rank")
                return
            if not any_owed:
                return
            time.sleep(0.05)

    def _stop_writer(self) -> None:
        """Ask this rank's writer (started here or adopted) to exit once it owes nothing, and wait for it."""
        self.queue.request_stop()
        if self._writer is not None:
            try:
                self._writer.wait(timeout=self.config.timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("cpuckpt memory tier: rank %d's writer did not exit; left running", self.rank)
        elif not self.root.wait_writer_gone(self.rank, self.config.timeout_s):
            logger.warning("cpuckpt memory tier: rank %d's adopted writer did not exit; left running", self.rank)


@dataclass(frozen=True)
class _LastSave:
    """The newest memory save of this rank: its step, slot, the request that persists it (reused with a new
    sequence number by ``close()`` and SIGTERM) and whether that request was already made."""

    step: int | None
    slot: Path
    request: PersistRequest
    requested: bool


_GRAVEST: tuple[type[CpuckptError], ...] = (CpuckptError, CheckpointTimeoutError, WriterDiedError, PersistError)
_WHAT = {CpuckptError: "in-flight save failed", CheckpointTimeoutError: "persists were still owed after the timeout",
         WriterDiedError: "writer process died owing persists", PersistError: "persist to the durable root failed"}


def _gravity(error: CpuckptError) -> int:
    """1-based index in :data:`_GRAVEST` of the most specific class ``error`` is: ranks agree on the maximum."""
    return max(i + 1 for i, cls in enumerate(_GRAVEST) if isinstance(error, cls))


def _sized_as(slot: Path, sizes: dict[str, int]) -> bool:
    """Every file of ``sizes`` exists in ``slot`` with exactly that size (preparing it resizes nothing)."""
    try:
        return all((slot / name).stat().st_size == nbytes for name, nbytes in sizes.items())
    except OSError:
        return False
