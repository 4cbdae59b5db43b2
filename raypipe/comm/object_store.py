"""Activations and gradients through Ray's object store: a stage returns its
tensor, Ray stores it and resolves the reference as the next op's argument.
Works on CPUs and GPUs with nothing to set up."""
from __future__ import annotations

from typing import Any


class ObjectStoreTransport:
    """The per-op executor's default transport; the base of the direct ones."""

    name = "object_store"
    tensor_transport: str | None = None  # the workers' forward/backward results go by Ray's object store

    def connect(self, actors: list[Any]) -> None:
        """Prepare the actors for transfers (nothing to do for the object store)."""

    def close(self, actors: list[Any]) -> None:
        """Release what :meth:`connect` set up."""
