"""Giving the workers of a healed or re-laid group their state, from the smallest
source the policy (:func:`raypipe.control.policy.decide_failure`) picks: a
data-parallel sibling, the newest snapshot (an older one when it was lost;
resharded across replicas with ZeRO-1 after a shrink), or the newest intact
checkpoint; and workers of another partition adopting the layers they hold.
:class:`~raypipe.executor.recovery.Recovery`, which runs the heal, holds one."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from raypipe.config import PipelineConfig
from raypipe.control.policy import CopyFromSiblings, LoadCheckpoint, RestoreSnapshot, decide_failure
from raypipe.control.view import LayoutView
from raypipe.errors import RaypipeError, WorkersFailed
from raypipe.executor.base import Executor
from raypipe.executor.persisted import PersistedCheckpoints
from raypipe.executor.siblings import copy_from_siblings
from raypipe.executor.snapshot import LoggedStep, Snapshot, holding, load_snapshot, replay_since

logger = logging.getLogger("raypipe")


class StateTransfer:
    """The state-giving actions of a heal, over what the heal holds: the ``executor``,
    the layout's ``owner`` (the config in force, the snapshot keeper, settling saves),
    the ``persisted`` checkpoints, and two readers of the heal's state as it is when an
    action runs: ``snapshots()`` (oldest first) and ``view(failed, **facts)``, the
    policy's view of the layout. ``probe(detail)``: the workers lost now, as a failure
    (None when every one answers): a load that fails because a worker was lost is a
    failure to fold into the heal, not a lost snapshot."""

    def __init__(self, executor: Executor, owner: Any, persisted: PersistedCheckpoints,
                 snapshots: Callable[[], list[Snapshot]], view: Callable[..., LayoutView],
                 probe: Callable[[str], WorkersFailed | None]) -> None:
        self.executor, self._owner, self.persisted = executor, owner, persisted
        self._snapshots_now, self.view, self._probe = snapshots, view, probe

    @property
    def config(self) -> PipelineConfig:
        return self._owner.config

    @property
    def _snapshots(self) -> list[Snapshot]:
        return self._snapshots_now()

    def adopt_layers(self, needed: int | None = None) -> Callable[[list, list], list]:
        """Each worker of the group (of another partition than the snapshot's) adopts the
        snapshots, of the first ``needed`` workers snapshotted, that hold its layers."""
        group = self.executor.group
        return lambda refs, layers: [actor.adopt.remote(*holding(refs[:needed], layers[:needed], spec.layer_indices))
                                     for actor, spec in zip(group.actors, group.specs)]

    def transfer_state(self, failed: list[int], ended: frozenset[int] | None, shrunk: bool = False
                        ) -> tuple[list[LoggedStep], str]:
        """Give the replacements ``failed`` their state from where the policy says (siblings
        when no survivor ``ended`` the failed step, else every worker rolls back; ``shrunk``
        with ZeRO-1: every worker adopts the snapshots of its stage in every replica of the
        old layout): the steps to replay, and where the state came from."""
        view = self.view(dict.fromkeys(failed, ""), survivors_ended_step=ended, replaced=True, shrunk=shrunk)
        decision = decide_failure(view)
        if not isinstance(decision, CopyFromSiblings):
            if isinstance(decision, RestoreSnapshot) and decision.reshard:
                actors, stages = self.executor.group.actors, self.config.num_stages
                replay, source = self.restore(lambda refs, _: [actor.adopt.remote(*refs[rank % stages::stages])
                                                                for rank, actor in enumerate(actors)],
                                               as_taken=True, view=view)
                return replay, f"{source}, resharded"
            return self.restore(view=view)
        siblings = dict(decision.sources)
        copy_from_siblings(self.executor.group.actors, siblings)
        if not siblings:  # a shrink dropped every failed worker's replica
            return [], "surviving replicas"
        num_stages = self.config.num_stages
        return [], "replica " + ", ".join(sorted({str(source // num_stages) for source in siblings.values()}))

    def restore(self, load: Callable[[list, list], list] | None = None, needed: int | None = None,
                 as_taken: bool = False, view: LayoutView | None = None) -> tuple[list[LoggedStep], str]:
        """Every worker back to the state the policy picks: the newest snapshot, an older
        one when a newer one was lost (a worker died while it was taken), the newest
        intact checkpoint when none is left. Returns the steps to replay since, and which
        state it was. ``load(refs, layers)`` gives the workers a snapshot's states (of at
        least ``needed`` workers, by current rank; ``as_taken``: of every worker
        snapshotted, in the order taken), ``layers`` the global layers each held; default:
        each worker restores its own. ``view``: what the heal knows (default: the layout now)."""
        actors = self.executor.group.actors
        own = load is None  # each worker its own snapshot, unless a snapshot is of another partition
        load = load or (lambda refs, _: [actor.restore.remote(ref) for actor, ref in zip(actors, refs)])
        view = replace(view or self.view(), replaced=True)
        lost, lost_at, checkpoint_lost = "", set(), False
        while True:
            snapshots = tuple(replace(snapshot, lost=position in lost_at)
                              for position, snapshot in enumerate(view.snapshots))
            decision = decide_failure(replace(view, snapshots=snapshots, checkpoint_lost=checkpoint_lost))
            if isinstance(decision, RestoreSnapshot):
                position = max(position for position, snapshot in enumerate(snapshots)
                               if snapshot.step == decision.step and not snapshot.lost)
                snapshot = self._snapshots[position]
                other = own and self._of_another_partition(snapshot)  # a swap in place that a failure cut short
                why = load_snapshot(snapshot, self._owner.keeper, self.adopt_layers() if other else load, needed,
                                    as_taken or other)
                if why is None:
                    if decision.older:
                        logger.warning("raypipe: the snapshot of step %d was lost (%s); restored the one of step %d",
                                       self._snapshots[-1].step, lost, decision.step)
                    return replay_since(self._snapshots, position), f"snapshot of step {decision.step}"
                self._raise_if_lost(f"restoring the snapshot of step {decision.step}: {why}")
                lost, lost_at = lost or why, lost_at | {position}
            elif isinstance(decision, LoadCheckpoint):
                if self._snapshots:
                    logger.warning("raypipe: every snapshot was lost (%s); healing from the newest checkpoint", lost)
                try:
                    state = self.persisted.restore(actors, self._owner.settle_saves)
                    return list(state.since), f"checkpoint of step {state.step}"
                except RaypipeError as error:
                    self._raise_if_lost(f"loading the checkpoint: {error}")
                    lost, checkpoint_lost = (f"{lost}; {error}" if lost else str(error)), True
            else:
                self.executor.usable = False
                raise RaypipeError(f"no snapshot or checkpoint to restore (every copy was lost: {lost}); "
                                   "load_checkpoint resumes from the newest persisted checkpoint")

    def _raise_if_lost(self, detail: str) -> None:
        """Raise the failure when a load failed because a worker was lost (not the state)."""
        failure = self._probe(detail)
        if failure is not None:
            raise failure

    def _of_another_partition(self, snapshot: Snapshot) -> bool:
        """Whether ``snapshot``'s workers held other layers than the group's now do."""
        held = [snapshot.layers[taken_at] for taken_at in snapshot.taken_by] if snapshot.layers else None
        return held is not None and held != [spec.layer_indices for spec in self.executor.group.specs]
