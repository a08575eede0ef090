"""The memory tier: checkpoints committed in a node-local RAM root, persisted by a writer process."""
