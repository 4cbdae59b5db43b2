"""Giving the workers of a healed or re-laid group their state, from the source the
controller's failure policy (:func:`raypipe.control.policy.decide_failure`) picked:
a data-parallel sibling (a replaced worker copies the same stage of another replica,
so nothing else moves and no step is replayed: only when the replicas hold the same
state, the optimizer not sharded and no survivor having ended the failed step), a
snapshot (resharded across replicas with ZeRO-1 after a shrink), or the newest intact
checkpoint; and workers of another partition adopting the layers they hold.

This module decides nothing: a copy that does not load raises :class:`CopyLost`, and
the controller marks it lost and asks the policy again.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from raypipe.control.persisted import PersistedCheckpoints
from raypipe.control.policy import CopyFromSiblings, LoadCheckpoint, RestoreSnapshot
from raypipe.control.snapshots import LoggedStep, Snapshot, holding, load_snapshot, replay_since
from raypipe.errors import RaypipeError

Load = Callable[[list, list], list]  # (snapshot refs, the layers each held) -> the workers' load calls


class CopyLost(Exception):
    """The chosen snapshot or checkpoint did not load (``why``); the caller finds out
    whether a worker was lost meanwhile, else marks the copy lost and decides again."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def survivors_that_ended(actors: list[Any], failed: list[int], commits: int,
                         timeout_s: float | None = None) -> frozenset[int]:
    """The surviving workers (by rank, not in ``failed``) whose committed steps differ
    from ``commits``: they ended the failed step, so only a snapshot rolls every worker
    back alike. Every survivor when one does not answer, dead or within ``timeout_s`` (another
    worker is failing, or hung: the snapshot path finds out how; a hung one, SIGSTOPped in the
    step after a kill, never answers). Which sibling to copy from is the failure policy's
    choice (:func:`raypipe.control.policy.siblings`)."""
    alive = [index for index in range(len(actors)) if index not in failed]
    try:
        ended = ray.get([actors[index].committed_steps.remote() for index in alive], timeout=timeout_s)
    except ray.exceptions.RayError:  # GetTimeoutError too
        return frozenset(alive)
    return frozenset(index for index, count in zip(alive, ended) if count != commits)


class StateTransfer:
    """Carries out a state decision over the ``executor``'s group: the ``persisted``
    checkpoints are the last source; ``settle_saves()`` finishes a checkpoint save in
    flight before one is loaded."""

    def __init__(self, executor: Any, persisted: PersistedCheckpoints, settle_saves: Callable[[], None]) -> None:
        self.executor, self.persisted, self.settle_saves = executor, persisted, settle_saves
        self.keeper: Any = None  # the controller's snapshot keeper, when workers run off the driver's node

    def adopt_layers(self, needed: int | None = None) -> Load:
        """Each worker of the group (of another partition than the snapshot's) adopts the
        snapshots, of the first ``needed`` workers snapshotted, that hold its layers (of its
        tp_rank with tensor parallelism)."""
        group, t = self.executor.group, self.executor.config.tensor_parallel
        return lambda refs, layers: [actor.adopt.remote(*holding(refs[:needed], layers[:needed], spec.layer_indices,
                                                                 spec.tp_rank, t))
                                     for actor, spec in zip(group.actors, group.specs)]

    def reshard(self, workers_per_replica: int) -> Load:
        """ZeRO-1 after a shrink: each worker adopts the snapshots of its place in a replica (its
        stage, and tp_rank with tensor parallelism) in every replica of the old layout."""
        actors, per = self.executor.group.actors, workers_per_replica
        return lambda refs, _: [actor.adopt.remote(*refs[rank % per::per]) for rank, actor in enumerate(actors)]

    def transfer_state(self, decision: CopyFromSiblings | RestoreSnapshot | LoadCheckpoint,
                       snapshots: list[Snapshot], position: int | None = None, load: Load | None = None,
                       needed: int | None = None, as_taken: bool = False) -> tuple[list[LoggedStep], str]:
        """Give the workers their state as ``decision`` says (a snapshot: ``snapshots[position]``,
        of the step the decision names): the steps to replay since, and where the state came
        from; :class:`CopyLost` when the snapshot or checkpoint did not load.

        ``load(refs, layers)`` gives the workers a snapshot's states (of at least ``needed``
        workers, by current rank; ``as_taken``: of every worker snapshotted, in the order
        taken), ``layers`` the global layers each held; default: each worker restores its own
        (the layers of another partition's snapshot, adopted)."""
        if isinstance(decision, CopyFromSiblings):
            return [], self._copy_from_siblings(dict(decision.sources))
        if isinstance(decision, RestoreSnapshot):
            snapshot = snapshots[position]
            own = load is None  # each worker its own snapshot, unless a snapshot is of another partition
            actors = self.executor.group.actors
            other = own and self._of_another_partition(snapshot)  # a swap in place that a failure cut short
            load = self.adopt_layers() if other else load or (
                lambda refs, _: [actor.restore.remote(ref) for actor, ref in zip(actors, refs)])
            why = load_snapshot(snapshot, self.keeper, load, needed, as_taken or other,
                                get=self.executor.get_watched)
            if why is not None:
                raise CopyLost(why)
            return replay_since(snapshots, position), f"snapshot of step {decision.step}"
        try:
            state = self.persisted.restore(self.executor.group.actors, self.settle_saves,
                                           get=self.executor.get_watched)
        except RaypipeError as error:
            raise CopyLost(str(error)) from error
        return list(state.since), f"checkpoint of step {state.step}"

    def _copy_from_siblings(self, sources: dict[int, int]) -> str:
        """Each replacement restores its sibling's state (sent sibling to replacement through
        the object store, not through the driver); survivors drop the failed step."""
        actors = self.executor.group.actors
        copies = [actors[index].restore.remote(actors[source].snapshot.remote()) for index, source in sources.items()]
        dropped = [actor.abort_step.remote() for index, actor in enumerate(actors) if index not in sources]
        self.executor.get_watched(copies + dropped)
        if not sources:  # a shrink dropped every failed worker's replica
            return "surviving replicas"
        config = self.executor.config
        per_replica = config.num_stages * config.tensor_parallel  # a replica's ranks: p * t
        return "replica " + ", ".join(sorted({str(source // per_replica) for source in sources.values()}))

    def _of_another_partition(self, snapshot: Snapshot) -> bool:
        """Whether ``snapshot``'s workers held other layers than the group's now do."""
        held = [snapshot.layers[taken_at] for taken_at in snapshot.taken_by] if snapshot.layers else None
        return held is not None and held != [spec.layer_indices for spec in self.executor.group.specs]
