"""Healing from a data-parallel sibling: a replaced worker copies the state of the
same stage in another replica, so nothing else moves and no step is replayed
(only when the replicas hold the same state: the optimizer is not sharded, and no
survivor ended the failed step)."""
from __future__ import annotations

from typing import Any

import ray


def survivors_that_ended(actors: list[Any], failed: list[int], commits: int) -> frozenset[int]:
    """The surviving workers (by rank, not in ``failed``) whose committed steps differ
    from ``commits``: they ended the failed step, so only a snapshot rolls every worker
    back alike. Every survivor when one does not answer (another worker is failing: the
    snapshot path finds out how). Which sibling to copy from is the failure policy's
    choice (:func:`raypipe.control.policy.siblings`)."""
    alive = [index for index in range(len(actors)) if index not in failed]
    try:
        ended = ray.get([actors[index].committed_steps.remote() for index in alive])
    except ray.exceptions.RayError:
        return frozenset(alive)
    return frozenset(index for index, count in zip(alive, ended) if count != commits)


def copy_from_siblings(actors: list[Any], sources: dict[int, int]) -> None:
    """Each replacement restores its sibling's state (sent sibling to replacement through
    the object store, not through the driver); survivors drop the failed step."""
    copies = [actors[index].restore.remote(actors[source].snapshot.remote()) for index, source in sources.items()]
    dropped = [actor.abort_step.remote() for index, actor in enumerate(actors) if index not in sources]
    ray.get(copies + dropped)
