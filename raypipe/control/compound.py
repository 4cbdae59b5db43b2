"""Compound faults: a layout change (a heal, a shrink, a grow's admission, a partition
swap) that itself meets a lost worker goes on, never ending in a raw Ray error.

- A worker lost while the change runs makes one of its calls raise Ray's error (or
  raypipe's, from :meth:`~raypipe.executor.base.Executor.get`), or the heartbeats that
  watch every wait on the workers' calls find it dead or hung first
  (:class:`~raypipe.errors.WorkersLost`: a stopped worker's call would otherwise wait
  until gRPC's keepalive gave up on it, minutes later). :func:`folded` probes
  the workers then and raises :class:`~raypipe.errors.WorkersFailed` naming the lost
  ones, which the :class:`~raypipe.control.controller.Controller` folds into the heal under
  way (its failed workers are added to those being replaced, and the heal starts over
  from its first step with every one of them). An error that no lost worker explains
  passes unchanged.
- A replacement that dies while it starts (the bundle of a lost node that Ray has not
  re-placed yet) is started again, :func:`replace_within` ``replace_timeout_s``; past
  it, the heal goes on as if no room was found (the policy shrinks, re-partitions or
  raises).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ray

from raypipe.core.topology import Topology
from raypipe.errors import PlacementError, RaypipeError, WorkersFailed, WorkersLost
from raypipe.runtime.health import Watchdog

logger = logging.getLogger("raypipe")

RETRY_PAUSE_S = 0.5  # between starts of a replacement that died while it started: Ray re-places a lost node's bundle


def lost_workers(actors: list[Any], hang_timeout_s: float, num_stages: int, step: int, detail: str,
                 tensor_parallel: int = 1, known: dict[int, str] | None = None) -> WorkersFailed | None:
    """The workers among ``actors`` (``tensor_parallel`` per stage) found dead or hung now (a
    heartbeat each, up to ``hang_timeout_s``), as a failure after step ``step``, with those
    ``known`` lost already (by rank: not asked again); None when every one answers."""
    known = known or {}
    failed = {**Watchdog(hang_timeout_s).probe(actors, skip=known), **known}
    if not failed:
        return None
    topology = Topology.of_workers(num_stages, len(actors), tensor_parallel)
    detail = detail if len(detail) <= 160 else detail[:157] + "..."  # Ray's texts run to paragraphs
    return WorkersFailed(step, {topology.place(index): why for index, why in failed.items()}, detail)


@contextmanager
def folded(probe: Callable[[str, dict[int, str]], WorkersFailed | None], during: str,
           usable: Callable[[], bool]) -> Iterator[None]:
    """Run the block; a Ray or raypipe error it raises becomes the :class:`WorkersFailed`
    that ``probe(detail, known)`` finds (the workers lost ``during`` the block; ``known``:
    those a :class:`~raypipe.errors.WorkersLost` already named, by rank), for the heal to
    fold in. Passed unchanged: a WorkersFailed, a placement error (the policy's to decide),
    an error once the group is not ``usable()`` (a heal gave up), and any error no lost
    worker explains."""
    try:
        yield
    except WorkersFailed:
        raise
    except (ray.exceptions.RayError, RaypipeError) as error:
        if isinstance(error, PlacementError) or not usable():
            raise
        lines = str(error).strip().splitlines() or [type(error).__name__]
        known = error.ranks if isinstance(error, WorkersLost) else {}
        failure = probe(f"{during}: {lines[-1] if isinstance(error, ray.exceptions.RayError) else lines[0]}", known)
        if failure is None:
            raise
        raise failure from error


def replace_within(group: Any, failed: list[int], timeout_s: float | None,
                   pause_s: Callable[[], float] = lambda: RETRY_PAUSE_S) -> dict[int, str]:
    """``group.replace(failed)``, started again while a replacement dies as it starts,
    until ``timeout_s`` (``replace_timeout_s``) passed; then :class:`PlacementError` for
    ``failed``, as when no room is found. Which spare took each place, if any did."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return group.replace(failed, left)
        except ray.exceptions.RayActorError as error:
            why = (str(error).strip().splitlines() or ["died"])[-1]
            if deadline is not None and time.monotonic() + pause_s() >= deadline:
                raise PlacementError(f"a replacement died while it started, again until replace_timeout_s="
                                     f"{timeout_s:g}s passed ({why})", tuple(failed)) from error
            logger.warning("raypipe: a replacement died while it started (%s); starting it again", why)
            time.sleep(pause_s())
