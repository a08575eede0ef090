"""``.metadata`` bytes of repeated saves: pickled once per structure and slot, then only the save id changes.

A memory tier commits a checkpoint every iteration. Its ``.metadata`` (DCP's :class:`Metadata`, pickled as DCP
writes it) describes every tensor, so pickling it costs ~10 µs per tensor (12 ms for 1,168 tensors on the CPU
box), on a committer thread that shares the trainer's interpreter. A save that reuses a cached plan commits the
same structure (the very ``state_dict_metadata`` and ``planner_data`` objects, equal ``storage_data``) into the
same directory, under a new save id of the same length: the previous bytes with that one string replaced are
a pickle of the new metadata (a same-length ``str`` changes no opcode, length or memo index; the id is pickled as
an object of its own, so no other field refers to it). Anything else — another structure, other storage data,
another directory, an id of another length or one whose text occurs more than once in the bytes — is pickled in
full.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import pickle
import threading
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["MetadataPickles", "dumps_metadata"]


@dataclass
class _Pickled:
    state_dict_metadata: Any  # kept, so that its id is not reused while the entry lives
    planner_data: Any
    storage_data: Any
    storage_meta: Any
    data: bytes


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
        key = (id(md.state_dict_metadata), getattr(meta, "checkpoint_id", None))
        with self._lock:
            last = self._last.get(key)
        if last is not None and isinstance(save_id, str):
            data = self._patched(last, md, save_id)
            if data is not None:
                with self._lock:
                    self.reused += 1
                    self._remember(key, dataclasses.replace(last, storage_data=md.storage_data,
                                                            storage_meta=dataclasses.replace(meta), data=data))
                return data
        if not isinstance(save_id, str):
            return pickle.dumps(md)
        # The save id as a str object of its own: pickle writes an object once and refers back to it, so an id
        # that were the same object as another string of the metadata would be replaced there too.
        own = copy.copy(md)
        own.storage_meta = dataclasses.replace(meta, save_id=save_id.encode().decode())
        data = pickle.dumps(own)
        with self._lock:
            self._remember(key, _Pickled(md.state_dict_metadata, md.planner_data, md.storage_data,
                                         dataclasses.replace(meta), data))
        return data

    @staticmethod
    def _patched(last: _Pickled, md: Metadata, save_id: str) -> bytes | None:
        old = getattr(last.storage_meta, "save_id", None)
        if not (isinstance(old, str) and len(old.encode()) == len(save_id.encode())
                and last.state_dict_metadata is md.state_dict_metadata and last.planner_data is md.planner_data
                and dataclasses.replace(md.storage_meta, save_id=old) == last.storage_meta
                and last.storage_data == md.storage_data):
            return None
        if last.data.count(old.encode()) != 1:  # an equal string elsewhere (pickled as its own object)
            return None
        return last.data.replace(old.encode(), save_id.encode())

    def _remember(self, key: tuple[int, Any], entry: _Pickled) -> None:
        self._last[key] = entry
        self._last.move_to_end(key)
        while len(self._last) > self.size:
            self._last.popitem(last=False)


_PICKLES = MetadataPickles()


def dumps_metadata(md: Metadata) -> bytes:
    """The process's :class:`MetadataPickles`: ``pickle.dumps(md)`` for a ``.metadata`` file."""
    return _PICKLES.dumps(md)
