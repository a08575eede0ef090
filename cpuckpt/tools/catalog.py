"""Finding and describing checkpoints on disk (``cpuckpt ls`` / ``cpuckpt inspect``). Reads, never writes.

Recognised directory kinds:

- ``cpuckpt``: a ``.cpuckpt.json`` manifest or rank manifest parts.
- ``dcp``: stock DCP, ``.metadata`` (or ``*.distcp`` data files) without a cpuckpt manifest.
- ``megatron``: ``metadata.json`` holding ``sharded_backend`` (Megatron-Core dist checkpoint).
- ``deepspeed``: ``*_model_states.pt`` files (a DeepSpeed tag directory); complete when present.

``cpuckpt``, ``dcp`` and Megatron ``torch_dist`` checkpoints are complete as ``find_latest`` has it
(:func:`cpuckpt.backend.committed.check_complete`: ``.metadata`` valid, every data file the manifest
lists at its size); other Megatron backends when present.

Pickled files are never unpickled here: ``.metadata`` goes through :func:`cpuckpt.backend.committed.load_metadata`
(DCP classes only) and DeepSpeed ``.pt`` files are only listed.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from cpuckpt import s3roots
from cpuckpt.backend import s3commit
from cpuckpt.backend.committed import METADATA_NAME, load_metadata, read_manifest, same_save
from cpuckpt.config import resolve_config
from cpuckpt.errors import CpuckptError
from cpuckpt.format.dtypes import tensor_nbytes
from cpuckpt.format.manifest import MANIFEST_NAME, Manifest
from cpuckpt.paths import S3Url, checkpoint_path
from cpuckpt.rootinfo import REMOVING_PREFIX
from cpuckpt.roots import committed_once, find_latest, inspect_checkpoint, list_checkpoints, ordered
from cpuckpt.tier.tagmarker import check_dir
from cpuckpt.transfer.objstore import open_store

__all__ = ["Description", "ListedCheckpoint", "TensorInfo", "describe", "identify", "scan_root", "tensors_of"]

_STEP_RE = re.compile(r"(\d+)(?!.*\d)")  # the last number in a name: step_100, iter_0000100, global_step7


@dataclass
class ListedCheckpoint:
    """One checkpoint directory as ``ls`` shows it."""

    path: Path | S3Url
    kind: str  # cpuckpt, dcp, megatron, deepspeed
    complete: bool
    step: int | None  # shown: the manifest's, else the last number in the directory name
    nbytes: int
    mtime: float  # when it was written, what AGE shows (see identify)
    latest: bool = False
    reason: str = ""  # why it is incomplete, or (damaged) the first damage found
    rank_step: int | None = None  # the step it is ranked by: find_latest's for DCP checkpoints
    damaged: bool = False  # ``scan_root(verify=True)`` found damage: in its bytes, or files short since its commit
    rank_time: float = 0.0  # the commit time it is ranked by: find_latest's (.metadata's mtime) for DCP ones
    step_from_name: bool = False  # ``step`` is the last number in the name: the checkpoint records none
    committed: bool = False  # incomplete, but its commit marker is there (``roots.committed_once``): damaged since

    @property
    def status(self) -> str:
        return "damaged" if self.damaged else "complete" if self.complete else "incomplete"

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.mtime)


@dataclass
class TensorInfo:
    """One state-dict entry of a DCP checkpoint."""

    name: str
    dtype: str  # "bytes" for non-tensor items
    shape: tuple[int, ...]
    shards: int
    nbytes: int  # data bytes of the full tensor (record bytes for non-tensor items)


@dataclass
class Description:
    """What ``inspect`` reports about one checkpoint."""

    info: ListedCheckpoint
    manifest: Manifest | None = None
    ranks: int | None = None
    files: dict[str, int] = field(default_factory=dict)  # data file -> bytes on disk
    tensors: list[TensorInfo] = field(default_factory=list)
    dcp_version: str = ""
    save_id: str = ""
    notes: list[str] = field(default_factory=list)


def identify(path: str | os.PathLike) -> ListedCheckpoint | None:
    """Recognise ``path`` as a checkpoint directory, or return None when it is not one."""
    p = Path(path)
    if not p.is_dir():
        return None
    try:
        names = set(os.listdir(p))
    except OSError:
        return None
    kind: str | None = None
    manifest: Manifest | None = None
    dcp_files = True  # a DCP checkpoint (.metadata + data files): completeness as find_latest has it
    step: int | None = None
    if MANIFEST_NAME in names or any(n.endswith(".cpuckpt-part.json") for n in names):
        kind = "cpuckpt"
        try:
            manifest = read_manifest(p) if MANIFEST_NAME in names else None
        except CpuckptError:
            manifest = None
        step = manifest.step if manifest is not None else None
    elif "metadata.json" in names and _megatron_backend(p / "metadata.json") is not None:
        kind = "megatron"
        dcp_files = _megatron_backend(p / "metadata.json") == "torch_dist"
    elif METADATA_NAME in names or any(n.endswith(".distcp") for n in names):
        kind = "dcp"
    elif any(n.endswith("_model_states.pt") for n in names):
        kind, dcp_files = "deepspeed", False
    if kind is None:
        return None
    complete, reason, committed = True, "", False  # other backends' files: complete when present
    if kind == "deepspeed":  # a tag cpuckpt's engine wrote has its markers: torn unless committed, sizes checked
        status = check_dir(p)
        complete = status.state != "torn"
        reason = "; ".join(status.problems) if not complete else ""
        committed = not complete and status.committed  # from its one read of the marker
    nbytes, newest = _tree_size(p)
    commit_time: float | None = None
    rank_step = step
    if dcp_files:
        # the one definition (cpuckpt.backend.committed.check_complete): .metadata, every listed file's size
        checked = inspect_checkpoint(p)
        complete, reason, rank_step = checked.complete, checked.reason, checked.step
        committed = not complete and committed_once(checked)
        if complete:
            commit_time = checked.mtime  # .metadata's mtime: written last, by the commit
    from_name = step is None and (m := _STEP_RE.search(p.name)) is not None
    if from_name:
        step = int(m.group(1))
    if not dcp_files:
        rank_step = step
    rank_time = commit_time if commit_time is not None else newest
    return ListedCheckpoint(path=p, kind=kind, complete=complete, step=step, nbytes=nbytes,
                            mtime=_written_at(p, manifest, commit_time) or rank_time, reason=reason,
                            rank_step=rank_step, rank_time=rank_time, step_from_name=from_name, committed=committed)


def _written_at(p: Path, manifest: Manifest | None, commit_time: float | None) -> float | None:
    """The manifest's ``created_unix`` (set at the commit; a persisted memory checkpoint keeps its memory
    save's), when the manifest is of the save that committed ``.metadata``; else None.

    Not a directory's or file's mtime: loading a checkpoint creates and removes a marker in it, and
    copying it resets every mtime."""
    if manifest is None or not manifest.created_unix or commit_time is None:
        return None
    try:
        return manifest.created_unix if same_save(manifest, load_metadata(p)) else None
    except (CpuckptError, OSError):
        return None


def scan_root(root: str | os.PathLike, *, verify: bool = False) -> list[ListedCheckpoint]:
    """Checkpoints in ``root`` (its subdirectories, or ``root`` itself), oldest first, latest marked.

    Order: :func:`cpuckpt.roots.ordered`, the rule of ``find_latest`` (step, then commit time; a
    step-less checkpoint ranks above those committed before it), by the step ``find_latest`` uses
    (the manifest's) for DCP checkpoints and the directory name's for DeepSpeed and other Megatron
    backends. The latest is :func:`cpuckpt.find_latest`'s answer (the newest complete cpuckpt or
    DCP checkpoint); for DeepSpeed and Megatron roots, the directory their pointer file (``latest``,
    ``latest_checkpointed_iteration.txt``) names; otherwise the newest complete one in that order.

    ``verify``: read every byte of each complete cpuckpt or DCP checkpoint and check it
    (:func:`cpuckpt.tools.verification.verify_checkpoint`); a damaged one is marked ``damaged`` and the
    latest is then the newest one that verifies (the one :func:`cpuckpt.load_latest` would load). An incomplete
    one whose commit marker is there (a file truncated or missing since its commit) is ``damaged`` too.

    An ``s3://`` root lists its checkpoint prefixes (cpuckpt and stock DCP checkpoints: :func:`_scan_s3`).

    Raises:
        FileNotFoundError: ``root`` is not a directory.
        ConfigError: ``root`` is a URL other than ``s3://``.
    """
    where = checkpoint_path(root, "checkpoint root")
    if isinstance(where, S3Url):
        return _scan_s3(where, verify=verify)
    r = Path(where)
    if not r.is_dir():
        raise FileNotFoundError(f"{r}: not a directory")
    own = identify(r)
    if own is not None:
        found = [own]
    else:
        found = [info for d in sorted(r.iterdir()) if not d.name.startswith(REMOVING_PREFIX) and d.is_dir()
                 and (info := identify(d)) is not None]
    found = ordered(found, lambda i: i.rank_step, lambda i: i.rank_time, lambda i: i.path.name)
    if verify:
        _verify_all(found)
    newest = find_latest(r) if own is None else None  # cpuckpt's rule for cpuckpt and DCP checkpoints
    latest = next((i for i in found if newest is not None and i.path == newest), None) or _pointer(r, found)
    if latest is not None and latest.damaged:
        latest = next((i for i in reversed(found) if i.complete and not i.damaged and i.kind != "deepspeed"), None)
    if latest is None:
        latest = next((i for i in reversed(found) if i.complete and not i.damaged), None)
    if latest is not None:
        latest.latest = True
    return found


def _scan_s3(root: S3Url, *, verify: bool) -> list[ListedCheckpoint]:
    """The checkpoint prefixes under an ``s3://`` root, as ``roots.list_checkpoints`` finds and orders them
    (sizes from one listing each); the latest is ``find_latest``'s, or with ``verify`` the newest that
    verifies."""
    store = open_store(resolve_config(None).s3, threads=4)
    found = []
    own = s3roots.inspect_prefix(root)  # ROOT a checkpoint itself, as a local directory may be
    for c in [own] if own is not None else list_checkpoints(root):
        url: S3Url = c.path  # type: ignore[assignment]
        objects = list(store.list(S3Url(url.bucket, f"{url.key}/")))
        kind = "cpuckpt" if any(o.key.endswith(f"/{MANIFEST_NAME}") for o in objects) else "dcp"
        found.append(ListedCheckpoint(url, kind, c.complete, c.step, sum(o.nbytes for o in objects), c.mtime,
                                      reason=c.reason, rank_step=c.step, rank_time=c.mtime,
                                      committed=not c.complete and committed_once(c)))
    if verify:
        _verify_all(found)
    complete = [i for i in found if i.complete and not i.damaged]
    if complete:
        complete[-1].latest = True
    return found


def _verify_all(found: list[ListedCheckpoint]) -> None:
    from cpuckpt.tools.verification import verify_checkpoint

    for info in found:
        if info.committed:  # a file short or missing since its commit: damage, as `verify` says
            info.damaged = True
            continue
        if info.complete and info.kind == "deepspeed":  # a tag of cpuckpt's engine: its marker's crc32c
            status = check_dir(info.path, verify=True)  # type: ignore[arg-type]
            if status.state == "torn":  # damaged, or (no marker now) a save of the tag begun since the listing
                info.complete, info.damaged, info.reason = False, status.committed, "; ".join(status.problems)
            continue
        if not info.complete or (isinstance(info.path, Path) and not (info.path / METADATA_NAME).is_file()):
            continue
        try:
            report = verify_checkpoint(info.path)
        except CpuckptError as e:
            info.damaged, info.reason = True, str(e)
            continue
        if not report.ok:
            info.damaged = True
            info.reason = f"{len(report.damage)} problem(s), first: {report.damage[0]}"


def _pointer(root: Path, found: list[ListedCheckpoint]) -> ListedCheckpoint | None:
    for name in ("latest", "latest_checkpointed_iteration.txt"):
        try:
            text = (root / name).read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if not text:
            continue
        target = Path(text).name
        for info in found:
            if info.complete and (info.path.name == target or (name.startswith("latest_checkpointed")
                                                               and info.step == _int(text))):
                return info
    return None


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _megatron_backend(path: Path) -> str | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    backend = data.get("sharded_backend") if isinstance(data, dict) else None
    return str(backend) if backend is not None else None


def _tree_size(p: Path) -> tuple[int, float]:
    """Bytes of every file under ``p`` and the newest file mtime (not the directory's: a load's
    marker file changes that)."""
    total, mtime = 0, 0.0
    for dirpath, _dirs, files in os.walk(p):
        for n in files:
            try:
                st = os.stat(os.path.join(dirpath, n))
            except OSError:  # removed while we walk (a save in progress)
                continue
            total += st.st_size
            mtime = max(mtime, st.st_mtime)
    return total, mtime or p.stat().st_mtime


def describe(path: str | os.PathLike) -> Description:
    """Everything ``inspect`` shows: files, ranks, tensors, versions, config and timings.

    ``path`` may be an ``s3://`` checkpoint prefix (:func:`_describe_s3`).

    Raises:
        FileNotFoundError: ``path`` is not a recognised checkpoint directory.
    """
    where = checkpoint_path(path)
    if isinstance(where, S3Url):
        return _describe_s3(where)
    p = Path(where)
    info = identify(p)
    if info is None:
        raise FileNotFoundError(f"{p}: not a checkpoint directory (no .metadata, .cpuckpt.json, "
                                "metadata.json or *_model_states.pt)")
    desc = Description(info=info)
    if info.kind == "deepspeed":
        desc.files = {n.name: n.stat().st_size for n in sorted(p.glob("*.pt"))}
        desc.notes.append("DeepSpeed .pt files are pickles; not opened (use DeepSpeed to load them)")
        return desc
    try:
        desc.manifest = read_manifest(p)
    except CpuckptError as e:
        desc.notes.append(str(e))
    if desc.manifest is not None:
        desc.ranks = desc.manifest.world_size
        desc.save_id = desc.manifest.save_id
    if not info.complete and not info.committed:  # the look that made ``info``: one commit marker, one verdict
        desc.notes.append("no .metadata: the save did not complete; tensors are unknown")
        desc.files = {n.name: n.stat().st_size for n in sorted(p.glob("*.distcp"))}
        return desc
    if not info.complete:
        desc.notes.append(f"committed, but incomplete now: {info.reason}")
    try:
        md = load_metadata(p)
    except CpuckptError as e:
        desc.notes.append(str(e))
        desc.files = {n.name: n.stat().st_size for n in sorted(p.glob("*.distcp"))}
        return desc
    desc.dcp_version = str(getattr(md, "version", "") or "")
    desc.save_id = desc.save_id or str(getattr(getattr(md, "storage_meta", None), "save_id", "") or "")
    desc.tensors = tensors_of(md)
    rels = sorted({s.relative_path for s in (md.storage_data or {}).values()})
    for rel in rels:
        try:
            desc.files[rel] = (p / rel).stat().st_size
        except OSError:
            desc.files[rel] = -1
            desc.notes.append(f"{rel}: listed in .metadata but missing")
    if desc.ranks is None:
        prefixes = {m.group(1) for rel in rels if (m := re.match(r"__(\d+)_", rel))}
        desc.ranks = len(prefixes) or None
    return desc


def _describe_s3(url: S3Url) -> Description:
    """:func:`describe` of a checkpoint prefix in object storage (one listing, ``.metadata`` and the manifest)."""
    store = open_store(resolve_config(None).s3, threads=4)
    objects = {o.key[len(url.key) + 1:]: o.nbytes for o in store.list(S3Url(url.bucket, f"{url.key}/"))}
    if not objects:
        raise FileNotFoundError(f"{url}: not a checkpoint (no object under this prefix)")
    c = inspect_checkpoint(url)
    kind = "cpuckpt" if MANIFEST_NAME in objects else "dcp"
    desc = Description(info=ListedCheckpoint(url, kind, c.complete, c.step, sum(objects.values()), c.mtime,
                                             reason=c.reason, rank_step=c.step, rank_time=c.mtime))
    try:
        desc.manifest = s3commit.read_manifest(store, url)
    except CpuckptError as e:
        desc.notes.append(str(e))
    if desc.manifest is not None:
        desc.ranks, desc.save_id = desc.manifest.world_size, desc.manifest.save_id
    try:
        md = s3commit.load_metadata(store, url)
    except CpuckptError as e:
        desc.notes.append(str(e) if METADATA_NAME in objects else
                          "no .metadata: the save did not complete; tensors are unknown")
        desc.files = {n: b for n, b in sorted(objects.items()) if n.endswith(".distcp")}
        return desc
    if not c.complete:
        desc.notes.append(f"committed, but incomplete now: {c.reason}")
    desc.dcp_version = str(getattr(md, "version", "") or "")
    desc.save_id = desc.save_id or str(getattr(getattr(md, "storage_meta", None), "save_id", "") or "")
    desc.tensors = tensors_of(md)
    rels = sorted({s.relative_path for s in (md.storage_data or {}).values()})
    for rel in rels:
        desc.files[rel] = objects.get(rel, -1)
        if rel not in objects:
            desc.notes.append(f"{rel}: listed in .metadata but missing")
    if desc.ranks is None:
        desc.ranks = len({m.group(1) for rel in rels if (m := re.match(r"__(\d+)_", rel))}) or None
    return desc


def tensors_of(md: Metadata) -> list[TensorInfo]:
    """One :class:`TensorInfo` per state-dict entry of a DCP ``Metadata``, in its order."""
    out = []
    lengths: dict[str, int] = {}
    for idx, sinfo in (md.storage_data or {}).items():
        lengths[idx.fqn] = lengths.get(idx.fqn, 0) + int(getattr(sinfo, "length", 0))
    for name, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            shape = tuple(int(s) for s in item.size)
            dtype = item.properties.dtype
            out.append(TensorInfo(name, str(dtype).replace("torch.", ""), shape, len(item.chunks),
                                  tensor_nbytes(dtype, shape)))
        elif isinstance(item, BytesStorageMetadata):
            out.append(TensorInfo(name, "bytes", (), 1, lengths.get(name, 0)))
    return out

