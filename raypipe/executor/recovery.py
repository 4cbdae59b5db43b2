"""Healing a step that lost workers, so that a failure costs no step, no sample
and no bit of the result.

After every ``snapshot_every`` committed steps each worker returns a snapshot
of its state (:meth:`~raypipe.stage.checkpointing.StageCheckpointing.snapshot`)
as a task result owned by the driver, so it outlives the worker that made it,
and the driver logs the steps run since (data step, micro-batches, loss scale).
It is taken as the next step starts
(:meth:`~raypipe.executor.base.Executor.snapshot_as_next_step_starts`: the default
executor copies it in each stage's first wait of that step); a failure before it
is whole heals from the snapshot before and replays one step more.
With workers off the driver's node a keeper copies each snapshot off their
nodes (:mod:`raypipe.runtime.snapshot_keeper`); the one before stays until then.
When a step raises :class:`~raypipe.errors.WorkersFailed`:

1. the failed workers are killed, and the step's tasks on the others end
   (they fail once their peers are gone);
2. the failed workers are replaced from their specs, in their bundles (Ray
   re-places a bundle whose node was lost), within ``replace_timeout_s``;
3. the replacements get their state from the smallest source that has it:
   a data-parallel sibling (the same stage in another replica) when no
   surviving worker ended the failed step and the optimizer is not sharded,
   so nothing else moves and nothing is replayed; otherwise every worker
   restores its snapshot (survivors drop partial gradients, any that already
   stepped return to the snapshot too; with ZeRO-1 after a shrink, each worker
   adopts its stage's snapshots of every old replica, the new owners taking the
   lost replica's optimizer part) and the steps since are replayed; with
   no snapshot left, every worker loads the newest intact checkpoint saved or
   loaded (:mod:`raypipe.executor.persisted`) and the steps since are replayed;
4. communication groups are re-formed under a fresh rendezvous, dataset
   readers get their datasets again;
5. the failed step is redone.

A worker lost while a heal (or another layout change) runs is folded into it,
and a replacement that dies as it starts is started again
(:mod:`raypipe.executor.compound`).

Seeds depend only on (step, micro-batch, layer) and reductions run in a fixed
order, so on the same layout the result is bitwise that of a run without
failures. Each failure event counts against ``max_failures``.

Which way a heal goes (raise, replace, shrink, re-partition, and the source of
the state) is decided by :func:`raypipe.control.policy.decide_failure` from a
frozen :class:`~raypipe.control.view.LayoutView` this module builds
(:mod:`raypipe.executor.layout_view`); this module carries the decisions out,
the state-giving ones (step 3) in :mod:`raypipe.executor.state_transfer`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from raypipe.config import PipelineConfig
from raypipe.control.policy import (BELOW_MINIMUM, TOO_MANY_FAILURES, Raise, Repartition, Shrink, WaitForRoom,
                                    decide_failure)
from raypipe.control.view import LayoutView
from raypipe.core.micro_batches import MicroBatches
from raypipe.core.topology import Topology
from raypipe.errors import PlacementError, RaypipeError, TooManyFailures, WorkersFailed
from raypipe.executor.base import Executor, StepOutcome
from raypipe.executor.compound import folded, lost_workers, replace_within
from raypipe.executor.elastic import GROW, SHRINK, Resizer
from raypipe.executor.layout_owner import LayoutOwner, Recovered
from raypipe.executor.layout_view import layout_view
from raypipe.executor.persisted import PersistedCheckpoints
from raypipe.executor.siblings import survivors_that_ended
from raypipe.executor.snapshot import LoggedStep, Snapshot, whole_ones
from raypipe.executor.state_transfer import StateTransfer

logger = logging.getLogger("raypipe")


class Recovery:
    """Runs steps on ``executor``, healing :class:`WorkersFailed` as the policy allows.

    ``owner`` owns the layout (see :class:`LayoutOwner`); ``on_replaced(indices)``
    gives replaced workers what was set up after start (their datasets);
    ``on_recovered(Recovered)`` reports each heal.
    """

    def __init__(self, executor: Executor, owner: LayoutOwner, on_replaced: Callable[[list[int]], None],
                 on_recovered: Callable[[Recovered], None]) -> None:
        self.executor, self._owner = executor, owner
        self.on_replaced, self.on_recovered = on_replaced, on_recovered
        self.failures: list[str] = []  # each failure event, as the error named it
        self._snapshots: list[Snapshot] = []  # the newest last; the one before kept until a heal needs it
        self._due: int | None = None  # the committed steps a snapshot is due at, taken as the next step starts
        self._failed: dict[int, str] = {}  # workers to replace before the next step
        self._reasons: set[str] = set()  # why the workers of the heal under way failed (a shrink drops some)
        self._failed_since: float | None = None
        self._commits = 0  # the steps every worker's state had ended after the last step that returned
        # the last resort: the newest checkpoint saved or loaded, and the steps since
        self.persisted = PersistedCheckpoints(keep_batches=not owner.config.snapshot_every)
        self.state = StateTransfer(executor, owner, self.persisted, lambda: self._snapshots, self.view,
                                   lambda detail: self._probe(self._commits, detail))
        self._last_reports: list | None = None
        self._relayout: str | None = None  # "shrink"/"grow" cut short by a lost worker: the heal re-gives specs

    @property
    def config(self) -> PipelineConfig:
        """The config in force (the owner's)."""
        return self._owner.config

    @property
    def resizer(self) -> Resizer | None:
        return self._owner.resizer

    @property
    def keeper(self) -> Any:
        return self._owner.keeper

    # -- snapshots ------------------------------------------------------------
    def snapshot(self, step: int, first: bool = False) -> None:
        """Snapshot every worker at the start of ``step``, keeping the newest whole
        snapshot until this one is known whole. ``first``: the state changed
        outside a step (start, a load), so older snapshots are void and this one
        is waited for."""
        self._keep(step, self.executor.snapshot_workers, first)

    def _keep(self, step: int, submit: Callable[[list], list], first: bool = False) -> None:
        """The snapshot ``submit(actors)`` takes, as the newest."""
        if not self.config.snapshot_every:
            return
        self._due = None
        actors = self.executor.group.actors
        taken = Snapshot(step, submit(actors),
                         layers=[spec.layer_indices for spec in self.executor.group.specs])
        if self.keeper is not None:
            taken.kept = self.keeper.keep.remote(step, *taken.refs)
        self._snapshots = [taken] if first else whole_ones(self._snapshots) + [taken]
        if first:
            waited = taken.refs if taken.kept is None else [*taken.refs, taken.kept]
            ray.wait(waited, num_returns=len(waited), fetch_local=False)

    def committed(self, steps_done: int, logged: LoggedStep) -> None:
        """After a committed step: snapshot when due, else log the step for replay."""
        self.persisted.committed(logged)
        if not self._snapshots:
            return
        newest = self._snapshots[-1]
        newest.since.append(logged)  # kept even when a new snapshot follows: it may never complete
        if steps_done - newest.step < self.config.snapshot_every:
            return
        # while the keeper copies the newest, a new one waits (the steps since are logged): a heal
        # may need the one before it, so the snapshots pinned on the workers' nodes never pile up
        if newest.copied_off_node() is None:
            return
        self._due = steps_done  # taken as the next step starts, where the executor can overlap the copy

    def _take_due_snapshot(self) -> None:
        if self._due is not None:
            self._keep(self._due, self.executor.snapshot_as_next_step_starts)

    # -- steps ---------------------------------------------------------------
    def run_step(self, data_step: int, batch: MicroBatches | None, loss_scale: float | None) -> StepOutcome:
        """One step, healed and redone after any number of failure events within ``max_failures``."""
        while True:
            try:
                with self._folded("while the layout changed"):  # a worker lost meanwhile: the same heal
                    if self._failed:
                        self._heal()
                    elif self.resizer is not None:
                        self._grow()
                    elif self._owner.restore_partition():
                        self._snapshot_now()
                    self._take_due_snapshot()
                return self._run(data_step, batch, loss_scale)
            except WorkersFailed as failure:
                self._note(failure)

    def _grow(self) -> None:
        """Admit a new replica when one is ready and the scaling policy says so (the step
        boundary is the only time the layout changes), and snapshot the grown group."""
        self._relayout = "grow"  # until it returns: a worker lost midway leaves workers with its specs
        new_ranks = self.resizer.poll()
        self._relayout = None
        if new_ranks:
            self.resizer.resized(GROW, new_ranks)
            self._snapshot_now()
            self._owner.settled("grew")

    def relaunch(self, launch: Callable[[], None]) -> str:
        """Between steps, another group in place of this one (``launch()``: stop the
        workers, start those of another partition): every worker is snapshotted first,
        and the new workers adopt every layer of that snapshot (of an older one or a
        checkpoint when it was lost, the steps since redone). Where the state came from."""
        newest = self._snapshots[-1]
        self.snapshot(newest.step + len(newest.since))
        taken = self._snapshots[-1]
        waited = taken.refs if taken.kept is None else [*taken.refs, taken.kept]
        ray.wait(waited, num_returns=len(waited), fetch_local=False)
        launch()
        self.on_replaced(list(range(len(self.executor.group.actors))))
        replay, source = self.state.restore(self.state.adopt_layers(), as_taken=True)
        for logged in replay:
            self._run(logged.data_step, logged.batch, logged.loss_scale)
        return source

    def forget_reports(self) -> None:
        """The running workers went (the owner swapped the group): their last step's reports
        describe no worker now, and a re-partition must not size stages by them."""
        self._last_reports = None

    def _snapshot_now(self) -> None:
        if self._snapshots:  # a fresh snapshot of the group as it is: the old ones cover other workers
            newest = self._snapshots[-1]
            self.snapshot(newest.step + len(newest.since), first=True)

    def _run(self, data_step: int, batch: MicroBatches | None, loss_scale: float | None) -> StepOutcome:
        outcome = self.executor.run_step(data_step, batch, loss_scale)
        self._commits = outcome.reports[0].commits
        self._last_reports = outcome.reports
        return outcome

    def between_steps(self, run: Callable[[], Any], step: int, during: str) -> Any:
        """``run()``, a call that reads the workers and changes none of them (an
        evaluation, reading out their state), after the committed step ``step``:
        when a worker died or hung since that step or during ``run``, the group is
        healed (to the state of ``step``) and ``run`` runs again."""
        while True:
            try:
                with self._folded(during, step):  # an error of a worker lost: a failure to heal
                    if self._failed:
                        self._heal()
                    return run()
            except WorkersFailed as failure:
                self._note(failure)

    def heal_if_broken(self, step: int, before: str) -> None:
        """Make the group whole (see :meth:`between_steps`) if a worker died or hung since step ``step``."""
        def check() -> None:
            failure = self._probe(step, f"found before {before}")
            if failure is not None:
                raise failure

        self.between_steps(check, step, f"before {before}")

    def _probe(self, step: int, detail: str) -> WorkersFailed | None:
        """The workers found dead or hung now, as a failure after step ``step``; None when every one answers."""
        return lost_workers(self.executor.group.actors, self.config.hang_timeout_s, self.config.num_stages, step,
                            detail)

    def _folded(self, during: str, step: int | None = None) -> Any:
        """A worker lost ``during`` a layout change (or a call after step ``step``) raises
        :class:`WorkersFailed` (see :mod:`raypipe.executor.compound`)."""
        return folded(lambda detail: self._probe(self._commits if step is None else step, detail), during,
                      lambda: self.executor.usable)

    def _note(self, failure: WorkersFailed) -> None:
        """Count the event, kill its workers and let the step end on the others."""
        self._failed_since = self._failed_since or time.monotonic()
        self.failures.append(str(failure))
        logger.warning("raypipe: %s; healing (failure %d of max_failures=%s)", failure, len(self.failures),
                       self.config.max_failures)
        group = self.executor.group
        failed = {self._topology.rank(*worker): why for worker, why in failure.workers.items()}
        decision = decide_failure(self.view({**self._failed, **failed}))  # the survivors not asked yet
        if isinstance(decision, Raise):
            raise self._cannot_heal(decision, str(failure)) from failure
        self._owner.heal_started(failure)
        group.kill(list(failed))
        failed.update(self.executor.drain(failed))
        self._failed.update(failed)
        self._reasons.update(failed.values())

    def _heal(self) -> None:
        failed = sorted(self._failed)
        group = self.executor.group
        survivors = [actor for index, actor in enumerate(group.actors) if index not in failed]
        ended = self._survivors_ended(failed)
        decision = decide_failure(self.view(self._failed, survivors_ended_step=ended))
        if isinstance(decision, Raise):
            raise self._cannot_heal(decision, self.failures[-1])
        spares: dict[int, str] = {}  # the failed workers whose place a warm spare took
        try:
            spares = replace_within(group, failed, self.config.replace_timeout_s)
        except PlacementError as error:
            view = self.view(self._failed, unplaced=error.unplaced)
            decision = decide_failure(view)
            if isinstance(decision, Shrink):
                failed, survivors = self._shrink(failed, decision)
                ended = self._survivors_ended(failed)
            elif isinstance(decision, (Repartition, WaitForRoom)):  # fewer stages: the room decides how many
                return self._healed(*self._repartition(view), failed=[])
            else:
                cannot = self._cannot_heal(decision, self.failures[-1], error)
                if cannot is error:
                    raise
                raise cannot from error
        if self._relayout:  # the new layout first: with ZeRO-1 each worker rebuilds for its new owners
            self.executor.relayout(survivors)
            shrunk = self._relayout == "shrink"
            replay, source = self.state.transfer_state(failed, ended, shrunk=shrunk)
            self._relayout = None
            self.resizer.resized(SHRINK, failed) if shrunk else self.on_replaced(failed)
        else:
            replay, source = self.state.transfer_state(failed, ended)
            self.executor.reconnect(survivors)
            self.on_replaced(failed)
        if spares:
            source += f" (replaced by {', '.join(spares[index] for index in sorted(spares))})"
        self._healed(replay, source, failed)

    def view(self, failed: dict[int, str] | None = None, **facts: Any) -> LayoutView:
        """The layout in force, the workers ``failed`` (rank: why) and what a heal can
        restore from, with the decision point's ``facts``, for the policy."""
        return layout_view(self.config, len(self.executor.group.actors), self.resizer is not None,
                           len(self.failures), self._snapshots, self.persisted.newest_step, failed, **facts)

    def _survivors_ended(self, failed: list[int]) -> frozenset[int] | None:
        """The survivors whose state ended the failed step (all of them when one does not
        answer); None, without asking, when the replicas cannot hold copies anyway."""
        actors = self.executor.group.actors
        if len(actors) // self.config.num_stages < 2 or self.config.shard_optimizer:
            return None
        return survivors_that_ended(actors, failed, self._commits)

    def _cannot_heal(self, decision: Raise, failure: str, placement: PlacementError | None = None) -> RaypipeError:
        """The error that ends the run for the policy's ``decision``; the executor is unusable after it."""
        self.executor.usable = False
        if decision.reason == TOO_MANY_FAILURES:
            return TooManyFailures(self.config.max_failures, self.failures)
        if placement is not None:  # no room to replace, nor to shrink or re-partition
            return self.resizer.below_minimum(placement.unplaced) if decision.reason == BELOW_MINIMUM else placement
        return RaypipeError(f"{failure}: {decision.message}; load_checkpoint resumes from the newest checkpoint")

    def _healed(self, replay: list[LoggedStep], source: str, failed: list[int]) -> None:
        """Replay the steps since the state restored, snapshot, and report the heal."""
        for logged in replay:
            self._run(logged.data_step, logged.batch, logged.loss_scale)
        self._snapshot_now()  # of the healed state: a lost one is never fallen back to again
        reasons, self._reasons, self._failed = sorted(self._reasons), set(), {}
        seconds = time.monotonic() - self._failed_since
        self._failed_since = None
        replaced = ["replica {} stage {}".format(*self._topology.coordinates(index)) for index in failed]
        logger.warning("raypipe: healed in %.1fs (replaced %s) from the %s, replayed %d step(s)",
                       seconds, replaced or "none", source, len(replay))
        self.on_recovered(Recovered(reasons, seconds, len(replay), source))

    def _repartition(self, view: LayoutView) -> tuple[list[LoggedStep], str]:
        """One replica on fewer stages (as many as the policy picks for the room, ``view``
        being what the heal knows); its workers adopt the layers of the old stages'
        newest whole snapshot (else the newest checkpoint), and the steps since are replayed."""
        old_stages = self.config.num_stages
        self._owner.repartition(self._last_reports, view)
        self.on_replaced(list(range(len(self.executor.group.actors))))
        # every replica's snapshots with ZeRO-1 (each holds the optimizer part of the parameters it owned)
        needed = None if self.config.shard_optimizer else old_stages
        replay, source = self.state.restore(self.state.adopt_layers(needed), needed=needed, as_taken=True)
        return replay, f"{source}, re-partitioned onto {self.config.num_stages} stage(s)"

    def _shrink(self, failed: list[int], decision: Shrink) -> tuple[list[int], list[Any]]:
        """Drop the replicas the policy names (whose replacements found no room; an
        elastic run); returns the failed workers left (replaced) and the survivors, by
        their new ranks."""
        kept = self.resizer.shrink(decision.drop_replicas)
        for snapshot in self._snapshots:
            snapshot.keep_only(kept)
        # by the new ranks from now on: a worker lost before the heal ends is added to these
        self._failed = {rank: self._failed[old] for rank, old in enumerate(kept) if old in failed}
        self._relayout = "shrink"
        actors = self.executor.group.actors
        return sorted(self._failed), [actors[rank] for rank, old in enumerate(kept) if old not in failed]

    @property
    def _topology(self) -> Topology:
        return Topology(self.config.num_stages, len(self.executor.group.actors) // self.config.num_stages)
