"""``.metadata`` bytes of repeated saves: a cached plan's structure pickled in full at its first two saves into a
slot, from then on only the save id changes.

A memory tier commits a checkpoint every iteration. Its ``.metadata`` (DCP's :class:`Metadata`, pickled as DCP
writes it) describes every tensor, so pickling it costs ~10 µs per tensor (12 ms for 1,168 tensors on the CPU
box), on a committer thread that shares the trainer's interpreter. A save that reuses a cached plan commits the
same structure (the very same objects in every field but ``storage_data`` and ``storage_meta``, equal
``storage_data``) into the same directory, under a new save id of the same length: the previous bytes with that
one string record rewritten are a pickle of the new metadata. The id is pickled as an object of its own (so no
other field refers back to it), and its record is found by its bytes (opcode, length, text), used only where they
occur exactly once: the rewrite never touches another byte, and a same-length ASCII id changes no opcode, length
or memo index. Anything else — another structure or type, other storage data, an id of another length, shorter
than 2 or not ASCII — is pickled in full.

Only a cached plan's structure is kept (:func:`reusable`; weakly: its entries go with the plan), and per structure
the bytes of a directory seen before (a memory slot comes round again; a disk save's ``step_N`` never does, and
keeps its name only), so a save that is never repeated holds nothing.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import pickle
import pickletools
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["MetadataPickles", "dumps_metadata", "holds_text", "reusable", "with_checkpoint_id"]

_PER_SAVE = ("storage_data", "storage_meta")  # the fields a save from a cached plan fills anew


@dataclass
class _Pickled:
    kind: type
    same: dict[str, Any]  # every other field, compared by identity (kept: no id is reused while the entry lives)
    storage_data: Any
    storage_meta: Any
    data: bytes
    id_at: int  # where the save id's text starts in ``data``


@dataclass
class _Structure:
    owner: weakref.ref  # the cached plan's metadata (its entries go with it)
    entries: collections.OrderedDict[Any, _Pickled | None]  # per directory (None: seen once, nothing kept)


class MetadataPickles:
    """Per reusable structure (a cached plan's metadata, held weakly), the last pickled ``.metadata`` of each
    directory it was saved into more than once (a memory slot), ``directories`` at most."""

    def __init__(self, directories: int = 256) -> None:
        self.directories = directories
        self._lock = threading.Lock()
        self._structures: dict[int, _Structure] = {}  # by id of the owner's state_dict_metadata
        self.reused = 0  # saves whose bytes came from the previous one's

    def reusable(self, owner: Metadata) -> None:
        """Later saves commit copies of ``owner`` (the same structure objects): a cached plan's metadata."""
        key = id(owner.state_dict_metadata)
        with self._lock:
            held = self._structures.get(key)
            if held is None or held.owner() is not owner:
                self._structures[key] = _Structure(weakref.ref(owner, lambda ref: self._forget(key, ref)),
                                                   collections.OrderedDict())

    def _forget(self, key: int, ref: weakref.ref) -> None:
        """The owner is gone (a weakref callback: no lock, it may run inside any of this object's calls)."""
        held = self._structures.get(key)
        if held is not None and held.owner is ref:
            self._structures.pop(key, None)

    def dumps(self, md: Metadata) -> bytes:
        """``pickle.dumps(md)``, from the previous save's bytes where only the save id changed."""
        meta = md.storage_meta
        save_id = getattr(meta, "save_id", None)
        if not (isinstance(save_id, str) and len(save_id) >= 2 and save_id.isascii()):
            return pickle.dumps(md)
        directory = getattr(meta, "checkpoint_id", None)
        with self._lock:
            held = self._structures.get(id(md.state_dict_metadata))
            owner = held.owner() if held is not None else None
            if owner is None or owner.state_dict_metadata is not md.state_dict_metadata:
                held = None  # not a structure saved again
            last = held.entries.get(directory) if held is not None else None
        if held is None:
            return pickle.dumps(md)
        same = {k: v for k, v in vars(md).items() if k not in _PER_SAVE}
        if last is not None and self._repeats(last, md, same) and len(last.storage_meta.save_id) == len(save_id):
            at = last.id_at
            data = last.data[:at] + save_id.encode() + last.data[at + len(save_id):]
            with self._lock:
                self.reused += 1
                self._remember(held, directory, dataclasses.replace(
                    last, storage_data=md.storage_data, data=data, storage_meta=dataclasses.replace(meta)))
            return data
        # the id as a str object of its own: pickle writes an object once and refers back to it
        own = copy.copy(md)
        own.storage_meta = dataclasses.replace(meta, save_id=save_id.encode().decode())
        data = pickle.dumps(own)
        at = _id_record(data, save_id)
        keep = (_Pickled(type(md), same, md.storage_data, dataclasses.replace(meta), data, at)
                if at is not None else None)
        with self._lock:  # a first visit keeps the name only: most directories are never saved into again
            self._remember(held, directory, keep if directory in held.entries else None)
        return data

    @staticmethod
    def _repeats(last: _Pickled, md: Metadata, same: dict[str, Any]) -> bool:
        """``md`` differs from ``last``'s metadata in its save id only (identical objects elsewhere)."""
        return (type(md) is last.kind and same.keys() == last.same.keys()
                and all(v is last.same[k] for k, v in same.items())
                and dataclasses.replace(md.storage_meta, save_id=last.storage_meta.save_id) == last.storage_meta
                and last.storage_data == md.storage_data)

    def _remember(self, held: _Structure, directory: Any, entry: _Pickled | None) -> None:
        held.entries[directory] = entry
        held.entries.move_to_end(directory)
        while len(held.entries) > self.directories:
            held.entries.popitem(last=False)


def _id_record(data: bytes, save_id: str) -> int | None:
    """Where the text of ``save_id``'s string record starts in the pickle ``data``, None unless its bytes (opcode,
    length, text) occur exactly once. The record is there (the id is pickled as an object of its own, protocol 4+),
    so one occurrence is that record: no other record, and no bytes across two, read the same."""
    record = _string_records(save_id)[0]
    at = data.find(record)
    if at < 0 or data.find(record, at + 1) >= 0:
        return None
    return at + len(record) - len(save_id.encode("utf-8", "surrogatepass"))


def _string_records(text: str) -> list[bytes]:
    """``text``'s string record as pickle writes it (opcode, length, UTF-8 with lone surrogates passed through):
    protocols 4+ first (SHORT_BINUNICODE under 256 bytes), then BINUNICODE (protocols < 4 write every string so)."""
    raw = text.encode("utf-8", "surrogatepass")
    n = len(raw)
    records = [pickle.BINUNICODE + n.to_bytes(4, "little") + raw]
    if n < 256:
        records.insert(0, pickle.SHORT_BINUNICODE + bytes([n]) + raw)
    return records


def holds_text(data: bytes, text: str) -> bool:
    """Whether the pickle ``data`` holds ``text`` as a string record of its own (its opcode and length before it, as
    pickle writes it: UTF-8, lone surrogates passed through), not merely its bytes inside a longer string."""
    return any(record in data for record in _string_records(text))


_PICKLES = MetadataPickles()  # cached plans' structures (weakly), a pickle per slot


def reusable(owner: Metadata) -> None:
    """The process's :class:`MetadataPickles`: later saves commit copies of ``owner`` (a cached plan's metadata)."""
    _PICKLES.reusable(owner)


def dumps_metadata(md: Metadata) -> bytes:
    """The process's :class:`MetadataPickles`: ``pickle.dumps(md)`` for a ``.metadata`` file."""
    return _PICKLES.dumps(md)


_TEXT_OPS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8")
_GET_OPS = ("GET", "BINGET", "LONG_BINGET")
_PUT_OPS = ("PUT", "BINPUT", "LONG_BINPUT")  # and MEMOIZE, which numbers its entries implicitly
RENAME_MAX_BYTES = 1 << 20  # larger metadata is unpickled instead: the walk is pure Python (0.55 s for 0.7 MB), and
# from about 1 MB it costs more than importing torch once and unpickling
_STORAGE_META = ["torch.distributed.checkpoint.metadata", "StorageMeta"]
_STORAGE_META_GLOBAL = "torch.distributed.checkpoint.metadata StorageMeta"  # protocols < 4: one GLOBAL op
_OPS_TO_STATE = 6  # global, (empty) args, NEWOBJ, EMPTY_DICT, MARK, then the first key (memo stores not counted)


def with_checkpoint_id(data: bytes, checkpoint_id: str) -> bytes | None:
    """The pickled ``Metadata`` ``data`` with ``storage_meta.checkpoint_id`` set to ``checkpoint_id``, rewritten
    without unpickling it (no torch: the memory tier's writer process renames a slot's metadata for the durable
    copy). One walk over the opcodes finds StorageMeta's state as pickled: within a few ops of the global
    ``torch.distributed.checkpoint.metadata.StorageMeta``, the only text record ``checkpoint_id``, then the value's
    text record, then ``save_id`` (a record, or a memo fetch of one); neither the key nor the value may ever be
    fetched from the memo (no other field shares either string object). The value's record is replaced and the
    enclosing frame's length adjusted. None where any of that does not hold, or above :data:`RENAME_MAX_BYTES`: the
    caller unpickles instead."""
    if len(data) > RENAME_MAX_BYTES or not isinstance(checkpoint_id, str):
        return None
    memo_count = 0
    strings: dict[int, str] = {}  # memo index -> text, for memoized text records (a global's module and name)
    recent: list[str | None] = [None, None]  # the last two strings pushed: STACK_GLOBAL's module and name
    global_at = -(1 << 30)  # the op count at the last StorageMeta global
    count = 0
    fetched: set[int] = set()
    keys = 0
    seq: list[tuple[str, object, int]] = []  # the ops after the key (memo stores and frames left out), up to 3
    stores: dict[int, int] = {}  # the key's and the value's position -> the memo index stored right after it
    last: tuple[str, object, int] | None = None  # the previous op that was neither a frame nor a memo store
    frame = (-1, -1)  # (position, end) of the latest frame
    value_frame = (-1, -1)
    value_end = -1  # where the op after the value starts (0: the value is the last op seen)
    try:
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            if value_end == 0:
                value_end = pos
            if name == "FRAME":
                frame = (pos, pos + 9 + int(arg))  # type: ignore[arg-type]
                continue
            if name == "MEMOIZE" or name in _PUT_OPS:
                index = memo_count if name == "MEMOIZE" else int(arg)  # type: ignore[arg-type]
                memo_count += name == "MEMOIZE"
                if last is not None and last[0] in _TEXT_OPS:
                    strings[index] = last[1]  # type: ignore[assignment]
                    if seq and last[2] in (seq[0][2], seq[-1][2]):
                        stores[last[2]] = index
                continue
            count += 1
            if name in _GET_OPS:
                fetched.add(int(arg))  # type: ignore[arg-type]
                recent = [recent[1], strings.get(int(arg))]  # type: ignore[arg-type]
            elif name in _TEXT_OPS:
                recent = [recent[1], arg]  # type: ignore[list-item]
            if recent == _STORAGE_META if name == "STACK_GLOBAL" else name == "GLOBAL" and arg == _STORAGE_META_GLOBAL:
                global_at = count
            if name in _TEXT_OPS and arg == "checkpoint_id":
                keys += 1
                seq = [(name, arg, pos)] if count - global_at <= _OPS_TO_STATE else []
            elif 0 < len(seq) < 3:
                seq.append((name, arg, pos))
                if len(seq) == 2:
                    value_frame, value_end = frame, 0
            last = (name, arg, pos)
            if name == "STOP":
                break
    except Exception:
        return None
    if keys != 1 or len(seq) != 3:
        return None
    key, value, after = seq
    after_text = after[1] if after[0] in _TEXT_OPS else strings.get(after[1]) if after[0] in _GET_OPS else None  # type: ignore[arg-type]
    if value[0] not in _TEXT_OPS or after_text != "save_id" or value_end <= 0:
        return None
    if stores.get(key[2]) in fetched or stores.get(value[2]) in fetched:
        return None
    start, end = value[2], value_end
    text = checkpoint_id.encode("utf-8", "surrogatepass")  # as pickle writes a str
    record = pickle.BINUNICODE + struct.pack("<I", len(text)) + text  # valid in every binary protocol
    out = bytearray(data[:start] + record + data[end:])
    at, frame_end = value_frame
    if at >= 0 and start < frame_end:  # the record lies in that frame
        (length,) = struct.unpack_from("<Q", data, at + 1)
        struct.pack_into("<Q", out, at + 1, length + len(record) - (end - start))
    return bytes(out)
