"""One method called on every actor of a group, each with its own argument, over
a channel kept open between steps instead of an actor task per call.

Two channels implement :class:`WorkerCalls`: a connection from the driver to
each worker (:class:`~raypipe.runtime.direct_calls.DirectCalls`, the default)
and a Ray compiled graph (:class:`~raypipe.runtime.compiled_graph.CompiledCalls`).
Both answer each call on a thread of the worker's own, beside its actor tasks;
neither lets a result be polled, so whoever waits on :meth:`WorkerCalls.results`
watches the workers' heartbeats meanwhile and calls :meth:`WorkerCalls.interrupt`
on a failure.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any


class CallsBroken(Exception):
    """Reading a worker's result failed: its channel was torn down or interrupted
    (the worker died, or the driver ended the wait)."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"worker {rank}: {error}")
        self.rank, self.error = rank, error


class WorkerCalls(ABC):
    """``method`` on every one of ``actors`` (in rank order) per :meth:`call`."""

    actors: list[Any]

    def over(self, actors: list[Any]) -> bool:
        """Whether this channel calls exactly ``actors``."""
        return list(actors) == self.actors  # handles compare by actor id

    @abstractmethod
    def call(self, arguments: list[Any]) -> list[Any]:
        """Start one call on every actor (``arguments[rank]`` to rank's); what
        :meth:`results` reads."""

    @abstractmethod
    def results(self, pending: list[Any]) -> list[Any]:
        """Every result of one :meth:`call`, waiting as long as it takes; a read that
        fails gives :class:`CallsBroken` in that rank's place."""

    @abstractmethod
    def interrupt(self) -> None:
        """End a wait in :meth:`results` now (from another thread); the channel is
        unusable afterwards."""

    @abstractmethod
    def teardown(self) -> None:
        """Close the channel once the call being answered ended on every live worker;
        idempotent."""


CallsFactory = Callable[[list[Any], str], WorkerCalls]
