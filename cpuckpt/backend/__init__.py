"""The DCP storage backend: ``StorageWriter``/``StorageReader``, the commit protocol, the DCP door's stager,
checkpoint collectives (gloo groups, errors raised alike on every rank), the in-flight registry, telemetry.
"""
