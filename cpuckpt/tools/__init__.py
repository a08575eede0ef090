"""Tools around checkpoints, for people and scripts: the ``cpuckpt`` CLI, listing and describing
checkpoints (``catalog``), full verification, export to safetensors/torch, the config reference generator.

Nothing in the save/load path imports these.
"""
