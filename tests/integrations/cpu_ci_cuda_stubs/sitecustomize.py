"""Test fixture: apply the CPU-CI torch.cuda stubs in processes that megatron-core *spawns* (its
persistent checkpoint worker), which do not inherit the rank's patched torch. Active only with
CPU_CI_CUDA_STUBS=1 on PYTHONPATH; see cpu_ci_cuda_stubs.py."""

import os

if os.environ.get("CPU_CI_CUDA_STUBS") == "1":
    import cpu_ci_cuda_stubs

    cpu_ci_cuda_stubs.install()
