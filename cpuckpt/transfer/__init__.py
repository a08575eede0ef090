"""Moving bytes: file syscalls (``files``), the pinned host pool and device copies (``staging``),
thread pools (``threads``), and one rank's staging-and-writing job (``save_job``).

Knows nothing of DCP, checkpoints or collectives.
"""
