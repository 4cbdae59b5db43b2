"""Is each worker alive and answering? Dead, unreachable and hung workers.

Every stage worker answers :meth:`~raypipe.stage.worker.StageWorker.heartbeat`
on a thread of its own (Ray concurrency group ``health``,
:mod:`raypipe.runtime.actor_classes`), so a worker busy in
a long step still answers; one that is stopped (SIGSTOP), wedged or cut off
does not. A :class:`Watchdog` keeps one heartbeat in flight per worker and
declares a worker hung when its heartbeat has stayed unanswered for
``hang_timeout_s``, unreachable likewise when Ray keeps saying it is
unavailable, and dead at once when Ray says so. The driver's other waits on calls to
the workers (a heal's state transfer, a group re-formed) are watched the same way
(:func:`get_watched`): a plain ``ray.get`` of a call to a stopped worker returns only
once gRPC's keepalive gives up on it, about seven minutes later.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

import ray

from raypipe.errors import WorkersLost

DIED, HUNG, UNREACHABLE = "died", "hung", "unreachable"


class Watchdog:
    """Heartbeats of a group's workers while the driver waits on a step."""

    def __init__(self, hang_timeout_s: float) -> None:
        self.hang_timeout_s = hang_timeout_s
        self._in_flight: dict[int, tuple[Any, float]] = {}  # worker -> (heartbeat, first unanswered at)

    @property
    def interval_s(self) -> float:
        """How often to :meth:`check` while waiting."""
        return min(5.0, self.hang_timeout_s / 3)

    def check(self, actors: list[Any]) -> dict[int, str]:
        """Send a heartbeat to every worker without one in flight; return the
        workers found dead, hung or unreachable (index -> :data:`DIED` | :data:`HUNG` | :data:`UNREACHABLE`)."""
        now = time.monotonic()
        for index, actor in enumerate(actors):
            if index not in self._in_flight:
                self._in_flight[index] = (actor.heartbeat.remote(), now)
        refs = {ref: index for index, (ref, _) in self._in_flight.items()}
        answered, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        failed = {}
        for ref in answered:
            index = refs[ref]
            since = self._in_flight.pop(index)[1]
            try:
                ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                if now - since >= self.hang_timeout_s:
                    failed[index] = UNREACHABLE
                else:  # ping again, still counting from the first unanswered one
                    self._in_flight[index] = (actors[index].heartbeat.remote(), since)
            except ray.exceptions.RayError:
                failed[index] = DIED
        for index, (_, since) in self._in_flight.items():
            if index not in failed and now - since >= self.hang_timeout_s:
                failed[index] = HUNG
        return failed

    def probe(self, actors: list[Any], skip: Collection[int] = ()) -> dict[int, str]:
        """Heartbeat every worker but those ``skip`` (by index) and wait for every answer (up to
        ``hang_timeout_s``): the workers that are dead, unreachable or hung. Quick when all are well."""
        sent = {actor.heartbeat.remote(): index for index, actor in enumerate(actors) if index not in skip}
        deadline = time.monotonic() + self.hang_timeout_s
        failed: dict[int, str] = {}
        unavailable: set[int] = set()
        while sent and time.monotonic() < deadline:
            done, _ = ray.wait(list(sent), num_returns=len(sent), timeout=max(0.0, deadline - time.monotonic()))
            for ref in done:
                index = sent.pop(ref)
                try:
                    ray.get(ref)
                    unavailable.discard(index)
                except ray.exceptions.ActorUnavailableError:
                    unavailable.add(index)
                    time.sleep(0.2)
                    sent[actors[index].heartbeat.remote()] = index
                except ray.exceptions.RayError:
                    failed[index] = DIED
        failed.update({index: UNREACHABLE if index in unavailable else HUNG for index in sent.values()})
        return failed

    def wait(self, refs: list, actors: list[Any], deadline_s: float | None = None) -> dict[int, str]:
        """Wait until every one of ``refs`` is done, some worker is found failed, or
        ``deadline_s`` passed; returns the failed workers (empty otherwise)."""
        def done(timeout_s: float) -> bool:
            return not ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)[1]

        return self.wait_until(done, actors, deadline_s)

    def wait_until(self, done: Callable[[float], bool], actors: list[Any],
                   deadline_s: float | None = None) -> dict[int, str]:
        """Wait until ``done(timeout_s)`` (which waits up to ``timeout_s``) is true, some
        worker is found failed, or ``deadline_s`` passed; returns the failed workers
        (empty otherwise)."""
        end = None if deadline_s is None else time.monotonic() + deadline_s
        while True:
            if done(self.interval_s) or (end is not None and time.monotonic() > end):
                return {}
            failed = self.check(actors)
            if failed:
                return failed


def ended_or_failed(refs: list) -> Callable[[float], bool]:
    """For :meth:`Watchdog.wait_until`: whether every one of ``refs`` is done, or one
    that is done failed (the others may then wait on it forever: NCCL raises nothing)."""
    read: set = set()  # the done ones already read and not failed: not fetched again at the next look

    def done(timeout_s: float) -> bool:
        end, pending = time.monotonic() + timeout_s, [ref for ref in refs if ref not in read]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, end - time.monotonic()),
                                      fetch_local=False)
            if not ready:
                return False
            try:
                ray.get(ready[0])
            except ray.exceptions.RayError:
                return True
            read.add(ready[0])
        return True

    return done


def get_watched(refs: list, actors: list[Any], hang_timeout_s: float) -> list:
    """``ray.get(refs)`` of calls to workers among ``actors``, whose heartbeats a :class:`Watchdog`
    watches meanwhile as it does a step's: raises :class:`~raypipe.errors.WorkersLost` naming the
    workers found dead, unreachable or hung before every call ended (or one failed: its error is
    raised then, as ``ray.get`` raises it)."""
    failed = Watchdog(hang_timeout_s).wait_until(ended_or_failed(refs), actors)
    if failed:
        raise WorkersLost(failed)
    return ray.get(refs)


def wait_watched(refs: list, actors: list[Any], hang_timeout_s: float) -> None:
    """Return once every one of ``refs`` (results of calls to workers among ``actors``) is done,
    without fetching it; the workers' heartbeats are watched meanwhile as :func:`get_watched`
    watches them (:class:`~raypipe.errors.WorkersLost` names the workers found dead or hung first)."""
    failed = Watchdog(hang_timeout_s).wait(refs, actors)
    if failed:
        raise WorkersLost(failed)
