"""GPU tests run as Megatron-LM runs: one hardware queue per device.

Megatron-LM requires ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (its communication overlap depends on it). With
one connection every stream's device-to-host copies share one queue, served in enqueue order, which is
what ``staging.d2h_window_bytes`` exists for (test_zero_stall_gpu's copy-window test). With CUDA's
default of 8, a stream from torch's pool may or may not share the trainer's queue, depending on which
of the pool's streams it got. Set here, at collection, before any test creates a CUDA context.
"""

import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
