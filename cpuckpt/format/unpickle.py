"""Restricted unpickling: DCP ``.metadata``, and the non-tensor values of a checkpoint.

``.metadata`` resolves only DCP's metadata classes, torch dtypes and plain containers
(:func:`unpickle_metadata`). Non-tensor values (``BYTE_IO`` items: ``torch.save(value)`` bytes, as
DCP's planner and our writer store them) load with ``torch.load(weights_only=True)`` semantics
(:func:`load_value`): torch's own allow-list, whatever the process added with
``torch.serialization.add_safe_globals``/``safe_globals``, and :data:`EXTRA_SAFE_GLOBALS`; only
``integrity.trusted`` unpickles them with full pickle. Stock DCP's planner would run any pickled
code in them (``DefaultLoadPlanner.load_bytes`` is ``torch.load(weights_only=False)``).

Pure: no I/O. Loading an untrusted checkpoint must never run pickled code.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import io
import logging
import pathlib
import pickle
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.distributed.checkpoint.planner as dcp_planner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from cpuckpt.errors import CheckpointCorrupt, UnsafeCheckpointError

__all__ = ["EXTRA_SAFE_GLOBALS", "load_value", "reencode", "unpickle_metadata", "with_safe_globals"]

logger = logging.getLogger(__name__)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}
# DCP's metadata classes, and its plan classes: megatron-core stores every rank's SavePlan in
# ``.metadata`` (``all_local_plans``) to reuse the global metadata on the next save.
for _module in (dcp_metadata, dcp_planner):
    for _name in dir(_module):
        _obj = getattr(_module, _name)
        if isinstance(_obj, type) and getattr(_obj, "__module__", "") == _module.__name__:
            _ALLOWED[(_module.__name__, _name)] = _obj
# megatron-core's own plan/metadata dataclasses, resolved only if a checkpoint names them.
_LAZY_ALLOWED = {("megatron.core.dist_checkpointing.strategies.torch", n) for n in ("MCoreSavePlan", "MCoreMetadata")}


_IMMUTABLE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: nothing can set an attribute of such a type (torch.Size, set, ...)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata classes, torch dtypes and a few plain containers; the C unpickler.

    Allowed globals are not enough: BUILD sets attributes on whatever the stack holds, and a pickle can put an
    allowed class or function there itself (``pathlib.PurePosixPath``, then BUILD with ``{"is_absolute": set}``):
    every later use of that class in the process would be changed, e.g. the reader's refusal of data files outside
    the checkpoint. The C unpickler has no hook at BUILD, so the allowed globals that can be changed (Python classes,
    functions) are never handed to it: each load gets stand-ins of its own (:func:`_stand_in`) that build the real
    objects, and whatever a pickle does to a stand-in ends with the load.
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._stand_ins: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        obj = _ALLOWED.get(key)
        if obj is None and key in _LAZY_ALLOWED:
            obj = getattr(importlib.import_module(module), name)
        if obj is not None:
            if key not in self._stand_ins:
                self._stand_ins[key] = _stand_in(obj)
            return self._stand_ins[key]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value  # no attribute of theirs can be set
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("checkpoint metadata holds a persistent id: refused")


def _stand_in(obj: Any) -> Any:
    """What the unpickler hands out for the allowed global ``obj``: ``obj`` itself where nothing can change it (an
    immutable type), else an object of this load only that makes what ``obj`` makes. A class becomes a subclass
    whose construction, by NEWOBJ (``cls.__new__(cls, *args)``, how dataclasses are pickled) or by REDUCE
    (``cls(*args)``), returns an instance of the real class; an enum class or a function becomes a partial of it."""
    if isinstance(obj, type):
        if obj.__flags__ & _IMMUTABLE:
            return obj
        if issubclass(obj, enum.Enum):  # cannot be subclassed; REDUCE alone makes its members
            return functools.partial(obj)
        real = obj

        def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
            return real.__new__(real, *args, **kwargs) if real.__new__ is not object.__new__ else object.__new__(real)

        meta = type(f"{real.__name__}StandInType", (type(real),),
                     {"__call__": lambda cls, *args, **kwargs: real(*args, **kwargs)})
        return meta(real.__name__, (real,), {"__new__": __new__, "__module__": real.__module__,
                                             "__qualname__": real.__qualname__, "__slots__": ()})
    return functools.partial(obj)


# The allowed enums' members: shared objects a pickle reaches through its class (REDUCE returns the member itself), and
# whose attributes or class BUILD could set (``_value_``: every later save would pickle a value no load accepts). Their
# state as imported is the baseline every unpickling is checked against (and restored to) under one lock: two loads
# in two threads must not take each other's changes for the baseline.
_ENUM_BASELINE = [(m, type(m), dict(vars(m))) for v in _ALLOWED.values()
                  if isinstance(v, type) and issubclass(v, enum.Enum) for m in v]
_ENUM_LOCK = threading.Lock()


def unpickle_metadata(data: bytes) -> Any:
    """Unpickle ``data`` resolving only the allowed globals, changing nothing outside what it builds.

    Raises:
        pickle.UnpicklingError: it names a global outside the allowed set, or it changed a member of an allowed enum
            (restored before this raises).
    """
    with _ENUM_LOCK:
        try:
            return _MetadataUnpickler(io.BytesIO(data)).load()
        finally:
            changed = [(m, cls, state) for m, cls, state in _ENUM_BASELINE if type(m) is not cls or vars(m) != state]
            for m, cls, state in changed:
                object.__setattr__(m, "__class__", cls)
                vars(m).clear()
                vars(m).update(state)
            if changed:
                raise pickle.UnpicklingError("checkpoint metadata changes a member of an allowed enum: refused")


# -- non-tensor values ---------------------------------------------------------------------------

# Globals allowed beyond torch's weights_only defaults, by ``module.name`` as a pickle names them;
# each resolved only when a value names it (importing numpy is never forced). Why each one:
# - numpy arrays, dtypes and scalars (numpy 2 names ``numpy._core``, numpy 1 ``numpy.core``): the
#   RNG state that megatron-core's sharded state dict saves (``np.random.get_state()`` holds an
#   ndarray), and plain user values. ``_reconstruct`` only makes an empty array of an allowed class
#   (``ndarray``); its ``__setstate__`` takes raw bytes, or for object arrays objects that went
#   through this same filter. The numpy.dtypes classes are what ``np.dtype(...)`` returns: the
#   weights_only unpickler checks the built object's class before ``__setstate__``.
_EXTRA_NAMES: tuple[str, ...] = tuple(
    f"{core}.multiarray.{name}" for core in ("numpy._core", "numpy.core") for name in ("_reconstruct", "scalar")
) + ("numpy.ndarray", "numpy.dtype")
EXTRA_SAFE_GLOBALS = frozenset(_EXTRA_NAMES)

_extra_lock = threading.Lock()  # torch's allow-list is process-wide: one temporary widening at a time


def _resolve_extra(names: set[str]) -> list[Any] | None:
    """The objects to allow for ``names`` (each in :data:`EXTRA_SAFE_GLOBALS`); None if one does not resolve."""
    out: list[Any] = []
    for full in names:
        module, _, name = full.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            return None
    if any(n.startswith("numpy.") for n in names):
        with contextlib.suppress(ImportError):  # numpy < 1.25 has no numpy.dtypes (nor dtype classes to allow)
            dtypes = importlib.import_module("numpy.dtypes")
            out.extend(c for c in (getattr(dtypes, n, None) for n in getattr(dtypes, "__all__", ()))
                       if isinstance(c, type))
    return out


def _unsafe_globals(data: bytes) -> list[str]:
    """The globals ``data`` names that the weights_only unpickler would refuse (a static scan, runs nothing)."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception:  # not a torch.save zip, or a pickle the scanner cannot walk: no names to report
        return []


_WO_REASON = re.compile(r"WeightsUnpickler error: (.*?)(?:\n|$)", re.S)


_ZIP_MAGIC = b"PK\x03\x04"


def _is_refusal(err: BaseException) -> bool:
    """True when ``err`` is the weights_only unpickler refusing something, not damaged bytes."""
    return isinstance(err, pickle.UnpicklingError) and str(err).startswith("Weights only load failed")


def _refusal(err: BaseException) -> str:
    """torch's one-line reason from a weights_only refusal (its message also offers weights_only=False)."""
    m = _WO_REASON.search(str(err))
    return (m.group(1) if m else str(err).splitlines()[0] if str(err) else type(err).__name__).strip()


def with_safe_globals(load: Callable[[], Any], extras: list[Any]) -> Any:
    """``load()`` with ``extras`` added to torch's allow-list for the call: only those it lacks, removed after
    (``torch.serialization.safe_globals`` alone would also remove, on exit, entries the user had added before)."""
    with _extra_lock:
        present = set(torch.serialization.get_safe_globals())
        with torch.serialization.safe_globals([g for g in extras if g not in present]):
            return load()


def load_value(data: bytes, key: str, *, trusted: bool = False, where: str = "") -> Any:
    """Decode one non-tensor value (``torch.save`` bytes) without running code the checkpoint names.

    ``weights_only`` semantics (torch's defaults, the process's ``add_safe_globals``/``safe_globals``)
    plus :data:`EXTRA_SAFE_GLOBALS`; ``trusted`` unpickles with full pickle, as stock DCP does.
    Tensors come back on the device they were saved from, as with DCP's ``load_bytes``.
    ``where`` (the checkpoint's path) and ``key`` (the state-dict key) go into error messages.

    Raises:
        UnsafeCheckpointError: the value names a global outside the allowed set (the message names
            the key, the globals and how to allow them). Nothing of the value's own code ran.
        CheckpointCorrupt: the bytes are not a loadable ``torch.save`` value.
    """
    place = f"{where}: " if where else ""
    if trusted:
        try:
            return torch.load(io.BytesIO(data), weights_only=False)
        except Exception as e:
            raise CheckpointCorrupt(f"{place}non-tensor value {key!r} does not load: {e}") from e

    if bytes(data[:4]) != _ZIP_MAGIC:  # torch.save writes a zip; anything else would take torch's legacy path
        raise CheckpointCorrupt(f"{place}non-tensor value {key!r} is not a loadable torch.save value "
                                f"(no zip archive; {len(data)} bytes)")

    def safe() -> Any:
        return torch.load(io.BytesIO(data), weights_only=True)

    try:
        return safe()
    except Exception as e:
        if not _is_refusal(e):
            raise CheckpointCorrupt(f"{place}non-tensor value {key!r} is not a loadable torch.save value: "
                                    f"{type(e).__name__}: {e}") from e
        refused, first = _unsafe_globals(data), e
    if set(refused) <= EXTRA_SAFE_GLOBALS:
        # None refused by name: a class built at load time was refused (numpy's dtype classes, when another
        # library allowed ``numpy.dtype`` itself, as megatron-core does on import): allow numpy's classes.
        extras = _resolve_extra(set(refused) or {"numpy.ndarray", "numpy.dtype"})
        if extras is not None:
            try:
                return with_safe_globals(safe, extras)
            except Exception as e:
                if not _is_refusal(e):
                    raise CheckpointCorrupt(f"{place}non-tensor value {key!r} is not a loadable torch.save value: "
                                            f"{type(e).__name__}: {e}") from e
                refused, first = _unsafe_globals(data), e
    names = [n for n in refused if n not in EXTRA_SAFE_GLOBALS] or refused
    what = ", ".join(names) if names else _refusal(first)
    hint = f"torch.serialization.add_safe_globals([{', '.join(n.rpartition('.')[2] for n in names)}])" if names \
        else "torch.serialization.add_safe_globals([...])"
    raise UnsafeCheckpointError(
        f"{place}non-tensor value {key!r} was not loaded: it names {what}, which a safe load does not allow "
        f"(unpickling it could run code). If you trust this checkpoint (you wrote it), allow the class with "
        f"{hint} before loading, or set integrity.trusted: true (env CPUCKPT_INTEGRITY_TRUSTED=1) to unpickle "
        f"non-tensor values with full pickle.", key=key, names=names) from first


def reencode(value: Any) -> io.BytesIO:
    """``torch.save(value)`` into a rewound stream: a safely loaded value, for a planner's ``load_bytes``.

    A planner unpickles what it is handed with full pickle (DCP's ``load_bytes``); bytes re-encoded
    from a value built by :func:`load_value` name only globals that it allowed.
    """
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf
