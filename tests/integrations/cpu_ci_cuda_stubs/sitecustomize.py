"""Test fixture: apply the CPU-CI torch.cuda stubs in processes that megatron-core *spawns* (its
persistent checkpoint worker), which do not inherit the rank's patched torch. Active only with
CPU_CI_CUDA_STUBS=1 on PYTHONPATH; see cpu_ci_cuda_stubs.py. Applied when torch is first imported, so the
processes that never import it (the memory tier's writer processes) skip its ~1 CPU-s import."""

import os

if os.environ.get("CPU_CI_CUDA_STUBS") == "1":
    import cpu_ci_cuda_stubs

    cpu_ci_cuda_stubs.install_when_imported()  # not torch itself: a process that never imports it skips it
