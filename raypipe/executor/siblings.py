"""Healing from a data-parallel sibling: a replaced worker copies the state of the
same stage in another replica, so nothing else moves and no step is replayed
(only when the replicas hold the same state: the optimizer is not sharded, and no
survivor ended the failed step)."""
from __future__ import annotations

from typing import Any

import ray


def find_siblings(actors: list[Any], failed: list[int], num_stages: int, commits: int) -> dict[int, int] | None:
    """For each failed worker (by rank), a surviving worker of the same stage in another
    replica to copy its state from; None when some stage has none, or when a survivor's
    committed steps differ from ``commits`` (it ended the failed step: then only a
    snapshot rolls every worker back alike)."""
    alive = [index for index in range(len(actors)) if index not in failed]
    sources = {}
    for index in failed:
        same_stage = [other for other in alive if other % num_stages == index % num_stages]
        if not same_stage:
            return None
        sources[index] = same_stage[0]
    try:
        ended = ray.get([actors[index].committed_steps.remote() for index in alive])
    except ray.exceptions.RayError:  # another worker is failing: the snapshot path finds out how
        return None
    return sources if all(count == commits for count in ended) else None


def copy_from_siblings(actors: list[Any], sources: dict[int, int]) -> None:
    """Each replacement restores its sibling's state (sent sibling to replacement through
    the object store, not through the driver); survivors drop the failed step."""
    copies = [actors[index].restore.remote(actors[source].snapshot.remote()) for index, source in sources.items()]
    dropped = [actor.abort_step.remote() for index, actor in enumerate(actors) if index not in sources]
    ray.get(copies + dropped)
