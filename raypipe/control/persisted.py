"""The last source a heal falls back to: the newest intact checkpoint this trainer
saved or loaded, and the steps committed since, replayed after every worker loads it.

It is used when no data-parallel sibling holds a replacement's state and no
in-memory snapshot is left (``snapshot_every=0``, or every copy lost). ``fit``'s
steps read their data by step, so the log since a checkpoint costs nothing; a
``trainer.step(x, y)`` batch is kept in the log only with ``snapshot_every=0``
(where this is the only source: its memory grows with the steps between
checkpoints); otherwise the log stops and the checkpoint is not replayable.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from raypipe.errors import RaypipeError

logger = logging.getLogger("raypipe")


@dataclass
class PersistedState:
    """A checkpoint the workers can load, and the steps committed since (None: not replayable)."""

    root_uri: str
    step: int
    optimizer_parts: int
    since: list | None = field(default_factory=list)


class PersistedCheckpoints:
    """The newest two checkpoints saved or loaded (a background save may never complete)."""

    def __init__(self, keep_batches: bool) -> None:
        self.keep_batches = keep_batches
        self._states: list[PersistedState] = []

    def saved(self, root_uri: str, step: int, optimizer_parts: int) -> None:
        self._states = self._states[-1:] + [PersistedState(root_uri, step, optimizer_parts)]

    def loaded(self, root_uri: str, step: int, optimizer_parts: int) -> None:
        self._states = [PersistedState(root_uri, step, optimizer_parts)]

    def forget(self) -> None:
        """The state changed outside a step (``load_state_dict``): no checkpoint leads to it."""
        self._states = []

    def committed(self, logged: Any) -> None:
        """Log a committed step (a ``LoggedStep``) for replay after each checkpoint."""
        for state in self._states:
            if state.since is None:
                continue
            if logged.batch is not None and not self.keep_batches:
                state.since = None
            else:
                state.since.append(logged)

    def __bool__(self) -> bool:
        return any(state.since is not None for state in self._states)

    @property
    def newest_step(self) -> int | None:
        """The step of the newest checkpoint a heal can replay from; None when there is none."""
        return next((state.step for state in reversed(self._states) if state.since is not None), None)

    def restore(self, actors: list, settle: Callable[[], None], get: Callable[[list], list] = ray.get
                ) -> PersistedState:
        """Every worker drops any partial step and loads the newest intact checkpoint;
        returns it (the caller replays ``since``). ``settle()`` first finishes a save in flight;
        ``get`` waits for the workers' calls (the controller's watches them: one found lost
        raises past this)."""
        settle()
        problems = []
        for state in reversed(self._states):
            if state.since is None:
                continue
            try:
                get([actor.abort_step.remote() for actor in actors])
                get([actor.load_checkpoint.remote(state.root_uri, state.step, state.optimizer_parts)
                     for actor in actors])
                return state
            except ray.exceptions.RayTaskError as error:  # not complete (a save lost mid-write) or damaged
                problems.append(f"step {state.step}: {str(error).strip().splitlines()[-1]}")
                logger.warning("raypipe: cannot heal from the checkpoint of step %d under %s (%s)", state.step,
                               state.root_uri, problems[-1])
        raise RaypipeError("no checkpoint to heal from: " + ("; ".join(problems) or "none saved or loaded"))
