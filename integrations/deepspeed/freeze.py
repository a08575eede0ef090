"""A state dict frozen when ``save()`` is called, laid out and staged after it returned (``ordering: optimizer``).

Laying a file out (pickling under ``torch.save``, the zip skeleton, the chunk plan) and enqueueing its
copies is Python: 30-50 ms for DeepSpeed's two files of a 1 B-parameter ZeRO-1 state on the H200
(450 tensors, 4,400 pickled objects), most of a zero-stall save's call. It reads the state dict, which
the trainer may change once ``save()`` returns: its containers, CPU tensors (step counters, offloaded
optimizer state) and mutable objects (the loss scaler). :func:`freeze` makes a copy the trainer cannot
reach, in one walk on the call path, so the rest can run on another thread:

- dicts and ordered dicts (with their attributes: a module state dict's ``_metadata``), lists and
  tuples: new containers;
- CUDA tensors (plain tensors and parameters): the same objects. The next optimizer step's GPU-side
  ordering covers them as before; the copies wait for an event recorded now, not for the stream at the
  time they are enqueued (which would also wait for the next forward and backward). A tensor that is not
  contiguous (or has a lazy conjugate or negative bit) is cloned contiguous now, on the current stream:
  the layout would otherwise make that copy later, on a stream the copies do not wait for;
- CPU plain tensors: clones (at most ``max_cpu_bytes`` in all; more is refused, and the caller copies
  them into the host pool on the call path as before);
- immutable values (numbers, strings, bytes, None, enum members, torch dtypes, devices, sizes, classes
  and functions): as they are;
- any other object: ``copy.deepcopy`` (DeepSpeed's loss scaler, ``argparse.Namespace``, tensor
  fragment addresses; tensors inside such an object are cloned by it).

Shared references stay shared (a memo, as ``copy.deepcopy`` keeps one), so ``torch.save`` of the copy
writes the bytes it would write for the original. Anything it cannot copy that way (a tensor subclass
or a storage, a CPU parameter, tensors on two CUDA devices, an object ``copy.deepcopy`` refuses)
raises :class:`NotFreezable`.
"""

from __future__ import annotations

import collections
import copy
import enum
import functools
import types
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Frozen", "NotFreezable", "freeze"]

_ATOMS = frozenset({int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
                    torch.layout, torch.memory_format, type, types.FunctionType, types.BuiltinFunctionType,
                    range, slice})
MAX_CPU_BYTES = 64 << 20  # CPU tensor bytes cloned at most; more stays on the call path (pool copies)


class NotFreezable(Exception):
    """The state holds something :func:`freeze` does not copy safely (the message says what)."""


@dataclass
class Frozen:
    """A private copy of a state dict; ``event`` marks, on ``device``'s current stream, the moment it was made."""

    state: Any
    device: torch.device | None  # the CUDA device of its GPU tensors (None: it has none)
    event: Any  # torch.cuda.Event recorded after the copy was made (None without GPU tensors)
    cpu_bytes: int  # bytes of the CPU tensors cloned


def freeze(state: Any, *, max_cpu_bytes: int = MAX_CPU_BYTES) -> Frozen:
    """Copy ``state`` as the module docstring says; raises :class:`NotFreezable`."""
    walker = _Walker(max_cpu_bytes)
    frozen = walker.copy(state)
    event = None
    if walker.device is not None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(walker.device))
    return Frozen(frozen, walker.device, event, walker.cpu_bytes)


@functools.cache
def _plain_class(cls: type) -> bool:
    """Instances pickle and copy as ``object`` does: ``copyreg.__newobj__(cls)`` plus their ``__dict__``
    (DeepSpeed's ``fragment_address`` dataclass, 220 per ZeRO-1 optimizer file, ``argparse.Namespace``)."""
    if cls.__new__ is not object.__new__ or not hasattr(cls, "__dict__") or any("__slots__" in vars(k)
                                                                               for k in cls.__mro__):
        return False
    same = {"__reduce_ex__": object.__reduce_ex__, "__reduce__": object.__reduce__,
            "__getstate__": getattr(object, "__getstate__", None), "__setstate__": None,
            "__deepcopy__": None, "__copy__": None, "__getnewargs__": None, "__getnewargs_ex__": None}
    return all(getattr(cls, name, None) is want for name, want in same.items())


class _Walker:
    def __init__(self, max_cpu_bytes: int) -> None:
        self.max_cpu_bytes = max_cpu_bytes
        self.cpu_bytes = 0
        self.device: torch.device | None = None
        self.memo: dict[int, Any] = {}
        self.keep: list[Any] = []  # originals stay alive while walking, so no id is reused

    def copy(self, obj: Any) -> Any:
        cls = type(obj)
        if cls in _ATOMS or isinstance(obj, enum.Enum):
            return obj
        done = self.memo.get(id(obj))
        if done is not None:
            return done
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            out = self._tensor(obj)
        elif cls is dict or cls is collections.OrderedDict:
            out = cls()
            self._remember(obj, out)
            for k, v in obj.items():
                out[self.copy(k)] = self.copy(v)
            for name, value in vars(obj).items() if cls is collections.OrderedDict else ():
                setattr(out, name, self.copy(value))
            return out
        elif cls is list:
            out = []
            self._remember(obj, out)
            out.extend(self.copy(v) for v in obj)
            return out
        elif cls is tuple:
            out = tuple(self.copy(v) for v in obj)
            if all(a is b for a, b in zip(out, obj)):
                out = obj  # nothing inside changed: the tuple itself (pickle memoizes it by identity)
        elif isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.storage.TypedStorage)):
            raise NotFreezable(f"a {cls.__qualname__} (only plain tensors and parameters are copied)")
        elif _plain_class(cls):  # its attributes are its pickle: copied as containers are (2x faster than deepcopy)
            out = object.__new__(cls)
            self._remember(obj, out)
            attrs = out.__dict__
            for name, value in vars(obj).items():
                attrs[name] = self.copy(value)
            return out
        else:
            try:
                out = copy.deepcopy(obj)
            except Exception as e:
                raise NotFreezable(f"a {cls.__qualname__} that copy.deepcopy refused: {e}") from e
        self._remember(obj, out)
        return out

    def _remember(self, obj: Any, out: Any) -> None:
        self.memo[id(obj)] = out
        self.keep.append(obj)

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            if self.device is None:
                self.device = t.device
            elif t.device != self.device:
                raise NotFreezable(f"CUDA tensors on {self.device} and {t.device}")
            if t.is_contiguous() and not t.is_conj() and not t.is_neg():
                return t
            # Laying it out would make it contiguous with a kernel on the stager's stream, which the copies
            # (waiting for the event of the call) would not wait for: made contiguous now, on this stream.
            if type(t) is not torch.Tensor:
                raise NotFreezable("a CUDA parameter that is not contiguous")
            return _compact_clone(t)
        if t.device.type != "cpu" or type(t) is not torch.Tensor:
            raise NotFreezable(f"a {type(t).__qualname__} on {t.device}")
        self.cpu_bytes += t.numel() * t.element_size()
        if self.cpu_bytes > self.max_cpu_bytes:
            raise NotFreezable(f"more than {self.max_cpu_bytes} bytes of CPU tensors")
        return _compact_clone(t)


def _compact_clone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t``'s values made now, ``requires_grad`` as ``t`` (what the file records)."""
    out = t.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    return out.requires_grad_(True) if t.requires_grad else out
