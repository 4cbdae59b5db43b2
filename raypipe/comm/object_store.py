"""Activations and gradients through Ray's object store: a stage returns its
tensor, Ray stores it and resolves the reference as the next op's argument.
Works on CPUs and GPUs with nothing to set up."""
from __future__ import annotations

from typing import Any

import ray


class ObjectStoreTransport:
    """The per-op executor's default transport; the base of the direct ones."""

    name = "object_store"
    tensor_transport: str | None = None  # the workers' forward/backward results go by Ray's object store

    def connect(self, actors: list[Any]) -> None:
        """Prepare the actors for transfers (nothing to do for the object store)."""

    def close(self, actors: list[Any]) -> None:
        """Release what :meth:`connect` set up."""


class ByReference:
    """A task's input passed as its object reference, which the task fetches itself
    (:func:`fetched`), where Ray would resolve a bare reference before it sends the task. Ray
    sends one caller's tasks to an actor in order, so a task waiting for its argument holds back
    every later call to that actor, its heartbeats too: while the input's producer hangs, the
    waiting worker would be found hung as well and replaced for nothing."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any) -> None:
        self.ref = ref


def fetched(value: Any) -> Any:
    """``value``, or what a :class:`ByReference` refers to (waited for here)."""
    return ray.get(value.ref) if isinstance(value, ByReference) else value
