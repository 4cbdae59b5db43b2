"""What a :class:`~raypipe.executor.recovery.Recovery` reports of each heal, and what it
needs of the one owner of the layout (the :class:`~raypipe.control.controller.Controller`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from raypipe.config import PipelineConfig
    from raypipe.control.view import LayoutView
    from raypipe.errors import WorkersFailed
    from raypipe.executor.elastic import Resizer


@dataclass
class Recovered:
    """One healed failure event."""

    reasons: list[str]
    seconds: float
    replayed_steps: int
    source: str  # "replica R", "snapshot of step N"...; " (replaced by spare S, ...)" when spares took places


class LayoutOwner(Protocol):
    """What a :class:`Recovery` needs of the one owner of the layout (the
    :class:`~raypipe.control.controller.Controller`): the config in force, its
    resizer and keeper, the layout changes a heal asks for, and word of each heal."""

    config: PipelineConfig
    resizer: Resizer | None  # an elastic run's: shrinks when a replacement cannot be placed
    keeper: Any  # a SnapshotKeeper when workers run off the driver's node

    def settle_saves(self) -> None: ...  # finishes a background save in flight

    # no whole pipeline can be placed: the model on as many fewer stages as the policy picks for the room
    def repartition(self, reports: list | None, view: LayoutView) -> None: ...

    # a re-partitioned run's: at a step boundary, back to the configured stages when their workers are ready
    def restore_partition(self) -> bool: ...

    def heal_started(self, failure: WorkersFailed) -> None: ...

    def settled(self, reason: str) -> None: ...  # a layout change (a grow) is over
