"""Zero-stall saves (``ordering: optimizer``) and the warm first save (``prepare_pool``) for DeepSpeed.

DeepSpeed's ``CheckpointEngine.save()`` is synchronous by contract: once it returns, DeepSpeed and
the trainer may change every tensor they handed over, and nothing in that interface lets the engine
ask for its next writes to wait. So, with ``ordering: optimizer``, the engine's own ``save()``
returns once the device-to-host copies are *enqueued*, and :func:`order_engine_steps` wraps
``DeepSpeedEngine.step`` and ``DeepSpeedEngine._take_model_step`` (class-level, once, no source
changes) so that the first kernel that may write a saved tensor after the save is queued behind the
copies: a GPU-side wait (:meth:`cpuckpt.transfer.staging.CopyFence.order` on the current stream),
never a host block. The same hooks size the checkpoint after the first optimizer step and prepare the
host pool in a background thread (:func:`cpuckpt.api.prepare_pool_in_background`).

What writes saved tensors between ``save_checkpoint`` and the next optimizer update, and how each is
covered:

- the forward: module buffers (BatchNorm running statistics, ``num_batches_tracked``) are written
  in place. They are small, so :func:`snapshot_buffers` clones them at save time on the current
  stream (the copies read the clones);
- the backward: writes gradients (never saved) and, with ZeRO, gradient partitions (never saved);
- ``engine.step()`` at a gradient-accumulation boundary (or every ``step()`` with
  ``managed_gradient_accumulation: false`` or ZenFlow): the hook runs before DeepSpeed's own code in
  ``step()``, so before the unmanaged boundary's reductions, the decoupled commit, the optimizer
  update, ZeRO's copies from the fp32 master into the bf16/fp16 parameters, the loss scaler's update
  and the learning-rate scheduler. A managed non-boundary ``step()`` writes nothing saved and is left
  unordered (the next micro-batches keep overlapping the copies);
- ``_take_model_step`` (the pipeline engine's optimizer step calls it directly, without ``step()``):
  ordered again (a no-op when ``step()`` already did).

The copies are paced from the trainer's module calls (:mod:`cpuckpt.transfer.pacing`): by the step most
are done, and ordering enqueues the rest. The optimizer's kernels wait for the copies, or for the device
snapshot (``staging.device_snapshot``), on the GPU.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["bind_at_save", "buffer_pointers", "estimate_checkpoint_bytes", "estimate_file_bytes", "order_engine_steps",
           "reserve_when_built", "snapshot_buffers"]

logger = logging.getLogger(__name__)

_HOOKED = ("step", "_take_model_step")


def _checkpoint_engine(ds_engine: Any) -> Any:
    """The DeepSpeed engine's checkpoint engine when it is ours (has the hooks), else None."""
    ck = vars(ds_engine).get("checkpoint_engine")  # not getattr: DeepSpeedEngine.__getattr__ falls back to the module
    return ck if hasattr(ck, "before_optimizer_writes") else None


def _boundary(ds_engine: Any) -> bool:
    """Whether this ``step()`` may write saved state (see the module docstring); True when unsure."""
    try:
        if getattr(ds_engine, "zenflow", False):
            return True
        managed = getattr(ds_engine, "managed_gradient_accumulation", None)
        if managed is not None and not managed():
            return True
        return bool(ds_engine.is_gradient_accumulation_boundary())
    except Exception:  # another DeepSpeed version: order every step rather than miss one
        return True


def _wrap_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        ck = _checkpoint_engine(self)
        if ck is None:
            return original(self, *args, **kwargs)
        ck.bind(self)
        if not _boundary(self):
            return original(self, *args, **kwargs)
        ck.before_optimizer_writes(self)  # a GPU-side wait: the host does not block
        result = original(self, *args, **kwargs)
        ck.after_boundary_step(self)  # the commit this step requested, before the trainer logs it (if asked)
        return result

    step._cpuckpt_ordered = True  # type: ignore[attr-defined]
    return step


def _wrap_take_model_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _take_model_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        ck = _checkpoint_engine(self)
        if ck is None:
            return original(self, *args, **kwargs)
        ck.bind(self)
        ck.before_optimizer_writes(self)
        result = original(self, *args, **kwargs)
        ck.after_optimizer_step(self)  # the optimizer's state exists now: size the checkpoint
        return result

    _take_model_step._cpuckpt_ordered = True  # type: ignore[attr-defined]
    return _take_model_step


def _wrap_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        ck = _checkpoint_engine(self)
        if ck is not None:
            ck.bind(self)  # the memory tier across nodes chooses who writes the model states (engine.create)
        return original(self, *args, **kwargs)

    save_checkpoint._cpuckpt_ordered = True  # type: ignore[attr-defined]
    return save_checkpoint


_LOCK = threading.Lock()


def order_engine_steps(base: type | None = None) -> list[str]:
    """Wrap ``step`` and ``_take_model_step`` of ``base`` (default: DeepSpeed's ``DeepSpeedEngine``).

    Idempotent. The wrappers cost one dictionary look-up per call for engines whose checkpoint
    engine is not cpuckpt's. Returns the names wrapped (or found wrapped).
    """
    if base is None:
        from deepspeed.runtime.engine import DeepSpeedEngine as base
    names: list[str] = []
    with _LOCK:
        for name, wrap in zip(_HOOKED, (_wrap_step, _wrap_take_model_step)):
            fn = base.__dict__.get(name)
            if fn is None:
                logger.warning("cpuckpt: %s has no %s(): saves with ordering optimizer are not ordered there; "
                               "this DeepSpeed is newer or older than cpuckpt knows", base.__qualname__, name)
                continue
            if not getattr(fn, "_cpuckpt_ordered", False):
                setattr(base, name, wrap(fn))
            names.append(name)
    return names


def _wrap_configure_checkpointing(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _configure_checkpointing(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        ck = _checkpoint_engine(self)
        if ck is not None:
            ck.engine_built(self)  # its optimizer and checkpoint roles are set: memory_save_dir reserves the slots
        return result

    _configure_checkpointing._cpuckpt_ordered = True  # type: ignore[attr-defined]
    return _configure_checkpointing


def reserve_when_built(base: type | None = None) -> None:
    """Wrap ``_configure_checkpointing`` of ``base`` (default: DeepSpeed's ``DeepSpeedEngine``), the step of
    ``deepspeed.initialize`` that makes the checkpoint engine, so that cpuckpt's engine then sees the built engine
    (``engine_built``: ``memory_save_dir`` reserves the memory tier's slots before training). Idempotent; a
    DeepSpeed without that method is a warning (the first saves make the slots' images then)."""
    if base is None:
        from deepspeed.runtime.engine import DeepSpeedEngine as base
    with _LOCK:
        fn = base.__dict__.get("_configure_checkpointing")
        if fn is None:
            logger.warning("cpuckpt: %s has no _configure_checkpointing(): memory_save_dir cannot reserve the slots "
                           "before training; the first saves make them", base.__qualname__)
        elif not getattr(fn, "_cpuckpt_ordered", False):
            base._configure_checkpointing = _wrap_configure_checkpointing(fn)


def bind_at_save(base: type | None = None) -> None:
    """Wrap ``save_checkpoint`` of ``base`` (default: DeepSpeed's ``DeepSpeedEngine``) so that it first binds the
    engine to cpuckpt's checkpoint engine (``bind``): the memory tier across nodes chooses, per checkpoint, which
    ranks write the model states (``engine.create``). Idempotent."""
    if base is None:
        from deepspeed.runtime.engine import DeepSpeedEngine as base
    with _LOCK:
        fn = base.__dict__.get("save_checkpoint")
        if fn is not None and not getattr(fn, "_cpuckpt_ordered", False):
            base.save_checkpoint = _wrap_save_checkpoint(fn)


def buffer_pointers(module: Any) -> set[tuple[int, tuple[int, ...]]]:
    """(data pointer, shape) of every non-empty buffer of ``module``: what :func:`snapshot_buffers` clones."""
    return {(b.data_ptr(), tuple(b.shape)) for b in module.buffers() if b is not None and b.numel()}


def snapshot_buffers(state: Mapping[str, Any], buffers: set[tuple[int, tuple[int, ...]]]) -> Mapping[str, Any]:
    """``state`` with the module's buffers replaced by clones made now, on the current stream.

    A buffer is recognised by its data pointer and shape (``buffers``, from :func:`buffer_pointers`)
    or, in DeepSpeed's model states file, by name (its ``buffer_names`` key lists the entries of its
    ``module`` mapping). The top level and the ``module`` mapping are searched (DeepSpeed's model
    states, and the pipeline engine's per-layer files, which are a module state dict). Changed
    mappings are shallow copies (``copy.copy``: their type and attributes such as a state dict's
    ``_metadata`` stay, so the file's bytes are those ``torch.save`` would write); ``state`` itself
    is not modified.
    """
    import copy

    names = state.get("buffer_names")
    named = set(names) if isinstance(names, (list, tuple)) else set()

    def clone_in(m: Mapping[str, Any], by_name: set[str]) -> Mapping[str, Any]:
        out: Any = None
        for k, v in m.items():
            if isinstance(v, torch.Tensor) and v.numel() and (
                    k in by_name or (v.data_ptr(), tuple(v.shape)) in buffers):
                if out is None:
                    out = copy.copy(m)
                out[k] = v.detach().clone()  # enqueued before the save's copies, which wait for this stream
        return m if out is None else out

    result = clone_in(state, set())
    module = state.get("module")
    if isinstance(module, Mapping):
        new = clone_in(module, named)
        if new is not module:
            result = copy.copy(result) if result is state else result
            result["module"] = new  # type: ignore[index]
    return result


def estimate_checkpoint_bytes(ds_engine: Any, *, chunk_bytes: int, storage_alignment: int) -> int:
    """This rank's checkpoint image bytes for ``ds_engine``, from its live tensors (slightly over).

    Counts the module's parameters (when this rank writes the model states file; ZeRO-3's partitioned
    parameters are empty there) and buffers, the wrapped optimizer's parameters (ZeRO / bf16 / fp16:
    the fp32 master partitions; plain fp32: the module's parameters, counted once) and its state
    tensors (Adam's moments; before the first step, Adam's two fp32 moments and step are assumed).
    Adds each tensor's alignment and pickle record, and a partial chunk per file.
    """
    model, optim = _file_parts(ds_engine)
    module = ds_engine.module
    nfiles = 2 + len(getattr(module, "forward_funcs", ()) or ())  # model + optimizer states (+ pipeline layers)
    nbytes = model[0] + optim[0] + (model[1] + optim[1]) * (storage_alignment + 512) + nfiles * chunk_bytes
    return int(nbytes * 1.02)


def estimate_file_bytes(ds_engine: Any, save_dir: str, *, chunk_bytes: int, storage_alignment: int) -> dict[str, int]:
    """The files this rank writes into a tag of ``save_dir`` and each one's image bytes (slightly over, as
    :func:`estimate_checkpoint_bytes`): the model states file (where this rank writes it; without ZeRO with the
    optimizer's state in it) and the optimizer states file (where this rank writes one), named by DeepSpeed
    itself. Empty where the engine's layout is not these two files (pipeline layers, MoE experts): those files
    are made by the first save."""
    if getattr(ds_engine.module, "forward_funcs", None) or getattr(ds_engine, "has_moe_layers", False):
        return {}
    model, optim = _file_parts(ds_engine)
    out = {}
    if getattr(ds_engine, "save_non_zero_checkpoint", True):
        # without ZeRO the model states file holds the optimizer's state dict too (DeepSpeed's
        # _common_checkpoint_state: optimizer=... if not zero_optimization())
        own = model if ds_engine.zero_optimization() else (model[0] + optim[0], model[1] + optim[1])
        out[os.path.basename(ds_engine._get_ckpt_name(save_dir, "tag"))] = own
    if getattr(ds_engine, "save_zero_checkpoint", False):  # set where this rank writes a ZeRO/bf16 optimizer file
        out[os.path.basename(ds_engine._get_zero_ckpt_name(save_dir, "tag"))] = optim
    return {name: int((b + n * (storage_alignment + 512) + chunk_bytes) * 1.02) for name, (b, n) in out.items()}


def _file_parts(ds_engine: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """(bytes, tensors) of the model states' tensors (the module's parameters where this rank writes them, its
    buffers) and of the optimizer states' (master parameters and their state; Adam's assumed before a step),
    each storage counted once."""
    seen: set[int] = set()

    def count(tensors: Iterable[Any]) -> tuple[int, int]:
        nbytes = n = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            nbytes += t.numel() * t.element_size()
            n += 1
        return nbytes, n

    module = ds_engine.module
    params = list(module.parameters()) if getattr(ds_engine, "save_non_zero_checkpoint", True) else []
    model = count([*params, *module.buffers()])
    opt = getattr(ds_engine, "optimizer", None)
    base = getattr(opt, "optimizer", opt) if opt is not None else None
    groups = getattr(base, "param_groups", None) or []
    masters = [p for g in groups for p in g.get("params", [])]
    b, n = count(masters)
    states = [v for st in getattr(base, "state", {}).values() if isinstance(st, Mapping) for v in st.values()]
    if any(isinstance(v, torch.Tensor) for v in states):
        sb, sn = count(states)
        b, n = b + sb, n + sn
    else:  # no step yet: Adam-like, two fp32 moments and a step per master (an overestimate for SGD)
        b += sum(2 * 4 * p.numel() + 8 for p in masters if isinstance(p, torch.Tensor))
        n += 3 * len(masters)
    return model, (b, n)
