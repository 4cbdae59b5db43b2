"""What a heal restores and replays: a snapshot of every worker's state and the
committed steps logged since it (:class:`Snapshot`), the snapshots a run keeps
(:class:`Snapshots`: taken every ``snapshot_every`` committed steps, the one
before kept until the newest is known whole), and loading one.

After every ``snapshot_every`` committed steps each worker returns a snapshot
of its state (:meth:`~raypipe.stage.checkpointing.StageCheckpointing.snapshot`)
as a task result owned by the driver, so it outlives the worker that made it,
and the steps run since (data step, micro-batches, loss scale) are logged.
It is taken with the next step
(:meth:`~raypipe.executor.base.Executor.start_step`: the default executor submits it
just after that step, copies it in each stage's first wait of the step, lets the step
commit once it is copied and stores it after, so it may be whole only after that commit:
each worker's task says so in a small second result); a failure before it is whole
heals from the snapshot before and replays one step more.
With workers off the driver's node a keeper copies each snapshot off their
nodes (:mod:`raypipe.runtime.snapshot_keeper`); the one before stays until then.
Which snapshot a heal restores is :func:`raypipe.control.policy.decide_failure`'s
choice, asked by the controller over :meth:`Snapshots.views`."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from raypipe.control.view import SnapshotView
from raypipe.core.micro_batches import MicroBatches
from raypipe.executor.base import SnapshotTasks


@dataclass
class LoggedStep:
    """A committed step since the snapshot: what it takes to run it again."""

    data_step: int
    batch: MicroBatches | None
    loss_scale: float | None


def holding(refs: list, layers: list[tuple[int, ...]], wanted: tuple[int, ...], tp_rank: int = 0,
            tensor_parallel: int = 1) -> list:
    """The snapshots among ``refs`` (of workers that held ``layers``, in the same order: rank
    order) that hold any of the global layers ``wanted``: what a worker of another partition
    adopts, so that it fetches its own layers' stages and not the whole model. With
    ``tensor_parallel`` t > 1 (kept by a re-partition), only those of its own ``tp_rank``: a
    rank's snapshot holds its part of each layer, and the same tp_rank's part is the same slice
    on any stage."""
    return [ref for position, (ref, held) in enumerate(zip(refs, layers, strict=True))
            if position % tensor_parallel == tp_rank and not set(held).isdisjoint(wanted)]


@dataclass
class Snapshot:
    """Every worker's state at the start of step ``step`` and the steps since.

    ``taken_by[rank]`` is the position, among the workers snapshotted, of the
    worker now at ``rank`` (a shrink drops workers and re-numbers the rest);
    ``taken`` keeps every worker's, dropped or not, in the order taken (a ZeRO-1
    resize needs every replica's optimizer part), and ``layers`` the global
    layers each of them held (a worker of another partition adopts only the
    snapshots holding its layers)."""

    step: int
    refs: list
    since: list[LoggedStep] = field(default_factory=list)
    taken_by: list[int] = field(default_factory=list)
    kept: Any = None  # the keeper's copy of it being made (a task's reference), when workers run off this node
    copied: bool | None = None  # whether that copy was made; None until it is known
    taken: list = field(default_factory=list)
    layers: list[tuple[int, ...]] = field(default_factory=list)
    # each worker's receipt (read True once its state is stored), by current rank, where the step that took it
    # may commit before then (SnapshotTasks.stored); None where that commit means stored, or once known
    stored: list | None = None

    def __post_init__(self) -> None:
        self.taken_by = self.taken_by or list(range(len(self.refs)))
        self.taken = self.taken or list(self.refs)

    def keep_only(self, kept: list[int]) -> None:
        """Only the workers now at the old ranks ``kept`` remain, in that order."""
        self.refs = [self.refs[rank] for rank in kept]
        self.taken_by = [self.taken_by[rank] for rank in kept]
        if self.stored is not None:
            self.stored = [self.stored[rank] for rank in kept]

    def stored_by_workers(self) -> bool | None:
        """Whether every worker's state is stored where it outlives the worker (a task
        result the driver owns): None while one is being stored, False when one was lost
        with its worker before. A snapshot taken as the next step starts may be stored
        after that step commits (its worker lets the commit go once the state is copied):
        a worker that dies then takes its part, and the snapshot before is needed."""
        if not self.stored:
            return True
        if len(ray.wait(self.stored, num_returns=len(self.stored), timeout=0, fetch_local=False)[0]) < len(self.stored):
            return None
        try:
            ray.get(self.stored)  # small: only what says each state was stored
        except ray.exceptions.RayError:  # its worker died before its state was stored
            return False
        self.stored = None
        return True

    def whole(self) -> bool | None:
        """Whether a heal can restore this snapshot: every worker's state stored and, with
        a keeper, copied off their nodes. None while either is under way."""
        stored = self.stored_by_workers()
        return stored if not stored else self.copied_off_node()

    def copied_off_node(self) -> bool | None:
        """Whether the keeper's copy of this snapshot was made (True without a keeper;
        None while it is being made)."""
        if self.kept is None:
            return True
        if self.copied is None and ray.wait([self.kept], timeout=0, fetch_local=False)[0]:
            try:
                ray.get(self.kept)
                self.copied = True
            except ray.exceptions.RayError:  # a node went before the keeper had its snapshot
                self.copied = False
        return self.copied

    def kept_copies(self, keeper: Any, as_taken: bool = False) -> list:
        """``keeper``'s copies of this snapshot, by current rank (``as_taken``: every
        worker's, in the order taken); none without a keeper."""
        if keeper is None:
            return []
        copies = [wrapped[0] for wrapped in ray.get(keeper.copies.remote(self.step))]
        if as_taken or not copies:
            return copies
        return [copies[position] for position in self.taken_by]


def whole_ones(snapshots: list[Snapshot]) -> list[Snapshot]:
    """The snapshots a heal may still need: the newest one known to be whole (stored
    by every worker and, with a keeper, copied off their nodes: :meth:`Snapshot.whole`)
    and those after."""
    for position in range(len(snapshots) - 1, -1, -1):
        if snapshots[position].whole():
            return snapshots[position:]
    return snapshots


def load_snapshot(snapshot: Snapshot, keeper: Any, load: Callable[[list, list], list], needed: int | None,
                  as_taken: bool, get: Callable[[list], list] = ray.get) -> str | None:
    """Give the workers ``snapshot``: ``load(refs, layers)`` with its workers' references,
    else the ``keeper``'s copies of them. ``refs``: of at least ``needed`` workers, by
    current rank (``as_taken``: every worker's, in the order taken); ``layers``: the
    global layers each held. None when it loaded; else why not (lost with its worker or
    node, no copy kept). ``get`` waits for the load calls (the controller's watches the workers:
    one found lost raises past this). Which snapshot to try is the failure policy's choice."""
    lost = None
    if as_taken and needed is not None and snapshot.layers:
        # one replica of the layout that took it: a snapshot taken before a partition swap (the swap's
        # own, when a worker is lost during it) has as many workers as the partition that went
        needed = min(needed, len(set(snapshot.layers)))
    copies = ((snapshot.taken, snapshot.kept_copies(keeper, as_taken=True)) if as_taken
              else (snapshot.refs, snapshot.kept_copies(keeper)))
    layers = (snapshot.layers if as_taken or not snapshot.layers
              else [snapshot.layers[taken_at] for taken_at in snapshot.taken_by])
    for refs in copies:
        if len(refs) < (needed or len(copies[0])):  # no copies kept
            continue
        try:
            get(load(refs, layers))
            return None
        except ray.exceptions.RayError as error:  # a snapshot lost with its worker or node
            lost = lost or str(error).strip().splitlines()[-1]
    return lost or ""


def replay_since(snapshots: list[Snapshot], position: int) -> list[LoggedStep]:
    """The steps to replay after restoring ``snapshots[position]``: an older snapshot's
    replay runs the newer ones' steps too."""
    return [step for later in snapshots[position:] for step in later.since]


class Snapshots:
    """The snapshots of a run's workers, the newest last (the one before kept until a
    heal no longer needs it), taken through ``executor`` every ``snapshot_every``
    committed steps (0: none). ``keeper`` (set by the controller when workers run off
    the driver's node) copies each off their nodes."""

    def __init__(self, executor: Any, snapshot_every: int) -> None:
        self.executor, self.snapshot_every = executor, snapshot_every
        self.keeper: Any = None
        self.held: list[Snapshot] = []
        self._due: int | None = None  # the committed steps a snapshot is due at, taken with the next step

    def take(self, step: int, first: bool = False) -> None:
        """Snapshot every worker at the start of ``step``, keeping the newest whole
        snapshot until this one is known whole. ``first``: the state changed
        outside a step (start, a load, a new layout), so older snapshots are void and
        this one is waited for."""
        if self.snapshot_every:
            self._keep(step, self.executor.snapshot_workers(self.executor.group.actors), first)

    def _keep(self, step: int, tasks: SnapshotTasks, first: bool = False) -> None:
        """The snapshot whose tasks were just submitted, as the newest."""
        self._due = None
        group = self.executor.group
        taken = Snapshot(step, tasks.states, layers=[spec.layer_indices for spec in group.specs], stored=tasks.stored)
        if self.keeper is not None:
            taken.kept = self.keeper.keep.remote(step, *taken.refs)
        self.held = [taken] if first else whole_ones(self.held) + [taken]
        if first:
            self.wait(taken)

    def wait(self, taken: Snapshot) -> None:
        """Until ``taken`` is on every worker's (and the keeper's) side; a worker found dead or
        hung meanwhile raises :class:`~raypipe.errors.WorkersLost` (a layout change folds it in)."""
        waited = taken.refs if taken.kept is None else [*taken.refs, taken.kept]
        self.executor.wait(waited)

    def committed(self, steps_done: int, logged: LoggedStep) -> None:
        """After a committed step: a snapshot is due when ``snapshot_every`` steps were
        logged since the newest; else the step is logged for replay."""
        if not self.held:
            return
        newest = self.held[-1]
        newest.since.append(logged)  # kept even when a new snapshot follows: it may never complete
        if steps_done - newest.step < self.snapshot_every:
            return
        # while the keeper copies the newest, a new one waits (the steps since are logged): a heal
        # may need the one before it, so the snapshots pinned on the workers' nodes never pile up
        if newest.copied_off_node() is None:
            return
        self._due = steps_done  # taken with the next step, where the executor can overlap the copy

    @property
    def due(self) -> bool:
        """Whether the next step is to be submitted with a snapshot of the state it starts from."""
        return self._due is not None

    def keep_due(self, tasks: SnapshotTasks) -> None:
        """The snapshot due, its tasks submitted with the next step
        (:meth:`~raypipe.executor.base.Executor.start_step`), as the newest."""
        self._keep(self._due, tasks)

    def now_step(self) -> int | None:
        """The step the workers' state is at (the newest snapshot's and the steps since); None without one."""
        if not self.held:
            return None
        newest = self.held[-1]
        return newest.step + len(newest.since)

    def fresh(self) -> None:
        """A fresh snapshot of the group as it is (the old ones cover other workers), waited for."""
        step = self.now_step()
        if step is not None:
            self.take(step, first=True)

    def keep_only(self, kept: list[int]) -> None:
        """Only the workers now at the old ranks ``kept`` remain (a shrink), in every snapshot."""
        for snapshot in self.held:
            snapshot.keep_only(kept)

    def views(self) -> tuple[SnapshotView, ...]:
        """The snapshots held, oldest first, as the failure policy sees them."""
        return tuple(SnapshotView(snapshot.step, snapshot.whole(), kept_off_node=snapshot.kept is not None)
                     for snapshot in self.held)
