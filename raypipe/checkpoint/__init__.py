"""Saved training state: sharded per-layer checkpoints keyed by global layer
index, with a checksummed manifest (see :mod:`raypipe.checkpoint.store`)."""
