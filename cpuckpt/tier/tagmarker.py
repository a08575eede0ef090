"""Completion markers of DeepSpeed tag directories, and finding the newest complete tag. No collectives.

DeepSpeed itself tells a complete tag from a torn one only by ``<save_dir>/latest``. cpuckpt's engine
adds two hidden files to each tag directory it writes (stock DeepSpeed, ``zero_to_fp32`` and
``ds_to_universal`` look files up by their DeepSpeed names and never open these):

- ``.cpuckpt-saving``: created (and the directory fsynced) by every rank before it writes its first
  byte into the tag, right after removing the marker: a tag being (re)written is never taken for
  complete, and is told apart from a tag written by stock DeepSpeed (which has neither file); empty, but a
  memory tier's writer persisting a tag into ``save_dir`` writes its save id in it;
- ``.cpuckpt-complete.json`` (the *marker*): written by rank 0 once every rank's files are durable,
  via tmp + fsync + rename + directory fsync, before ``latest`` moves. It lists every file (path
  relative to the tag directory, the rank that wrote it, its size, per-chunk checksums (crc32c when
  ``integrity.checksum`` is crc32c; a memory slot's may be blocksum32)), the world size, the tag and the global
  step.

A tag is *complete* when its marker parses and every listed file has its listed size (in a memory slot across
nodes: every file of its node listing, :mod:`cpuckpt.tier.nodefiles`, of the marker's save); *torn* when it
has the saving file or a marker that does not match the files; *unmarked* when it has neither (stock
DeepSpeed wrote it: nothing to check). ``verify`` also compares every chunk's checksum.

:func:`clean_torn_tags` (``cpuckpt clean --deepspeed-tags``) removes a torn tag only where a tag committed after it
proves that its save is over: an engine commits its tags in the order it creates them (one engine per save_dir).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from cpuckpt.backend.committed import size_mismatches
from cpuckpt.errors import CheckpointCorrupt, IntegrityError
from cpuckpt.format.checksums import KINDS, chunk_checksum, verifiable
from cpuckpt.format.manifest import FileEntry
from cpuckpt.paths import local_path
from cpuckpt.procs import host_tag, pid_alive, pid_ns_tag
from cpuckpt.rootinfo import REMOVING_PREFIX
from cpuckpt.runfiles import boot_tag
from cpuckpt.tier.formats import PART_PREFIX, read_pointer
from cpuckpt.tier.nodefiles import NodeFiles, read_node_files
from cpuckpt.transfer.files import fsync_dir, write_atomic
from cpuckpt.version import __version__

__all__ = [
    "MARKER_NAME",
    "SAVING_NAME",
    "EmptyMarker",
    "LatestTag",
    "NewerMarker",
    "TagFile",
    "TagMarker",
    "TagStatus",
    "check_dir",
    "check_tag",
    "clean_torn_tags",
    "complete_tags",
    "find_latest",
    "held_files",
    "read_marker",
    "refusal",
    "require_complete",
    "scan_tags",
]

logger = logging.getLogger(__name__)

MARKER_NAME = ".cpuckpt-complete.json"
SAVING_NAME = ".cpuckpt-saving"
KEPT_NAME = ".cpuckpt-kept"  # in a tag ``cpuckpt clean`` moved aside and could not put back: never deleted by it
FORMAT = "cpuckpt-deepspeed-tag"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TagFile:
    """One file of a tag: who wrote it, its size and its per-chunk checksums of kind ``checksum`` (empty: not
    recorded)."""

    rank: int
    nbytes: int
    chunk_bytes: int
    checksum: str = "none"
    chunk_checksums: tuple[int, ...] = ()

    @classmethod
    def of(cls, entry: FileEntry, rank: int) -> TagFile:
        crcs = tuple(entry.chunk_checksums) if entry.checksum in KINDS else ()
        return cls(rank=rank, nbytes=entry.nbytes, chunk_bytes=entry.chunk_bytes,
                   checksum=entry.checksum if crcs else "none", chunk_checksums=crcs)


@dataclass(frozen=True)
class TagMarker:
    """The content of ``.cpuckpt-complete.json``. New fields need defaults (old markers still parse)."""

    tag: str
    world_size: int
    files: dict[str, TagFile]
    global_step: int | None = None
    created_unix: float = 0.0
    cpuckpt_version: str = ""
    save_id: str = ""  # the memory tier's save (a memory slot's marker; kept when the writer persists it)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, where: str) -> TagMarker:
        """Parse a marker; anything malformed is an :class:`IntegrityError` naming ``where`` (:class:`NewerMarker`
        for a newer format)."""
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, not {FORMAT!r}")
            if (version := int(data.get("format_version", 0))) > FORMAT_VERSION:  # an IntegrityError: not caught below
                raise NewerMarker(f"{where}: not a valid cpuckpt DeepSpeed marker (format_version {version} is newer "
                                  f"than this cpuckpt reads ({FORMAT_VERSION}); upgrade cpuckpt)")
            files = {str(k): TagFile(**{**v, "chunk_checksums": tuple(v.get("chunk_checksums", ()))})
                     for k, v in data["files"].items()}
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{**{k: v for k, v in data.items() if k in known}, "files": files})
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            raise IntegrityError(f"{where}: not a valid cpuckpt DeepSpeed marker ({e})") from e


class NewerMarker(IntegrityError):
    """A marker of a newer format than this cpuckpt reads: nothing about its tag is judged here."""


class EmptyMarker(IntegrityError):
    """A marker of no bytes: its rename landed without its data (``io.fsync: false``, a crash), not a commit (as an
    empty ``.metadata`` is none)."""


@dataclass(frozen=True)
class TagStatus:
    """What :func:`check_tag` found. ``state``: complete, torn, unmarked (stock DeepSpeed) or missing."""

    path: Path
    state: str
    marker: TagMarker | None = None
    problems: tuple[str, ...] = ()
    committed: bool = False  # a marker of a format this cpuckpt reads was there (valid or garbled): the commit happened

    @property
    def complete(self) -> bool:
        return self.state == "complete"

    def describe(self) -> str:
        return f"{self.path}: {self.state}" + (f" ({'; '.join(self.problems)})" if self.problems else "")


@dataclass(frozen=True)
class LatestTag:
    """A complete tag to load: ``engine.load_checkpoint(found.directory, tag=found.tag)``."""

    directory: Path
    tag: str
    global_step: int | None
    marker: TagMarker = field(repr=False, compare=False, default=None)  # type: ignore[assignment]


# -- writing (the engine) ----------------------------------------------------------------------------
def open_tag(tag_dir: Path, *, fsync: bool) -> None:
    """Before this rank writes a byte into ``tag_dir``: remove the marker, create the saving file.

    Every rank calls it (no collective): whichever rank writes first has already made the tag
    incomplete. With ``fsync`` the directory is fsynced, so the removal is durable before any byte.
    """
    tag_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (tag_dir / MARKER_NAME).unlink()
    # emptied (a writer's persist names its save in it) and dated now: reopening a torn tag is a change that
    # ``cpuckpt clean`` sees (--min-age, and its check after moving the tag aside)
    fd = os.open(tag_dir / SAVING_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.utime(fd)  # O_TRUNC of an empty file need not date it (POSIX dates a truncation)
    finally:
        os.close(fd)
    if fsync:
        fsync_dir(tag_dir)


def write_marker(tag_dir: Path, marker: TagMarker, *, fsync: bool) -> None:
    """Rank 0, after every rank's files are durable: the marker (atomically), then drop the saving file."""
    write_atomic(tag_dir / MARKER_NAME, marker.to_json().encode(), fsync=fsync)
    with contextlib.suppress(FileNotFoundError):
        (tag_dir / SAVING_NAME).unlink()
    if fsync:
        fsync_dir(tag_dir)


def new_marker(tag: str, world_size: int, files: dict[str, TagFile], global_step: int | None, *,
               save_id: str = "") -> TagMarker:
    return TagMarker(tag=tag, world_size=world_size, files=dict(sorted(files.items())), global_step=global_step,
                     created_unix=time.time(), cpuckpt_version=__version__, save_id=save_id)


# -- reading -----------------------------------------------------------------------------------------
def read_marker(tag_dir: str | os.PathLike) -> TagMarker | None:
    """The tag's marker, or None when it has none.

    Raises:
        IntegrityError: the marker exists but is not a valid marker.
    """
    path = Path(tag_dir) / MARKER_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        raise IntegrityError(f"{path}: not a valid cpuckpt DeepSpeed marker ({e})") from e
    if not text:
        raise EmptyMarker(f"{path}: not a valid cpuckpt DeepSpeed marker (empty)")
    return TagMarker.from_json(text, str(path))


def _crc_problems(tag_dir: Path, name: str, f: TagFile | FileEntry) -> list[str]:
    """Each chunk of ``name`` whose checksum (of ``f``'s kind) is not the recorded one; none for a kind not known
    here ("none")."""
    if not verifiable(f):
        return []
    out = []
    with open(tag_dir / name, "rb", buffering=0) as fh:
        for c, stored in enumerate(f.chunk_checksums):
            lo, hi = c * f.chunk_bytes, min((c + 1) * f.chunk_bytes, f.nbytes)
            data = os.pread(fh.fileno(), hi - lo, lo)
            crc = chunk_checksum(f.checksum, data)
            if len(data) != hi - lo or crc != stored:
                out.append(f"{name}: checksum mismatch in chunk {c} (bytes [{lo}, {hi})): stored {f.checksum} "
                           f"{stored}, read {crc}")
    return out


def node_listing(tag_dir: Path, marker: TagMarker) -> NodeFiles | None:
    """The node listing of a memory slot across nodes (:mod:`cpuckpt.tier.nodefiles`) that belongs to ``marker``'s
    save, or None (a one-node slot, a durable tag, a stale listing of an earlier save)."""
    listing = read_node_files(tag_dir)
    if listing is None or not marker.save_id or listing.save_id != marker.save_id:
        return None
    return listing


def held_files(tag_dir: Path, marker: TagMarker) -> dict[str, TagFile | FileEntry]:
    """The files ``tag_dir`` holds of the tag: every file the marker lists, or, in a node's slot, its listing's."""
    listing = node_listing(tag_dir, marker)
    return dict(marker.files) if listing is None else dict(listing.files)


def verify_files(tag_dir: Path, marker: TagMarker, names: list[str] | None = None) -> list[str]:
    """Compare the chunk checksums of ``names`` (default: every file the directory holds); the mismatches found."""
    held = held_files(tag_dir, marker)
    out: list[str] = []
    for name in sorted(held) if names is None else names:
        out += _crc_problems(tag_dir, name, held[name])
    return out


def check_tag(save_dir: str | os.PathLike, tag: str, *, verify: bool = False) -> TagStatus:
    """Whether ``<save_dir>/<tag>`` is a complete checkpoint. Reads only; never raises for damage.

    Args:
        save_dir: the directory given to ``save_checkpoint``/``load_checkpoint``.
        tag: the tag (its subdirectory).
        verify: also read every listed file and compare its chunks' checksums (files saved with
            ``integrity.checksum: none`` are checked by size only).

    Returns:
        A :class:`TagStatus`: ``complete``, ``torn`` (with the problems found), ``unmarked`` (no
        cpuckpt files: stock DeepSpeed wrote it) or ``missing`` (no such directory).
    """
    return check_dir(Path(save_dir) / tag, tag, verify=verify)


def check_dir(tag_dir: str | os.PathLike, tag: str | None = None, *, verify: bool = False) -> TagStatus:
    """:func:`check_tag` of the directory ``tag_dir``; ``tag`` None accepts whatever tag its marker names (a
    memory tier's slot, which holds a tag's files under the slot's own name)."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return TagStatus(tag_dir, "missing")
    try:
        marker = read_marker(tag_dir)
    except (NewerMarker, EmptyMarker) as e:
        return TagStatus(tag_dir, "torn", None, (str(e),))
    except IntegrityError as e:  # its marker is written last (tmp, then rename): one there, even garbled, committed
        return TagStatus(tag_dir, "torn", None, (str(e),), committed=True)
    # an OSError reading it (EIO, EACCES) is raised: an older tag would not fix it, and a restart must not skip it
    if marker is None:
        if (tag_dir / SAVING_NAME).exists():
            return TagStatus(tag_dir, "torn", None, ("no completion marker: its save never committed",))
        return TagStatus(tag_dir, "unmarked")
    problems = []
    if tag is not None and marker.tag != tag:
        problems.append(f"the marker is of tag {marker.tag!r}")
    # a node's slot across nodes holds its listing's files only (its ranks' and its own copy of the model states)
    entries = [FileEntry(name=n, nbytes=f.nbytes, chunk_bytes=f.chunk_bytes)
               for n, f in held_files(tag_dir, marker).items()]
    sizes = [str(m) for m in size_mismatches(tag_dir, entries)]
    if sizes and not _same_marker(tag_dir, marker):
        # a save of the tag began since its marker was read (the marker goes before its first byte): not damage
        return TagStatus(tag_dir, "torn", None, ("being saved again: its marker changed since it was read",))
    if sizes and not (tag_dir / SAVING_NAME).exists() and _rewritten_after(tag_dir, entries):
        logger.warning("%s: its files were rewritten after its cpuckpt marker (stock DeepSpeed saved this tag again): "
                       "the marker is stale, the tag is treated as stock DeepSpeed's", tag_dir)
        return TagStatus(tag_dir, "unmarked")
    problems += sizes
    if verify and not problems:
        problems += verify_files(tag_dir, marker)
    return TagStatus(tag_dir, "torn" if problems else "complete", marker, tuple(problems), committed=True)


def _same_marker(tag_dir: Path, marker: TagMarker) -> bool:
    """Whether ``tag_dir``'s marker is still ``marker`` (a save of the tag removes it before its first byte; a
    saving file left beside a marker by a crash between the two is no such save)."""
    try:
        return read_marker(tag_dir) == marker
    except (IntegrityError, OSError):
        return False


def _rewritten_after(tag_dir: Path, entries: list[FileEntry]) -> bool:
    """Another writer saved the whole tag again: every listed file (two at least, all there) was modified after the
    marker (which cpuckpt writes last) and none has the size the marker records (stock DeepSpeed's ``torch.save``
    layout is not ours). A copy of ours keeps the sizes, and one interrupted keeps them for the files it finished;
    a file truncated or overwritten later leaves the others as they were (a tag of one file stays torn: its damage
    and a rewrite look the same). Any doubt keeps the tag torn, refused rather than loaded unchecked."""
    try:
        marked = (tag_dir / MARKER_NAME).stat().st_mtime_ns
    except OSError:
        return False
    if len(entries) < 2:
        return False
    for e in entries:
        try:
            st = (tag_dir / e.name).stat()
        except OSError:
            return False  # a file missing: torn (an interrupted copy, say), not saved again (a save writes them all)
        if st.st_mtime_ns <= marked or st.st_size == e.nbytes:
            return False
    return True


def require_complete(save_dir: str | os.PathLike, tag: str | None = None, *, verify: bool = False,
                     allow_unmarked: bool = False) -> TagMarker | None:
    """Raise unless ``<save_dir>/<tag>`` (``tag`` None: the one ``latest`` names) is complete.

    Returns:
        Its marker (None for an unmarked tag when ``allow_unmarked``).

    Raises:
        CheckpointCorrupt: a listed file's chunk checksum differs (``verify``).
        IntegrityError: no ``latest``, no such tag, a torn tag, or an unmarked one (unless allowed).
    """
    if tag is None:
        tag = _read_latest(Path(save_dir))
        if tag is None:
            raise IntegrityError(f"{save_dir}: no 'latest' file names a tag to load")
    status = check_tag(save_dir, tag, verify=verify)
    if status.complete or (allow_unmarked and status.state == "unmarked"):
        return status.marker
    raise refusal(status)


def refusal(status: TagStatus) -> IntegrityError:
    """The error a load of a tag that is not complete raises, with what to do instead."""
    cls = CheckpointCorrupt if any("checksum mismatch" in p for p in status.problems) else IntegrityError
    hint = {"torn": "load an earlier tag (cpuckpt.integrations.deepspeed.find_latest(save_dir) names the newest "
                    "complete one)",
            "unmarked": "it was not written by cpuckpt's engine (pass allow_unmarked=True to accept it)",
            "missing": "check save_dir and tag"}[status.state]
    return cls(f"DeepSpeed checkpoint {status.describe()}: refusing to load it; {hint}")


def _read_latest(directory: Path) -> str | None:
    return read_pointer(directory / "latest")


def find_latest(save_dir: str | os.PathLike, *, verify: bool = False) -> LatestTag | None:
    """The newest complete tag in ``save_dir``: the one ``latest`` names when it is complete,
    otherwise the complete tag with the highest global step (then the newest marker). None: none."""
    root = Path(save_dir)
    named = _read_latest(root)
    if named is not None:
        status = check_tag(root, named, verify=verify)
        if status.complete and status.marker is not None:
            return LatestTag(root, named, status.marker.global_step, status.marker)
        logger.warning("%s names tag %r, which is %s; looking for an earlier complete tag",
                       root / "latest", named, status.describe())
    best: tuple[tuple[int, float], LatestTag] | None = None
    for sub in root.iterdir() if root.is_dir() else ():
        if sub.name.startswith(REMOVING_PREFIX) or not (sub / MARKER_NAME).exists() or sub.name == named:
            continue
        status = check_tag(root, sub.name, verify=verify)
        if status.complete and status.marker is not None:
            m = status.marker
            key = (m.global_step if m.global_step is not None else -1, m.created_unix)
            if best is None or key > best[0]:
                best = (key, LatestTag(root, sub.name, m.global_step, m))
    return best[1] if best else None


def complete_tags(save_dir: str | os.PathLike) -> list[LatestTag]:
    """Every complete tag in ``save_dir``, newest first: the one ``latest`` names (when complete), then by
    global step, then marker time (the order :func:`find_latest` picks from). Sizes only; no checksums.

    A tag stock DeepSpeed wrote has no marker; it counts when ``latest`` names it (stock DeepSpeed writes ``latest``
    once the tag is saved), with no marker (``marker`` None: nothing to verify), first like any tag ``latest``
    names: a run moved onto cpuckpt resumes from it, never from an older tag of ours. A tag committed but damaged
    since is left out with a WARNING (:func:`scan_tags` gives them to a restart, which must not skip them)."""
    tags, damaged = scan_tags(save_dir)
    for status in damaged:
        logger.warning("%s: committed, but incomplete now (%s); left out of the complete tags", status.path,
                       "; ".join(status.problems))
    return tags


def scan_tags(save_dir: str | os.PathLike) -> tuple[list[LatestTag], list[TagStatus]]:
    """:func:`complete_tags`, and every tag committed once but not complete now (``TagStatus.committed``: a file
    truncated or missing, the marker garbled after the commit), which a restart names instead of taking it for a
    torn save. Neither is logged here except a torn tag ``latest`` names that never committed."""
    root = Path(local_path(save_dir, "DeepSpeed save_dir"))
    named = _read_latest(root)
    found: list[tuple[tuple[int, int, float], LatestTag]] = []
    damaged: list[TagStatus] = []
    for sub in sorted(root.iterdir()) if root.is_dir() else ():
        is_named = sub.name == named
        if sub.name == "latest" or sub.name.startswith(REMOVING_PREFIX):  # a pointer; a tag being deleted
            continue
        if not is_named and not (sub / MARKER_NAME).exists():
            continue
        status = check_tag(root, sub.name)
        if status.committed and not status.complete:
            damaged.append(status)
        elif is_named and status.state == "unmarked" and any(sub.glob("*model_states.pt")):
            logger.info("%s names %s, a tag stock DeepSpeed wrote (no cpuckpt marker): loaded without checksums",
                        root / "latest", named)
            found.append(((1, -1, 0.0), LatestTag(root, sub.name, None, None)))  # type: ignore[arg-type]
        elif is_named and status.state == "torn":
            logger.warning("%s names tag %r, which is %s; the newest complete tag is taken instead", root / "latest",
                           named, status.describe())
        elif status.complete and status.marker is not None:
            m = status.marker
            key = (int(is_named), m.global_step if m.global_step is not None else -1, m.created_unix)
            found.append((key, LatestTag(root, sub.name, m.global_step, m)))
    return [t for _, t in sorted(found, key=lambda kt: kt[0], reverse=True)], damaged


def owned_files(marker: TagMarker, rank: int, world_size: int, tag_dir: Path | None = None) -> list[str]:
    """The files ``rank`` checks when ``world_size`` ranks share a verification (its own when it wrote any; in a
    node's memory slot, ``tag_dir``, the files its node listing says it wrote there)."""
    listing = node_listing(tag_dir, marker) if tag_dir is not None else None
    if listing is not None:
        return sorted(n for n, r in listing.writers.items() if r == rank)
    if world_size == marker.world_size:
        return sorted(n for n, f in marker.files.items() if f.rank == rank)
    return [n for i, n in enumerate(sorted(marker.files)) if i % world_size == rank]


# -- cleaning (``cpuckpt clean``) ----------------------------------------------------------------------------------
ORDER_MARGIN_S = 1.0  # a marker's mtime less than this after a torn tag's last change orders nothing (coarse times)
CLOCK_MARGIN_S = 60.0  # the same for a marker's created_unix: the committing node's clock, not this file system's


def clean_torn_tags(save_dir: str | os.PathLike, *, min_age_s: float = 0.0, fsync: bool = True,
                    dry_run: bool = False) -> list[Path]:
    """Remove torn tags of cpuckpt's engine in ``save_dir`` whose save is over; returns what was (``dry_run``: would
    be) removed, by name. Assumes one engine per ``save_dir``: another engine's commit says nothing of this one's.

    A tag goes only when it never committed (``.cpuckpt-saving``, empty, no marker file at all) and a tag of
    ``save_dir`` committed after its last change: an engine commits its checkpoints in the order it creates them (a
    save's ``create`` commits the one before, and waits for a background commit, before its first byte), so a tag
    whose save still waits for its commit (until the next ``engine.step()``, save or ``destroy()``, however long)
    is newer than every commit of its engine. "After" is the earlier of the later marker's ``created_unix`` less
    :data:`CLOCK_MARGIN_S` (its engine's commit, in memory or on disk, by its node's clock) and its mtime less
    :data:`ORDER_MARGIN_S` (a writer process persists a memory tag long after its memory commit, out of the
    engine's order), against the newest modification time in the torn tag (its directory and everything in it).
    The marker of a later tag must parse and date itself (a garbled one dates nothing); it may be damaged since.

    Never removed: a tag with a marker file (committed, damaged since, empty or of a newer format), a tag of stock
    DeepSpeed (neither file), one ``latest`` names (a file naming it, or a symlink to it; ``latest`` itself is never
    followed into, read through or removed), one a writer process persists (a part ``.cpuckpt-part-<rank>.json``,
    or bytes in its saving file: its coordinator may still commit it), one modified in the last ``min_age_s``
    seconds, one that cannot be read whole, and anything that is not a directory directly under ``save_dir``.
    A tag judged removable is moved aside (``.cpuckpt-removing-<tag>-h<host>-b<boot>-n<pidns>-<pid>``: the
    cleaner's :func:`cpuckpt.procs.host_tag`, :func:`cpuckpt.runfiles.boot_tag`, :func:`cpuckpt.procs.pid_ns_tag`
    (left out where unreadable) and pid, last, where an older cpuckpt reads it; atomic: a save starting into its
    name from then on makes a new directory), checked again and deleted, or put back if it changed (a save reopened
    it). What a cleaner killed while deleting left under that name goes at a later clean, once untouched for
    ``min_age_s`` and, unless its name records another host, boot or pid namespace (its pid says nothing here),
    once its pid no longer runs. A tag that cannot be moved or deleted is logged and kept; the others are
    cleaned.
    """
    root = Path(local_path(save_dir, "DeepSpeed save_dir"))
    torn, commits, leftovers = _survey(root)
    removed: list[Path] = []
    for tag_dir in torn:
        why, later, newest = _kept_because(tag_dir, commits, root, min_age_s)
        if why is not None:
            logger.info("not removing torn DeepSpeed tag %s: %s", tag_dir, why)
            continue
        if not dry_run:
            logger.info("removing torn DeepSpeed tag %s: never committed, and %s committed after its last change",
                        tag_dir, later)
            try:
                if not _remove_tag(root, tag_dir, newest, fsync=fsync):
                    continue
            except OSError as e:
                logger.warning("not removing torn DeepSpeed tag %s: it cannot be moved aside (%s)", tag_dir, e)
                continue
        removed.append(tag_dir)
    for moved in leftovers:
        why = _leftover_kept_because(moved, min_age_s)
        if why is not None:
            logger.info("not deleting %s (a torn DeepSpeed tag moved aside to be deleted): %s", moved, why)
            continue
        if not dry_run:
            try:
                shutil.rmtree(moved)
            except OSError as e:
                logger.warning("could not delete %s (a torn DeepSpeed tag moved aside to be deleted): %s", moved, e)
                continue
        removed.append(moved)
    return removed


def _survey(root: Path) -> tuple[list[Path], list[tuple[Path, int]], list[Path]]:
    """One listing of ``root``: (the tags of cpuckpt's engine that never committed, the committed tags with their
    commit time in ns, what earlier cleaners moved aside). The commits are not looked at again later."""
    torn: list[Path] = []
    commits: list[tuple[Path, int]] = []
    leftovers: list[Path] = []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return [], [], []
    for entry in entries:
        if entry.name == "latest" or not entry.is_dir(follow_symlinks=False):
            continue
        tag_dir = Path(entry.path)
        if entry.name.startswith(REMOVING_PREFIX):
            leftovers.append(tag_dir)
            continue
        if not (os.path.lexists(tag_dir / MARKER_NAME) or os.path.lexists(tag_dir / SAVING_NAME)):
            continue  # stock DeepSpeed's, or no tag at all
        try:
            status = check_dir(tag_dir, entry.name)
        except OSError as e:
            logger.warning("not removing DeepSpeed tag %s: it cannot be read (%s)", tag_dir, e)
            continue
        if status.committed:
            if not status.complete:
                logger.warning("not removing DeepSpeed tag %s: committed once, incomplete now (%s)", tag_dir,
                               "; ".join(status.problems))
            when = _commit_ns(tag_dir, status.marker) if status.marker is not None else None
            if when is not None:
                commits.append((tag_dir, when))
        elif status.state == "torn":
            torn.append(tag_dir)
    return torn, commits, leftovers


def _commit_ns(tag_dir: Path, marker: TagMarker) -> int | None:
    """When ``tag_dir``'s commit surely happened, in ns (the margins taken off); None: its marker dates nothing."""
    created = marker.created_unix
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 < created < math.inf:
        return None  # not a number, NaN (fails every comparison), infinite, or never set
    try:
        mtime = os.lstat(tag_dir / MARKER_NAME).st_mtime_ns
    except OSError:
        return None
    if created * 1e9 > mtime + CLOCK_MARGIN_S * 1e9:  # made well after its own file was written: no time to trust
        return None
    return min(int(created * 1e9) - int(CLOCK_MARGIN_S * 1e9), mtime - int(ORDER_MARGIN_S * 1e9))


def _claimed(tag_dir: Path) -> str | None:
    """Why ``tag_dir`` is a commit's or a writer's, or None. Raises OSError (its saving file gone included)."""
    if os.path.lexists(tag_dir / MARKER_NAME):
        return "it has a marker file (committed, or of a format this cpuckpt does not judge)"
    parts = sorted(n for n in os.listdir(tag_dir) if n.startswith(PART_PREFIX))
    if parts:
        return f"a writer process persists it ({', '.join(parts)}: its coordinator may still commit it)"
    if os.lstat(tag_dir / SAVING_NAME).st_size:
        return f"a writer process persists it (its {SAVING_NAME} names the save)"
    return None


def _kept_because(tag_dir: Path, commits: list[tuple[Path, int]], root: Path,
                  min_age_s: float) -> tuple[str | None, Path | None, int]:
    """(why ``tag_dir`` stays, or None, and then the tag committed after it; its newest mtime in ns)."""
    try:
        if not stat.S_ISDIR(os.lstat(tag_dir).st_mode):
            return "not a directory", None, 0
        if _read_latest(root) == tag_dir.name:
            return f"{root / 'latest'} names it", None, 0
        if (why := _claimed(tag_dir)) is not None:
            return why, None, 0
        status = check_dir(tag_dir, tag_dir.name)
        if status.state != "torn" or status.committed:
            return f"it is {status.state} now", None, 0
        newest = _newest_ns(tag_dir)
    except OSError as e:  # gone, unreadable, or changing while read: nothing is decided
        return f"it cannot be read whole ({e})", None, 0
    age_s = (time.time_ns() - newest) / 1e9
    if age_s < min_age_s:
        return f"modified {age_s:.0f} s ago, less than {min_age_s:g} s (it may be written right now)", None, newest
    later = [(when, p) for p, when in commits if when > newest]
    if not later:
        return ("no tag was committed after its last change (a save waits for its commit until the engine's next "
                "step(), save or destroy())"), None, newest
    return None, max(later)[1], newest


def _newest_ns(tag_dir: Path) -> int:
    """The newest mtime (ns) of ``tag_dir`` and everything under it; raises when anything cannot be stat'ed."""
    newest = os.lstat(tag_dir).st_mtime_ns

    def fail(e: OSError) -> None:
        raise e

    for dirpath, dirnames, filenames in os.walk(tag_dir, onerror=fail):
        for name in (*dirnames, *filenames):
            newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime_ns)
    return newest


def _remove_tag(root: Path, tag_dir: Path, newest: int, *, fsync: bool) -> bool:
    """Move ``tag_dir`` aside, check it is still as judged (``newest``: its newest mtime then), delete it; True
    when deleted. An unlink in place would delete the files of a save that reopened the tag meanwhile; a rename is
    atomic: a save that opens the tag's name after it makes a new directory, one before it changed the tag
    (``open_tag`` dates its saving file), which the check sees. Raises OSError when it cannot be moved."""
    moved = root / f"{REMOVING_PREFIX}{tag_dir.name}-{_cleaner()}-{os.getpid()}"
    if _saving_ns(tag_dir) > newest:  # reopened by a save since the (long) walk that judged it: no move at all
        return False
    os.rename(tag_dir, moved)
    try:  # the saving file first (a reopen dates it): put back within microseconds, before a rank of it misses it
        why = ("reopened by a save" if _saving_ns(moved) > newest else None) or _claimed(moved) or (
            "modified since it was judged" if _newest_ns(moved) != newest else None)
    except OSError as e:
        why = f"it cannot be read whole ({e})"
    if why is not None:
        _put_back(moved, tag_dir, why)
        return False
    if fsync:  # its name gone durably before a file of it: a crash leaves a leftover, never a tag half deleted
        try:
            fsync_dir(root)
        except OSError as e:
            logger.warning("torn DeepSpeed tag %s, moved aside to %s: its directory could not be synced (%s); what "
                           "is there stays for a later clean", tag_dir, moved, e)
            return False
    try:
        shutil.rmtree(moved)
    except OSError as e:
        logger.warning("torn DeepSpeed tag %s, moved aside to %s, could not be deleted whole (%s): what is left "
                       "stays there, for a later clean", tag_dir, moved, e)
        return False
    if fsync:
        fsync_dir(root)
    return True


def _put_back(moved: Path, tag_dir: Path, why: str) -> None:
    """Undo :func:`_remove_tag`'s move: ``tag_dir`` changed between its judgement and its move. Where it cannot go
    back (a save made the name again meanwhile), it is marked kept (:data:`KEPT_NAME`): it may hold a file a rank
    of that save is still writing, so no later clean deletes it; a person decides."""
    if not os.path.lexists(tag_dir):
        try:
            os.rename(moved, tag_dir)
            logger.info("not removing torn DeepSpeed tag %s: %s (put back)", tag_dir, why)
            return
        except OSError as e:
            why = f"{why}; putting it back failed: {e}"
    else:
        why = f"{why}; a new {tag_dir.name} was made meanwhile"
    try:
        (moved / KEPT_NAME).write_text(f"{tag_dir.name}\n")
        kept = "never deleted by a clean"
    except OSError as e:  # then only its age keeps it from a later clean
        kept = (f"but marking it kept failed ({e}): a later clean --deepspeed-tags deletes it once untouched for "
                "--min-age")
    logger.warning("not removing torn DeepSpeed tag %s: %s; it is kept as %s, %s; a save's file may be in it "
                   "(compare it with %s, then remove it by hand)", tag_dir, why, moved, kept, tag_dir)


def _saving_ns(tag_dir: Path) -> int:
    """The saving file's mtime (0: none): every ``open_tag`` dates it."""
    try:
        return os.lstat(tag_dir / SAVING_NAME).st_mtime_ns
    except FileNotFoundError:
        return 0


def _cleaner() -> str:
    """This cleaner in the name of a tag it moves aside, before its pid: ``h<host>-b<boot>[-n<pidns>]``."""
    pidns = pid_ns_tag()
    return f"h{host_tag()}-b{boot_tag()}" + (f"-n{pidns}" if pidns is not None else "")


# what :func:`_remove_tag` names a tag it moves aside, after the prefix: ``<tag>-h<host>-b<boot>[-n<pidns>]-<pid>``,
# the pid last (an older cpuckpt reads the pid after the last dash); the version before wrote ``<tag>-<pid>-h<host>``,
# older ones ``<tag>-<pid>`` (no host: judged by its pid as before)
_MOVED_RE = re.compile(r"(?P<tag>.+)-h(?P<host>[0-9a-f]{12})-b(?P<boot>[0-9a-f]{12}|noboot)"
                       r"(?:-n(?P<pidns>[0-9a-f]{1,16}))?-(?P<pid>\d+)")
_MOVED_PID_HOST_RE = re.compile(r"(?P<tag>.+)-(?P<pid>\d+)-h(?P<host>[0-9a-f]{12})")


def _cleaner_pid(name: str) -> str:
    """The pid of the cleaner that moved a tag aside to ``name`` (after the prefix), where it may be asked about
    here; "" where the name records another host, boot or pid namespace than this process's (that pid says nothing
    here: a save_dir on a shared file system, another container of the node). A field this process cannot read
    differs from nothing: asking about a pid only keeps a leftover longer."""
    m = _MOVED_RE.fullmatch(name) or _MOVED_PID_HOST_RE.fullmatch(name)
    if m is None:  # an older cpuckpt's name, <tag>-<pid>: nothing recorded but the pid
        return name.rpartition("-")[2]
    fields = m.groupdict()
    here = {"host": host_tag(), "boot": boot_tag(), "pidns": pid_ns_tag()}
    for key, mine in here.items():
        theirs = fields.get(key)
        if theirs not in (None, "noboot") and mine not in (None, "noboot") and theirs != mine:
            return ""
    return m["pid"]


def _leftover_kept_because(moved: Path, min_age_s: float) -> str | None:
    """Why a directory an earlier cleaner moved aside stays, or None: its cleaner may still run, or it changed
    within ``min_age_s``. A cleaner's pid is asked about only where its name records no other host, boot or pid
    namespace (:func:`_cleaner_pid`): another's (a shared file system, a reboot since, another container) is
    judged by the age alone."""
    if os.path.lexists(moved / KEPT_NAME):
        return "kept: a save made its name again while it was moved aside; remove it by hand"
    pid = _cleaner_pid(moved.name[len(REMOVING_PREFIX):])
    if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
        return f"its cleaner (pid {pid}) may still run"
    try:
        age_s = (time.time_ns() - _newest_ns(moved)) / 1e9
    except OSError as e:
        return f"it cannot be read whole ({e})"
    if age_s < min_age_s:
        return f"modified {age_s:.0f} s ago, less than {min_age_s:g} s"
    return None
