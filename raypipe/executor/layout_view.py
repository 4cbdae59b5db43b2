"""The frozen :class:`~raypipe.control.view.LayoutView` a heal hands the policy
(:func:`raypipe.control.policy.decide_failure`): the layout in force, the failed
workers and the snapshots and checkpoint a heal can restore from, built from the
config, the group's size and the snapshots held (:mod:`raypipe.executor.recovery`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raypipe.config import PipelineConfig
from raypipe.control.view import FailedWorker, LayoutView, SnapshotView
from raypipe.core.topology import Topology
from raypipe.executor.snapshot import Snapshot


def layout_view(config: PipelineConfig, workers: int, elastic: bool, failures: int, snapshots: Sequence[Snapshot],
                checkpoint_step: int | None, failed: dict[int, str] | None = None, **facts: Any) -> LayoutView:
    """The layout of ``workers`` under ``config`` (``elastic``: a resizer may shrink it), the
    workers ``failed`` (rank: why), the ``failures`` counted so far, the ``snapshots`` held
    (oldest first) and the newest checkpoint's step, with the decision point's ``facts``."""
    stages = config.num_stages
    topology = Topology(stages, workers // stages)
    return LayoutView(
        num_stages=stages, replicas=topology.num_replicas,
        min_replicas=config.min_replicas, max_replicas=config.max_replicas, elastic=elastic,
        shard_optimizer=config.shard_optimizer,
        failed=tuple(FailedWorker(rank, *topology.coordinates(rank), why)
                     for rank, why in sorted((failed or {}).items())),
        failures=failures, max_failures=config.max_failures, snapshot_every=config.snapshot_every,
        snapshots=tuple(SnapshotView(snapshot.step, True if snapshot.kept is None else snapshot.copied,
                                     kept_off_node=snapshot.kept is not None) for snapshot in snapshots),
        checkpoint_step=checkpoint_step, can_repartition=True,
        placement_timeout_s=config.placement_timeout_s, **facts)
