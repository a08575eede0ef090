"""Host-to-device copies from unpinned memory through a small pinned ring: a fresh process's restart.

A process restarting from the memory tier has no pinned memory yet, and its checkpoint is a mapped
file of a RAM filesystem. Measured on the H200 (a fully written 4 GiB file, a fresh process each):
registering the mapping piece by piece pins its pages in the driver at 9.5 GB/s (one thread) to
11.3 GB/s (four); copies straight from the pageable mapping reach 4.8-5.5 GB/s. Copying each 8 MiB
piece on the CPU into a pinned buffer and from there to the device, double-buffered, on 8 pairs
of buffers with a stream each: **17.3 GB/s, pinning the 128 MiB ring included** (0.05 s); 16 pairs
were slower (14.4 GB/s). Through the reader (``h2d="ring"``: 16 read threads, each chunk checksummed
on the mapping first, the 1,422 tensors of the bench state) a fresh process's first load of 4 GiB
reached 5.7 GB/s; with each CPU copy one ``memmove`` (``transfer.hostcopy``) 8.6 GB/s (16 threads)
to 8.9 (8), and 8.8 without checksums. Reading into pinned slots (``bounce``) went 16-19.5 GB/s, so
the ring stays an explicit mode.

Owns: the ring's pinned buffers (pinned whatever ``staging.pin`` says: the ring is for GPU targets),
one CUDA stream and two events per pair. Callers lease a pair per chunk of work; :meth:`RingPair.copy`
returns once its copies have completed (the pair is then free for anyone).
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator, Sequence

import torch

from cpuckpt.errors import CheckpointTimeoutError
from cpuckpt.transfer.hostcopy import copy_host_bytes

__all__ = ["PAIRS", "PIECE_BYTES", "PinnedRing", "RingPair"]

PIECE_BYTES = 8 << 20
PAIRS = 8


class RingPair:
    """Two pinned pieces and a stream: while one piece's host-to-device copy runs, the CPU fills the other."""

    def __init__(self, pieces: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> None:
        self.pieces = pieces
        self.stream = torch.cuda.Stream(device=device)
        # after the kernels already queued that may still write the targets (as DeviceCopier)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self._events = (torch.cuda.Event(), torch.cuda.Event())  # the last copy out of each piece

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> int:
        """Copy each host ``src`` (uint8, any memory) into its device ``dst`` (uint8, same length); returns
        the bytes copied once every copy has completed (also when it raises: no copy outlives the call)."""
        piece = self.pieces[0].numel()
        k = done = 0
        try:
            with torch.cuda.stream(self.stream):  # one stream switch per call (~50 µs each on the H200)
                for dst, src in zip(dsts, srcs, strict=True):
                    for off in range(0, src.numel(), piece):
                        n = min(piece, src.numel() - off)
                        buf = self.pieces[k % 2][:n]
                        if k >= 2:
                            self._events[k % 2].synchronize()  # that piece's previous copy has left the buffer
                        copy_host_bytes(buf, src[off : off + n])  # this thread only (see hostcopy)
                        dst[off : off + n].copy_(buf, non_blocking=True)
                        self._events[k % 2].record(self.stream)
                        k += 1
                        done += n
        finally:
            self.stream.synchronize()
        return done


class PinnedRing:
    """``pairs`` :class:`RingPair` of ``piece_bytes`` pieces for ``device``, pinned in one allocation."""

    def __init__(self, device: torch.device, pairs: int = PAIRS, piece_bytes: int = PIECE_BYTES) -> None:
        self.device = device
        self._memory = torch.empty(pairs * 2 * piece_bytes, dtype=torch.uint8, pin_memory=True)
        self._free: queue.SimpleQueue[RingPair] = queue.SimpleQueue()
        for i in range(pairs):
            a = self._memory[2 * i * piece_bytes : (2 * i + 1) * piece_bytes]
            b = self._memory[(2 * i + 1) * piece_bytes : (2 * i + 2) * piece_bytes]
            self._free.put(RingPair((a, b), device))

    @contextlib.contextmanager
    def lease(self, timeout_s: float) -> Iterator[RingPair]:
        """A free pair for the block (at most ``pairs`` copy at once: more were slower)."""
        try:
            pair = self._free.get(timeout=timeout_s)
        except queue.Empty:
            raise CheckpointTimeoutError(f"no pinned ring pair free within {timeout_s:.0f} s") from None
        try:
            yield pair
        finally:
            self._free.put(pair)
