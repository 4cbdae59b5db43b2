"""What a heal restores and replays: a snapshot of every worker's state and the
committed steps logged since it, which snapshots a heal may still need, and
loading one (see :mod:`raypipe.executor.recovery`)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from raypipe.core.micro_batches import MicroBatches

logger = logging.getLogger("raypipe")


@dataclass
class LoggedStep:
    """A committed step since the snapshot: what it takes to run it again."""

    data_step: int
    batch: MicroBatches | None
    loss_scale: float | None


def holding(refs: list, layers: list[tuple[int, ...]], wanted: tuple[int, ...]) -> list:
    """The snapshots among ``refs`` (of workers that held ``layers``, in the same order)
    that hold any of the global layers ``wanted``: what a worker of another partition
    adopts, so that it fetches its own layers' stages and not the whole model."""
    return [ref for ref, held in zip(refs, layers, strict=True) if not set(held).isdisjoint(wanted)]


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

    def __post_init__(self) -> None:
        self.taken_by = self.taken_by or list(range(len(self.refs)))
        self.taken = self.taken or list(self.refs)

    def keep_only(self, kept: list[int]) -> None:
        """Only the workers now at the old ranks ``kept`` remain, in that order."""
        self.refs = [self.refs[rank] for rank in kept]
        self.taken_by = [self.taken_by[rank] for rank in kept]

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
    """The snapshots a heal may still need: the newest one known to be whole (on its
    workers' committed steps and, with a keeper, copied off their nodes) and those after."""
    for position in range(len(snapshots) - 1, -1, -1):
        if snapshots[position].copied_off_node():
            return snapshots[position:]
    return snapshots


def load_snapshot(snapshot: Snapshot, keeper: Any, load: Callable[[list, list], list], needed: int | None,
                  as_taken: bool) -> str | None:
    """Give the workers ``snapshot``: ``load(refs, layers)`` with its workers' references,
    else the ``keeper``'s copies of them. ``refs``: of at least ``needed`` workers, by
    current rank (``as_taken``: every worker's, in the order taken); ``layers``: the
    global layers each held. None when it loaded; else why not (lost with its worker or
    node, no copy kept). Which snapshot to try is the failure policy's choice."""
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
            ray.get(load(refs, layers))
            return None
        except ray.exceptions.RayError as error:  # a snapshot lost with its worker or node
            lost = lost or str(error).strip().splitlines()[-1]
    return lost or ""


def replay_since(snapshots: list[Snapshot], position: int) -> list[LoggedStep]:
    """The steps to replay after restoring ``snapshots[position]``: an older snapshot's
    replay runs the newer ones' steps too."""
    return [step for later in snapshots[position:] for step in later.since]
