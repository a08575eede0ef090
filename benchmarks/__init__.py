"""cpuckpt's benchmarks: run each as a module from the repository root, e.g.
``python -m benchmarks.bench_cpu --smoke`` (or ``cpuckpt bench --smoke``). Shared helpers live in
:mod:`benchmarks.common`. Not part of the installed package.
"""
