"""Framework adapters (Megatron-core, DeepSpeed), importable as ``cpuckpt.integrations``.

Each adapter is a thin module over the cpuckpt core; importing this package imports no framework.
"""
