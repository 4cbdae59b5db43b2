"""The controller's states: each a small frozen class carrying the data of that state
(modelled on Ray Train v2's ``TrainControllerState`` classes), and what a heal leaves
behind (:class:`Recovered`).

A heal's progress is a state, not fields of a mechanism: :class:`Healing` holds the
workers to replace, why they failed, when the heal began and whether the workers hold
another layout's specs. A layout change that is part of a heal (the shrink that drops
replicas without room, the re-partition onto fewer stages) carries that heal in its own
state (``healing``) until the heal ends, so a worker lost meanwhile is folded into it.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar


class ControllerState(enum.Enum):
    """Which state the controller is in; the metric's ``state`` label is the value."""

    STARTING = "starting"  # placing and starting the workers
    RUNNING = "running"  # the configured partition runs steps
    HEALING = "healing"  # replacing failed workers and restoring their state
    RESIZING = "resizing"  # replicas shrink or grow, or the configured partition comes back
    REPARTITIONED = "repartitioned"  # steps run on fewer stages than configured (no room for a whole pipeline)
    FAILED = "failed"  # a failure could not be healed: the run is over (load_checkpoint resumes)
    STOPPED = "stopped"  # shut down


STATES: tuple[str, ...] = tuple(state.value for state in ControllerState)

SHRINK, GROW = "shrink", "grow"  # the directions of an elastic resize


@dataclass(frozen=True)
class BaseState:
    """What every controller state carries: its kind (the metric's label) and why it was entered."""

    kind: ClassVar[ControllerState]
    reason: str = field(default="", kw_only=True)


@dataclass(frozen=True)
class Starting(BaseState):
    kind: ClassVar[ControllerState] = ControllerState.STARTING


@dataclass(frozen=True)
class Running(BaseState):
    """Steps run on the configured partition."""

    kind: ClassVar[ControllerState] = ControllerState.RUNNING


@dataclass(frozen=True)
class Healing(BaseState):
    """Failed workers are being replaced and given their state.

    ``failed``: the workers to replace before the next step (rank -> why, by the ranks
    of the layout in force: a shrink re-numbers them); ``reasons``: why the workers of
    this heal failed (a shrink drops some from ``failed``, not from here); ``since``:
    when the first of its failures was noted (``time.monotonic()``); ``relayout``:
    :data:`SHRINK` or :data:`GROW` when a resize cut short left workers with another
    layout's specs, so the heal gives every worker its spec again."""

    kind: ClassVar[ControllerState] = ControllerState.HEALING
    failed: Mapping[int, str]
    reasons: frozenset[str]
    since: float
    relayout: str | None = None


@dataclass(frozen=True)
class Resizing(BaseState):
    """The replicas shrink or grow (``direction``), or the configured partition comes back
    (``direction`` "restore"); ``healing``: the heal a shrink is part of, until it ends."""

    kind: ClassVar[ControllerState] = ControllerState.RESIZING
    direction: str
    healing: Healing | None = None


@dataclass(frozen=True)
class Repartitioned(BaseState):
    """Steps run on fewer stages than configured; ``healing``: the heal the re-partition
    is part of, until it ends."""

    kind: ClassVar[ControllerState] = ControllerState.REPARTITIONED
    healing: Healing | None = None


@dataclass(frozen=True)
class Failed(BaseState):
    """A failure could not be healed: ``error`` is its error's type, ``reason`` its first line."""

    kind: ClassVar[ControllerState] = ControllerState.FAILED
    error: str


@dataclass(frozen=True)
class Stopped(BaseState):
    """Shut down (``reason``: a shutdown, or a start that failed)."""

    kind: ClassVar[ControllerState] = ControllerState.STOPPED


State = Starting | Running | Healing | Resizing | Repartitioned | Failed | Stopped


def heal_under_way(state: State) -> Healing | None:
    """The heal ``state`` is (Healing) or is part of (a shrink's Resizing, a Repartitioned
    entered by a heal); None when no heal is under way."""
    if isinstance(state, Healing):
        return state
    return getattr(state, "healing", None)


@dataclass
class Recovered:
    """One healed failure event."""

    reasons: list[str]
    seconds: float
    replayed_steps: int
    source: str  # "replica R", "snapshot of step N"...; " (replaced by spare S, ...)" when spares took places


__all__ = ["GROW", "SHRINK", "STATES", "BaseState", "ControllerState", "Failed", "Healing", "Recovered", "Repartitioned",
           "Resizing", "Running", "Starting", "State", "Stopped", "heal_under_way"]
