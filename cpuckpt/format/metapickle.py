"""``.metadata`` bytes of repeated saves: pickled once per structure and slot, then only the save id changes.

A memory tier commits a checkpoint every iteration. Its ``.metadata`` (DCP's :class:`Metadata`, pickled as DCP
writes it) describes every tensor, so pickling it costs ~10 µs per tensor (12 ms for 1,168 tensors on the CPU
box), on a committer thread that shares the trainer's interpreter. A save that reuses a cached plan commits the
same structure (the very same objects in every field but ``storage_data`` and ``storage_meta``, equal
``storage_data``) into the same directory, under a new save id of the same length: the previous bytes with that
one string record rewritten are a pickle of the new metadata. The id is pickled as an object of its own (so no
other field refers back to it), and where its record lies is read from the pickle's opcodes once, at the first
repeat (a save into a new directory never pays for it): the rewrite never touches another byte, and a same-length
ASCII id changes no opcode, length or memo index. Anything else — another structure or type, other storage data,
another directory, an id of another length, shorter than 2 or not ASCII — is pickled in full.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import pickle
import pickletools
import threading
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["MetadataPickles", "dumps_metadata"]

_PER_SAVE = ("storage_data", "storage_meta")  # the fields a save from a cached plan fills anew
_STRINGS = {"SHORT_BINUNICODE": 1, "BINUNICODE": 4, "BINUNICODE8": 8}  # opcode: bytes of its length field


@dataclass
class _Pickled:
    kind: type
    same: dict[str, Any]  # every other field, compared by identity (kept: no id is reused while the entry lives)
    storage_data: Any
    storage_meta: Any
    data: bytes
    id_at: int | None  # where the save id's text starts in ``data`` (None: not looked up yet)


class MetadataPickles:
    """The last pickled ``.metadata`` per (structure, directory), a few at most (one per memory slot)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._last: collections.OrderedDict[tuple[int, Any], _Pickled] = collections.OrderedDict()
        self.reused = 0  # saves whose bytes came from the previous one's

    def dumps(self, md: Metadata) -> bytes:
        """``pickle.dumps(md)``, from the previous save's bytes where only the save id changed."""
        meta = md.storage_meta
        save_id = getattr(meta, "save_id", None)
        if not (isinstance(save_id, str) and len(save_id) >= 2 and save_id.isascii()):
            return pickle.dumps(md)
        key = (id(md.state_dict_metadata), getattr(meta, "checkpoint_id", None))
        same = {k: v for k, v in vars(md).items() if k not in _PER_SAVE}
        with self._lock:
            last = self._last.get(key)
        if last is not None and self._repeats(last, md, same):
            old = last.storage_meta.save_id
            # where the id's record lies: read once, at the first repeat (a save into a new directory never pays it)
            at = last.id_at if last.id_at is not None else _id_record(last.data, old)
            if at is not None and len(old) == len(save_id):
                data = last.data[:at] + save_id.encode() + last.data[at + len(save_id):]
                with self._lock:
                    self.reused += 1
                    self._remember(key, dataclasses.replace(last, storage_data=md.storage_data, data=data, id_at=at,
                                                            storage_meta=dataclasses.replace(meta)))
                return data
        # the id as a str object of its own: pickle writes an object once and refers back to it
        own = copy.copy(md)
        own.storage_meta = dataclasses.replace(meta, save_id=save_id.encode().decode())
        data = pickle.dumps(own)
        with self._lock:
            self._remember(key, _Pickled(type(md), same, md.storage_data, dataclasses.replace(meta), data, None))
        return data

    @staticmethod
    def _repeats(last: _Pickled, md: Metadata, same: dict[str, Any]) -> bool:
        """``md`` differs from ``last``'s metadata in its save id only (identical objects elsewhere)."""
        return (type(md) is last.kind and same.keys() == last.same.keys()
                and all(v is last.same[k] for k, v in same.items())
                and dataclasses.replace(md.storage_meta, save_id=last.storage_meta.save_id) == last.storage_meta
                and last.storage_data == md.storage_data)

    def _remember(self, key: tuple[int, Any], entry: _Pickled) -> None:
        self._last[key] = entry
        self._last.move_to_end(key)
        while len(self._last) > self.size:
            self._last.popitem(last=False)


def _id_record(data: bytes, save_id: str) -> int | None:
    """Where the text of the one string record ``save_id`` starts in the pickle ``data`` (None: not exactly one)."""
    found = [pos + 1 + _STRINGS[op.name] for op, arg, pos in pickletools.genops(data)
             if op.name in _STRINGS and arg == save_id]
    return found[0] if len(found) == 1 else None


_PICKLES = MetadataPickles()  # keyed by any stream's structure objects: a few entries per process


def dumps_metadata(md: Metadata) -> bytes:
    """The process's :class:`MetadataPickles`: ``pickle.dumps(md)`` for a ``.metadata`` file."""
    return _PICKLES.dumps(md)
