"""Failure and scaling policies: pure decisions over a :class:`~raypipe.control.view.LayoutView`.

No Ray and no I/O: the controller (:mod:`raypipe.control.controller`, the only
caller) gathers the facts, asks, and has its mechanisms carry out the one frozen
decision returned (modelled on Ray Train v2's ``FailurePolicy.make_decision`` and
``ScalingPolicy``). A heal asks :func:`decide_failure` at each point where today's
facts may change the way on:

1. a failure was noted (the survivors not asked yet): raise, or replace the failed workers;
2. the survivors said whether they ended the failed step: raise, or replace; with warm
   spares up, :func:`spare_stages` says which stages they take whole (at tensor_parallel
   t > 1 a spare is a group of t: a stage's place, its surviving ranks released);
3. a replacement found no room: shrink, re-partition onto fewer stages, wait for room, or raise;
4. the replacements run: the smallest source of their state (a data-parallel
   sibling, the newest snapshot, an older one when a newer one was lost, the
   newest intact checkpoint), or raise when every copy was lost.

:func:`decide_scaling` runs at step boundaries: grow an elastic run, send a
re-partitioned run back to its configured partition, or stay.
"""
from __future__ import annotations

from dataclasses import dataclass

from raypipe.control.view import LayoutView, Room

# Why a run cannot go on (Raise.reason); the controller raises the matching error.
TOO_MANY_FAILURES = "too many failures"  # TooManyFailures
NOTHING_TO_HEAL_FROM = "nothing to heal from"  # snapshot_every=0, no checkpoint, no sibling
EVERY_COPY_LOST = "every copy lost"  # snapshots and checkpoints were kept, and none loaded
BELOW_MINIMUM = "below the elastic minimum"  # dropping the replicas without room leaves fewer than min
NO_ROOM = "no room"  # a replacement found no room, and the run can neither shrink nor re-partition
NO_PARTITION_FITS = "no partition fits"  # not even fewer stages fit the room within placement_timeout_s


# -- failure decisions ------------------------------------------------------------
@dataclass(frozen=True)
class Raise:
    """The run cannot go on: ``reason`` (one of the constants above) and why, in words."""

    reason: str
    message: str


@dataclass(frozen=True)
class ReplaceWorkers:
    """Start the failed workers again from their specs, in their bundles."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class CopyFromSiblings:
    """Each replacement copies the same stage of another replica; nothing is replayed.
    ``sources``: (failed rank, sibling rank); empty when a shrink dropped every failed
    worker's replica (the survivors only drop the failed step)."""

    sources: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RestoreSnapshot:
    """Every worker back to the snapshot of step ``step`` and the steps since replayed.
    ``older``: a newer snapshot was lost. ``reshard``: ZeRO-1 after a shrink, each worker
    adopts its stage's snapshots of every old replica."""

    step: int
    older: bool = False
    reshard: bool = False


@dataclass(frozen=True)
class LoadCheckpoint:
    """Every worker loads the newest intact checkpoint (of step ``step``, or the one
    kept before it) and the steps since are replayed."""

    step: int


@dataclass(frozen=True)
class Shrink:
    """Drop the replicas whose replacements found no room; ``replicas_left`` go on."""

    drop_replicas: frozenset[int]
    replicas_left: int


@dataclass(frozen=True)
class Repartition:
    """Start one replica of the model on ``num_stages`` stages (fewer than now)."""

    num_stages: int


@dataclass(frozen=True)
class WaitForRoom:
    """No partition fits the room yet: look again shortly (an autoscaler may add nodes)."""

    seconds_left: float


FailureDecision = (Raise | ReplaceWorkers | CopyFromSiblings | RestoreSnapshot | LoadCheckpoint | Shrink
                   | Repartition | WaitForRoom)


def decide_failure(view: LayoutView) -> FailureDecision:
    """The next step of healing the failure ``view`` describes (see the module's docstring)."""
    if view.max_failures is not None and view.failures > view.max_failures:
        return Raise(TOO_MANY_FAILURES, f"{view.failures} failure events, more than max_failures="
                                        f"{view.max_failures}")
    if not view.replaced:
        if view.unplaced:
            return _without_room(view)
        if view.failed:
            return _before_replacing(view)
    return _state_source(view)


def siblings(view: LayoutView) -> dict[int, int] | None:
    """For each failed worker, a survivor of the same stage and tp_rank in another replica to
    copy its state from (the first one); None when the replicas do not hold copies (one replica,
    or ZeRO-1), when the survivors were not asked or any ended the failed step (then only
    a snapshot rolls every worker back alike), or when a stage has no survivor."""
    if not replicas_hold_copies(view) or view.survivors_ended_step is None or view.survivors_ended_step:
        return None
    sources, topology, alive = {}, view.topology, set(view.survivors)
    for rank in view.failed_ranks:
        place = topology.coordinates(rank)
        same_stage = [other for other in topology.stage_ranks(place.stage, place.tp_rank) if other in alive]
        if not same_stage:
            return None
        sources[rank] = same_stage[0]
    return sources


def replicas_hold_copies(view: LayoutView) -> bool:
    """Whether the replicas of a stage hold the same state (its whole optimizer on each):
    only then are the survivors asked whether they ended the failed step."""
    return view.replicas > 1 and not view.shard_optimizer


def _before_replacing(view: LayoutView) -> FailureDecision:
    """Raise when nothing could give the replacements their state, else replace them."""
    if not view.snapshots and view.checkpoint_step is None:
        if view.survivors_ended_step is None and not replicas_hold_copies(view):
            return Raise(NOTHING_TO_HEAL_FROM, "snapshot_every=0 keeps no snapshot to heal from, and no checkpoint "
                                               "was saved or loaded to replay from")
        if view.survivors_ended_step is not None and siblings(view) is None:
            return Raise(NOTHING_TO_HEAL_FROM, "a surviving worker had ended the step, and snapshot_every=0 keeps "
                                               "no snapshot (nor was a checkpoint saved) to roll it back to")
    return ReplaceWorkers(view.failed_ranks)


def _without_room(view: LayoutView) -> FailureDecision:
    """A replacement found no room: drop its replicas (an elastic run keeping at least
    ``min``), else, with no whole pipeline left, go on with fewer stages; else raise."""
    dropped = view.replicas_of(view.unplaced)
    left = view.replicas - len(dropped)
    if view.elastic and left >= view.min_replicas:
        return Shrink(dropped, left)
    if view.can_repartition and left == 0:
        return _fewer_stages(view)
    if view.elastic:
        return Raise(BELOW_MINIMUM, f"{len(dropped)} replica(s) lost workers that no node has room to replace: "
                                    f"{left} would be left, fewer than the elastic minimum {view.min_replicas}")
    return Raise(NO_ROOM, "a replacement found no room within replace_timeout_s")


def _fewer_stages(view: LayoutView) -> FailureDecision:
    """The most stages, fewer than now, that the memory model says fit a worker and that
    the room has workers for once the running ones go (their bundles are freed for the
    new partition); wait for room up to ``placement_timeout_s``, then raise."""
    room = view.room.with_running_gone if view.room is not None else 0
    counts = [count for count in view.stage_counts_that_fit if count < view.num_stages and count <= room]
    if counts:
        return Repartition(max(counts))
    if view.waited_for_room_s <= view.placement_timeout_s:
        return WaitForRoom(view.placement_timeout_s - view.waited_for_room_s)
    return Raise(NO_PARTITION_FITS, f"no whole pipeline of {view.num_stages} stage(s) can be placed, and no "
                                    f"partition onto fewer stages fits: room for {room} worker(s)")


def _state_source(view: LayoutView) -> FailureDecision:
    """Where the workers' state comes from: siblings, else the newest snapshot left, else
    the newest intact checkpoint."""
    reshard = view.shrunk and view.shard_optimizer  # new owners of the lost replica's optimizer part
    if not reshard:
        sources = siblings(view)
        if sources is not None:
            return CopyFromSiblings(tuple(sorted(sources.items())))
    left = [snapshot for snapshot in view.snapshots if not snapshot.lost]
    if left:
        return RestoreSnapshot(left[-1].step, older=left[-1] is not view.snapshots[-1], reshard=reshard)
    if view.checkpoint_step is not None and not view.checkpoint_lost:
        return LoadCheckpoint(view.checkpoint_step)
    return Raise(EVERY_COPY_LOST, "no snapshot or checkpoint to restore")


# -- warm spares -------------------------------------------------------------------
RELEASED = "released: its stage went to a warm spare"  # a survivor's why in a heal (SpareStages.released)


@dataclass(frozen=True)
class SpareStages:
    """The stages a failure touched that warm spares take whole, by their first rank, and
    ``released``: those stages' surviving workers, let go with them (at t = 1 none)."""

    stages: tuple[int, ...]
    released: tuple[int, ...]


def spare_stages(view: LayoutView) -> SpareStages:
    """Which stages the ``spares_up`` warm spares take. At ``tensor_parallel`` t > 1 a spare is a
    group of t processes on one node, so it takes a whole stage's place (each process one tp_rank;
    one rank alone would sit on another node than its peers): a stage where some ranks failed
    has its survivors released and every rank restored as a heal restores any worker. Stages
    whose every worker failed (a node lost) come first, as a spare saves them the most (their
    bundle need not be placed again, nor room found for it), then the rest in rank order; stages
    beyond the spares up have only their failed workers replaced, by new processes."""
    topology, failed = view.topology, set(view.failed_ranks)
    touched = sorted({topology.tensor_ranks(*topology.coordinates(rank)[:2])[0] for rank in failed})
    t = topology.tensor_parallel
    whole = [first for first in touched if failed.issuperset(range(first, first + t))]
    chosen = sorted((whole + [first for first in touched if first not in whole])[:max(view.spares_up, 0)])
    released = tuple(rank for first in chosen for rank in range(first, first + t) if rank not in failed)
    return SpareStages(tuple(chosen), released)


# -- scaling decisions ------------------------------------------------------------
@dataclass(frozen=True)
class Grow:
    """Admit ``by`` new replicas (started beside, ready)."""

    by: int


@dataclass(frozen=True)
class ReturnToConfigured:
    """A re-partitioned run goes back to its configured stages: ``in_place`` the configured
    pipeline is placed in the running workers' room once they went (they are snapshotted
    first); else its workers, ready beside, take over."""

    in_place: bool


@dataclass(frozen=True)
class Stay:
    """The layout stays as it is."""


ScalingDecision = Grow | ReturnToConfigured | Stay


def fits_only_in_place(room: Room, needed: int) -> bool:
    """Whether ``needed`` workers fit only in the room there is plus the running workers'.
    Where they fit beside, their placement group is about to be placed: that swap holds up no step."""
    return room.with_running_gone >= needed > room.now


def decide_scaling(view: LayoutView) -> ScalingDecision:
    """At a step boundary: a re-partitioned run goes back once its configured pipeline is
    ready beside, or in place where it fits only in the running room too (which needs
    snapshots: the running workers go before the new ones start); an elastic run admits
    the replicas ready; else nothing changes."""
    if view.repartitioned:
        if view.configured_ready_beside:
            return ReturnToConfigured(in_place=False)
        if (view.snapshot_every and view.return_in_place_allowed and not view.configured_started_beside
                and view.room is not None and fits_only_in_place(view.room, view.configured_stages)):
            return ReturnToConfigured(in_place=True)
        return Stay()
    if view.elastic and view.new_replicas_ready and view.replicas < view.max_replicas:
        return Grow(min(view.new_replicas_ready, view.max_replicas - view.replicas))
    return Stay()
