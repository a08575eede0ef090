"""DeepSpeed checkpoints through cpuckpt's memory tier (``memory_tier: true``). Routing and naming only.

Each ``save_checkpoint(save_dir, tag)`` becomes a memory checkpoint of a :class:`cpuckpt.MemoryTier` of the
job whose durable root is ``save_dir`` (the RAM root and ``memory.*`` keys as for every memory tier):

- the tag's files, under DeepSpeed's names, go into a ring slot of the RAM root (``slot-<k>``), straight into
  the slot's reused, mapped (with CUDA, pinned) images; once every rank's files are in, rank 0 (across nodes:
  each node's leader) commits the slot in memory with the tag's completion marker (:mod:`.marker`; it carries the
  tier's save id) and links ``<RAM root>/tags/<tag>`` to it (and writes ``tags/latest``), so stock DeepSpeed
  loads a memory tag too: ``engine.load_checkpoint("<RAM root>/tags", tag=tag)``;
- every ``memory.persist_every``-th checkpoint by global step (1: all, 0: none) is also persisted by each
  rank's writer process (:func:`cpuckpt.tier.persister.persist_files`) into ``save_dir/<tag>``: this rank's
  files, then (rank 0's writer, once every rank's files are durable) the marker, then ``save_dir/latest``,
  never moved back to an older step. That tag directory is exactly what the engine writes without the tier,
  so stock DeepSpeed, ``zero_to_fp32`` and ``ds_to_universal`` read it without cpuckpt.

Restart: :meth:`DeepSpeedMemory.candidates` lists the complete tags of both tiers newest first (by global
step, memory first on a tie: :meth:`cpuckpt.MemoryTier.candidates` over :class:`TagSlots`); the adapter's
``load_latest`` loads the newest that verifies. While the engine's :class:`TagListings` are held, one listing of
``save_dir`` serves the restart's every use of it (the start of a tier it makes, the durable candidates, a tag stock
DeepSpeed wrote, the damaged tags).

Across nodes (ranks on several RAM roots: :mod:`cpuckpt.tier.nodes`) each node's slot holds its own ranks' files
and, with ZeRO-1/2, the node's own copy of the model-states files every rank reads (the engine makes each node's
leader write them too: the values are the same on every data-parallel rank). Each node's leader commits its slot:
its node listing (:mod:`cpuckpt.tier.nodefiles`: the files the slot holds, by the rank that wrote them), then the
marker, which lists every rank's files (the lowest rank's entry of a file several nodes hold: the one persisted),
then the names in its own RAM root. Each rank persists only the files it owns. With ``memory.replicas`` the
leader's writer sends the slot to the partner nodes, and a restart that lost a node's RAM root restores its slot
from a partner's copy before the load (:meth:`DeepSpeedMemory.before_load`), reading nothing from ``save_dir``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpuckpt.backend.collectives import from_every_rank, from_rank
from cpuckpt.config import Config
from cpuckpt.errors import IntegrityError
from cpuckpt.format.layout import FileLayout
from cpuckpt.format.manifest import FileEntry
from cpuckpt.tier.formats import Committed, Durable
from cpuckpt.tier.memory import MemoryTier
from cpuckpt.tier.nodefiles import NODE_FILES_NAME, NodeFiles, write_node_files
from cpuckpt.tier.queue import PersistRequest
from cpuckpt.tier.tagmarker import (
    MARKER_NAME,
    SAVING_NAME,
    LatestTag,
    TagFile,
    TagMarker,
    TagStatus,
    check_dir,
    check_tag,
    new_marker,
    node_listing,
    read_marker,
    scan_tags,
    write_marker,
)
from cpuckpt.transfer.files import write_atomic
from cpuckpt.transfer.sinks import Sink

__all__ = ["LINKS_NAME", "Claim", "DeepSpeedMemory", "TagListings", "TagSlots"]

logger = logging.getLogger(__name__)

LINKS_NAME = "tags"  # <RAM root>/tags/<tag> -> slot-<k>: a load_dir stock DeepSpeed reads memory tags from


class TagListings:
    """The listings of ``save_dir`` one engine's restart shares (:meth:`held`), so that its looks (the start of a tier
    it makes, the durable candidates, a tag stock DeepSpeed wrote, the damaged tags) read one listing of a directory a
    writer of the previous trainer may be committing into. Per thread: another (a background commit) lists anew."""

    def __init__(self) -> None:
        self._local = threading.local()  # .tags: the listings made while held, by root

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Within, this thread lists each root once, at its first use; every later use reads that listing. Nested,
        the outer listings serve."""
        outer = getattr(self._local, "tags", None)
        self._local.tags = outer if outer is not None else {}
        try:
            yield
        finally:
            self._local.tags = outer

    def scan(self, root: Path) -> tuple[list[LatestTag], list[TagStatus]]:
        """:func:`scan_tags` of ``root``; while :meth:`held`, the one made at its first use."""
        tags: dict[Path, tuple[list[LatestTag], list[TagStatus]]] | None = getattr(self._local, "tags", None)
        if tags is None:
            return scan_tags(root)
        if root not in tags:
            tags[root] = scan_tags(root)
        return tags[root]


class TagSlots:
    """The memory tier's :class:`~cpuckpt.tier.formats.SlotFormat` for DeepSpeed tags: a slot holds one tag's
    files and its marker; the durable root is DeepSpeed's ``save_dir`` (listed through ``listings``)."""

    def __init__(self, listings: TagListings | None = None) -> None:
        self.listings = listings if listings is not None else TagListings()

    def committed(self, directory: Path) -> Committed | None:
        status = check_dir(directory)
        marker = status.marker
        if not status.complete or marker is None or not marker.save_id:
            return None
        return Committed(marker.global_step, marker.save_id, marker.created_unix)  # rank 0's clock, in every copy

    def durable(self, root: Path) -> list[Durable]:
        # damaged tags are not logged here: load_latest names them (it must not skip them as torn); a tag stock
        # DeepSpeed wrote (no step recorded) is the adapter's to rank (DeepSpeedMemory.candidates)
        return [Durable(t.global_step, t.directory / t.tag, t.global_step) for t in self.listings.scan(root)[0]
                if t.global_step is not None]


@dataclass(frozen=True)
class Claim:
    """The slot one DeepSpeed checkpoint is written into, and its save id (the same on every rank)."""

    slot: Path
    save_id: str


class DeepSpeedMemory:
    """The memory tier of one DeepSpeed engine's checkpoints in ``save_dir``. Collective: every rank makes one.

    Args:
        save_dir: DeepSpeed's ``save_dir`` (the durable root).
        config: the core config (its ``memory`` section configures the tier).
        listings: the engine's listings of ``save_dir`` (a restart holds them: :class:`TagListings`).

    Every node's leader (its lowest rank) names its node's slots (``<RAM root>/tags``).
    """

    def __init__(self, save_dir: str | os.PathLike, config: Config, listings: TagListings | None = None) -> None:
        self.save_dir = Path(os.path.abspath(save_dir))
        self.listings = listings if listings is not None else TagListings()
        self.tier = MemoryTier(self.save_dir, config, slot_format=TagSlots(self.listings))
        self.links = self.tier.root.path / LINKS_NAME
        self._memory_slots: dict[str, Path] = {}  # save id -> this rank's slot, of the agreed memory candidates
        try:
            self._on_leaders(self._relink, f"naming the memory tags of {self.links}")
        except BaseException:
            # No one else holds the tier: its copy process, writer, threads and mapped images would outlive the
            # failure, and its trainer lock would refuse the next attempt (after a failure warned about at initialize,
            # load_latest or the first save makes the tier again). Let go of without a collective (an interrupt may
            # reach one rank only), the RAM root kept: it may hold the only copy of the checkpoint a restart loads.
            self.tier.abandon()
            raise

    @property
    def names(self) -> bool:
        """Whether this rank commits and names its node's slots (the node's leader; rank 0 on one node)."""
        return self.tier.nodes.is_leader

    @property
    def across_nodes(self) -> bool:
        return not self.tier.nodes.single

    # -- saving ---------------------------------------------------------------------------------
    def claim(self) -> Claim | None:
        """Collective: the slot of the next checkpoint (None: ``memory.when_full: disk`` and every slot held,
        so it goes to ``save_dir`` as without the tier). Raises a failed persist, a dead writer, a timeout."""
        got = self.tier.claim_slot()
        if got is None:
            return None
        self._unname(got[0])  # before this rank's first byte into it: no name leads a stock load to torn files
        (got[0] / NODE_FILES_NAME).unlink(missing_ok=True)  # nor a listing a node's slot counted complete by
        return Claim(*got)

    def node_listing(self, claim: Claim, world_size: int, gathered: list[dict[str, TagFile]],
                     step: int | None) -> NodeFiles | None:
        """Across nodes, the listing of what this node's slot holds: the files its ranks wrote (``gathered``: every
        rank's files, by rank), each by the lowest rank of the node that wrote it. None on one node."""
        if not self.across_nodes:
            return None
        files: dict[str, FileEntry] = {}
        writers: dict[str, int] = {}
        for rank in self.tier.nodes.node_ranks:
            for name, f in sorted(gathered[rank].items()):
                if name not in files:
                    files[name] = FileEntry(name=name, nbytes=f.nbytes, chunk_bytes=f.chunk_bytes,
                                            checksum=f.checksum, chunk_checksums=list(f.chunk_checksums))
                    writers[name] = rank
        return NodeFiles(save_id=claim.save_id, step=step, marker=MARKER_NAME, world_size=world_size,
                         ranks=tuple(self.tier.nodes.node_ranks), files=files, writers=writers)

    def sink(self, claim: Claim, name: str, files: list[FileLayout], cfg: Config, rank: int) -> Sink:
        """The save engine's sink for file ``name`` of a checkpoint: straight into the slot's reused image."""
        images = self.tier.images[self.tier.slots.index(claim.slot)]
        return images(claim.slot, [name], files, cfg, rank=rank)

    def commit(self, claim: Claim, tag: str, world_size: int, files: dict[str, TagFile], step: int | None,
               listing: NodeFiles | None = None) -> None:
        """Each node's leader (:attr:`names`), once every rank's files are in the slot: across nodes the node's
        listing, then the marker (the memory commit), then the names."""
        if listing is not None:
            write_node_files(claim.slot, listing)
        write_marker(claim.slot, new_marker(tag, world_size, files, step, save_id=claim.save_id), fsync=False)
        self._link(tag, claim.slot)
        write_atomic(self.links / "latest", tag.encode(), fsync=False)

    def withdraw(self, claim: Claim, tag: str) -> None:
        """Each node's leader, when the commit failed on some rank after this rank committed the slot: the marker
        and the names go again, so the failed checkpoint is never a restart's candidate. Best effort (logged)."""
        try:
            (claim.slot / MARKER_NAME).unlink(missing_ok=True)
            (claim.slot / NODE_FILES_NAME).unlink(missing_ok=True)
            self._unname(claim.slot)
            latest = self.links / "latest"
            if latest.exists() and latest.read_text().strip() == tag:
                latest.unlink(missing_ok=True)
        except OSError as e:
            logger.warning("cpuckpt memory tier: the failed checkpoint %s in %s could not be withdrawn: %s", tag,
                           claim.slot, e)

    def persist(self, claim: Claim, tag: str, step: int | None, entries: dict[str, FileEntry],
                save_latest: bool) -> PersistRequest | None:
        """Every rank, after the memory commit: the ring moves on and this rank's files (``entries``: those it owns,
        not a node's copy of another rank's) are queued for its writer when the step is due
        (``memory.persist_every``); rank 0's writer commits ``save_dir/<tag>`` and moves ``save_dir/latest``
        (``save_latest``). Returns the request, or None (not persisted); across nodes a leader's replica request
        is ``tier.last_replica``."""
        return self.tier.commit_files(claim.slot, claim.save_id, step, self.save_dir / tag, files=entries,
                                      marker=MARKER_NAME, saving=SAVING_NAME,
                                      pointer=(self.save_dir / "latest", tag) if save_latest else None)

    # -- restart --------------------------------------------------------------------------------
    def damaged_tags(self) -> list[TagStatus]:
        """The tags of ``save_dir`` committed once but incomplete now (:func:`scan_tags`; while the listings are
        held, theirs). Reads only."""
        return list(self.listings.scan(self.save_dir)[1])

    def candidates(self) -> list[LatestTag]:
        """Complete tags of both tiers, newest global step first, memory first on a tie. Reads only."""
        out = []
        for path in self.tier.candidates():
            if path in self.tier.slots:
                marker = read_marker(path)
                if marker is not None and not self._partial(path, marker, log=True):
                    out.append(LatestTag(self.links, marker.tag, marker.global_step, marker))
                continue
            status = check_tag(path.parent, path.name)
            if status.complete and status.marker is not None:
                out.append(LatestTag(path.parent, path.name, status.marker.global_step, status.marker))
        # A tag stock DeepSpeed wrote (``latest`` names it, no marker) has no step to rank it by without loading it:
        # the one candidate when there is none of ours, else named in a warning (a run moved onto the tier)
        stock = [t for t in self.listings.scan(self.save_dir)[0] if t.marker is None]
        if stock and not out:
            out.append(stock[0])
        elif stock:
            logger.warning("cpuckpt: %s names %s, a tag stock DeepSpeed wrote (no step recorded to rank it by); the "
                           "newest of the memory tier's tags is loaded instead: load %s with engine.load_checkpoint to "
                           "resume from it", self.save_dir / "latest", stock[0].tag, stock[0].tag)
        return out

    def _partial(self, slot: Path, marker: TagMarker, *, log: bool = False) -> bool:
        """Whether ``slot`` was saved across nodes by another topology: its node listing lacks files this node's
        ranks read now (a relaunch on fewer nodes, other ranks per node, another world size). Such a slot is
        ignored (never an error mid-load): the restart reshards from ``save_dir`` or takes another memory tag."""
        listing = node_listing(slot, marker)
        here = set(self.tier.nodes.node_ranks)
        partial = listing is not None and (listing.world_size != self.tier.world_size or not here <= set(listing.ranks))
        if partial and log:
            logger.warning("cpuckpt memory tier: %s (tag %s) was saved across nodes and holds the files of ranks %s of "
                           "%d; this node's ranks are %s of %d: ignored (the topology changed)", slot, marker.tag,
                           list(listing.ranks), listing.world_size, sorted(here), self.tier.world_size)
        return partial

    def agreed_candidates(self) -> list[LatestTag]:
        """Collective: :meth:`candidates` as every rank loads them, the same tags in the same order on every rank.

        Rank 0's list decides (a writer of the previous trainer may be committing a durable tag meanwhile, so the
        ranks' own listings of ``save_dir`` may differ); across nodes every rank lists (the tier's restart agreement
        is collective) and a memory tag is loaded from the rank's own node's names (``<RAM root>/tags``), its slot
        restored first when a partner's copy brings it back (:meth:`before_load`).
        """
        group = self.tier.group
        if not self.across_nodes:
            return from_rank(self.candidates, group, f"listing the DeepSpeed tags of {self.save_dir} and its memory "
                                                      "tier")
        paths = self.tier.own_candidates()  # collective: memory checkpoints every node holds or gets back from a copy
        self._memory_slots = {}

        def listing() -> tuple[list[tuple[str, Any]] | None, dict[str, tuple[str, int | None]]]:
            mine: list[tuple[str, Any]] = []
            tags: dict[str, tuple[str, int | None]] = {}  # save id -> (tag, step) of the slots this rank can read
            for path in paths:
                if path in self.tier.slots:
                    held = self.tier.listed(path)
                    if held is None:
                        continue
                    mine.append(("memory", held.save_id))
                    self._memory_slots[held.save_id] = path
                    marker = read_marker(path) if (path / MARKER_NAME).exists() else None
                    if marker is not None and marker.save_id == held.save_id:
                        tags[held.save_id] = (marker.tag, marker.global_step)
                    continue
                status = check_tag(path.parent, path.name)
                if status.complete and status.marker is not None:
                    mine.append(("durable", LatestTag(path.parent, path.name, status.marker.global_step,
                                                      status.marker)))
            return (mine if self.tier.rank == 0 else None, tags)

        every = from_every_rank(listing, group, f"listing the DeepSpeed tags of {self.save_dir} and its memory tier")
        known = {sid: t for _, theirs in every for sid, t in theirs.items()}
        out: list[LatestTag] = []
        for kind, what in every[0][0]:
            if kind == "durable":
                out.append(what)
            elif what in known and what in self._memory_slots:  # agreed: the same on every rank
                tag, step = known[what]
                out.append(LatestTag(self.links, tag, step, TagMarker(tag, self.tier.world_size, {}, step,
                                                                        save_id=what)))
        return out

    def agreed_damaged_slots(self) -> list[TagStatus]:
        """Collective: the slots committed once but incomplete now (a file cut short, the marker garbled), every
        node's leader's look, on every rank alike: a restart names them, never takes them for torn saves."""
        def look() -> list[TagStatus]:
            if not self.tier.nodes.is_leader:
                return []
            return [s for s in map(check_dir, self.tier.slots) if s.committed and not s.complete]

        every = from_every_rank(look, self.tier.group,
                                f"looking for damaged memory tags of {self.save_dir}")
        return [s for theirs in every for s in theirs]

    def slot_of(self, found: LatestTag) -> Path | None:
        """The slot a memory candidate names (None: a durable tag)."""
        if found.directory != self.links or found.marker is None:
            return None
        planned = self._memory_slots.get(found.marker.save_id)
        if planned is not None:
            return planned
        for slot in self.tier.slots:
            try:
                marker = read_marker(slot) if (slot / MARKER_NAME).exists() else None
            except IntegrityError:  # another slot's marker, damaged since: not the slot of this tag
                continue
            if marker is not None and marker.save_id == found.marker.save_id:
                return slot
        return None

    def before_load(self, found: LatestTag) -> None:
        """Collective, before ``load_checkpoint`` of ``found``: across nodes a lost node's slot is restored from a
        partner's copy first (:meth:`cpuckpt.MemoryTier.restore_planned`); a memory tag's name exists (each node's
        leader makes it in its RAM root)."""
        slot = self.slot_of(found)
        # plans kept: when this restore fails (IntegrityError, every rank) an older candidate may need its own
        self.tier.restore_planned(slot if slot is not None else found.directory / found.tag, keep_plans=True)
        self._on_leaders(lambda: self._link(found.tag, slot) if slot is not None else None,
                         f"naming memory tag {found.tag} in {self.links}")

    def loaded(self, found: LatestTag) -> None:
        """``found`` was loaded: the ring's next save must not overwrite it (every rank)."""
        slot = self.slot_of(found)
        path = slot if slot is not None else found.directory / found.tag
        self.tier.restore_planned(path)  # done: the plans of the other candidates go
        self.tier.resume_after(path)

    def close(self) -> None:
        """Collective: the newest memory checkpoint made durable (unless it is), writers stopped, RAM root removed
        (with the tags' names)."""
        self.tier.close()

    # -- the names of memory tags (each node's leader) --------------------------------------------------------
    def _link(self, tag: str, slot: Path) -> None:  # this node's leader
        """``tags/<tag>`` -> ``slot``, replacing any other name of ``slot`` (it holds one tag)."""
        self.links.mkdir(mode=0o700, exist_ok=True)
        real = Path(os.path.realpath(slot))
        for link in self.links.iterdir():
            if link.name != tag and _names(link, real):
                link.unlink(missing_ok=True)
        tmp = self.links / f".{tag}.tmp-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(slot, tmp, target_is_directory=True)
        os.replace(tmp, self.links / tag)

    def _unname(self, slot: Path) -> None:
        """Every rank, once ``slot`` is claimed: remove the names of the tag it held (``tags/<tag>``). Each rank
        does it before its own first byte, so no byte lands while a name still leads to the slot; the removals
        of the same names by several ranks of the node are idempotent."""
        if not self.links.is_dir():
            return
        real = Path(os.path.realpath(slot))
        for link in self.links.iterdir():
            if _names(link, real):
                link.unlink(missing_ok=True)

    def _relink(self) -> None:
        """At start: a name for every complete slot, none for anything else (a slot refilled since, a crash
        between a marker and its name); ``tags/latest`` names the newest."""
        self.links.mkdir(mode=0o700, exist_ok=True)
        held = {}
        for slot in self.tier.slots:
            status = check_dir(slot)
            if status.complete and status.marker is not None and not self._partial(slot, status.marker):
                held[status.marker.tag] = (status.marker.global_step if status.marker.global_step is not None else -1,
                                           slot)
        for link in self.links.iterdir():
            if link.is_symlink() and (link.name not in held or
                                      not _names(link, Path(os.path.realpath(held[link.name][1])))):
                link.unlink(missing_ok=True)
        for tag, (_, slot) in held.items():
            self._link(tag, slot)
        if held:
            write_atomic(self.links / "latest", max(held, key=lambda t: held[t][0]).encode(), fsync=False)
        else:
            (self.links / "latest").unlink(missing_ok=True)

    def _on_leaders(self, fn: Any, what: str) -> None:
        """Collective: ``fn`` on each node's leader, every rank waiting for all of them, a failure raised alike."""
        from_every_rank(lambda: fn() if self.names else None, self.tier.group, what)


def _names(link: Path, real: Path) -> bool:
    """Whether ``link`` is a name of ``real``. False once gone: another rank of the node may remove the same name at
    once (``_unname``), and ``realpath`` reads a link after its ``lstat``, raising FileNotFoundError in between."""
    try:
        return link.is_symlink() and Path(os.path.realpath(link)) == real
    except FileNotFoundError:
        return False
