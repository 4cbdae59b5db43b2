"""The partition of the model onto stages, when the cluster changes under a run.

When not even one whole pipeline can be placed (a one-replica run, or every
replica lost a worker, with no room for a replacement), the model goes on with
one replica on the most stages that can be placed and that the memory model says
fit (:mod:`raypipe.planning.repartition`); the new workers adopt every layer of
the old ones' newest snapshot and the steps since are redone. Such a run is
slower per step and holds more per worker, so it goes back to the configured
stages as soon as there is room for them
(:class:`~raypipe.executor.partition_return.PartitionReturn`), and an elastic
run then grows its replicas again.

How many stages (counting the room the running workers free when they go, not
only the room free now) and when to go back are :mod:`raypipe.control.policy`'s
decisions; this action measures the room, asks, and carries them out through
its :class:`~raypipe.control.controller.Controller`, which owns the layout.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import ray

from raypipe.control.policy import Raise, Repartition, ReturnToConfigured, WaitForRoom, decide_failure, decide_scaling
from raypipe.config import PipelineConfig
from raypipe.control.view import LayoutView, Room
from raypipe.core.partition import worker_layers
from raypipe.errors import PlacementError
from raypipe.executor.elastic import layout
from raypipe.executor.partition_return import PartitionReturn
from raypipe.models.layers import layer_parameter_count
from raypipe.planning.repartition import fewer_stages, layer_bytes
from raypipe.runtime import cluster
from raypipe.runtime.group import StageGroup

if TYPE_CHECKING:
    from raypipe.control.controller import Controller

logger = logging.getLogger("raypipe")


class Partitioning:
    """Fewer stages when no whole pipeline fits, and back: an action of ``controller``."""

    def __init__(self, controller: Controller) -> None:
        self._controller = controller

    def repartition(self, reports: list | None, view: LayoutView) -> None:
        """Not even one whole pipeline can be placed (``view``: what the heal knows): start
        one replica on as many fewer stages as the failure policy picks from the memory
        model's answer and the room (waiting up to ``placement_timeout_s`` for room), else
        raise :class:`PlacementError`. The recovery then gives the new workers the state
        of the old ones."""
        control = self._controller
        old_stages = control.config.num_stages
        control.close_resizer()
        if control.partition_return is not None:  # its room too, while the fewer stages are placed
            control.partition_return.close()
            control.partition_return = None
        balance = self._fewer_stages(reports, view)
        control.swap_group(None)  # the survivors' room goes to the new partition; their state is in snapshots
        config = fewer_stages_config(control.config, balance)
        control.use_partition(config, balance)
        control.launch(None)
        control.partition_return = self._configured_return()
        control.record_resize("repartition")
        logger.warning("raypipe: re-partitioned from %d to %d stage(s) (layers per stage %s, schedule %s): no room "
                       "for a whole pipeline of %d", old_stages, len(balance), balance, config.schedule, old_stages)

    def restore_partition(self) -> bool:
        """At a step boundary of a re-partitioned run: once the configured pipeline's
        workers (started beside when there was room) are ready, they take over every
        layer and the running workers go; or, where the configured pipeline fits only
        in the running workers' room too, it takes their place (see
        :mod:`~raypipe.executor.partition_return`). An elastic run then grows its
        replicas again. Whether the group changed."""
        control = self._controller
        returning = control.partition_return
        if returning is None:
            return False
        group = returning.poll()
        config = control.config
        # the room is measured only while a swap in place may come (not started beside, not found impossible)
        measure = group is None and returning.in_place and not returning.started and config.snapshot_every
        decision = decide_scaling(LayoutView(
            num_stages=config.num_stages, replicas=control.topology.num_replicas,
            configured_stages=returning.num_stages, snapshot_every=config.snapshot_every,
            configured_ready_beside=group is not None, configured_started_beside=returning.started,
            return_in_place_allowed=returning.in_place,
            room=returning.room(control.group.workers) if measure else None))
        if not isinstance(decision, ReturnToConfigured):
            return False
        control.returning(f"back to the configured {returning.num_stages} stage(s)"
                          f"{' in place' if decision.in_place else ' beside'}")
        if not decision.in_place:
            control.settle_saves()  # a save in flight reads the running workers
            group = returning.take_over(control.group)
            if group is not None:
                self._swap_in(group)
                control.give_datasets(range(control.topology.world_size))
            control.settled("the configured stages took over" if group is not None else "stayed")
            return group is not None
        control.settle_saves()  # in place: the running workers are snapshotted and go first
        source = control.recovery.relaunch(self._swap_in_place)
        logger.warning("raypipe: the new workers took their state from the %s", source)
        control.settled(f"swapped in place from the {source}")
        return True

    def _swap_in(self, group: StageGroup) -> None:
        """The configured pipeline's ``group`` (ready) replaces the running workers (the
        caller gives its readers the datasets)."""
        control = self._controller
        control.partition_return, running_stages = None, control.config.num_stages
        config, balance = control.configured
        control.swap_group(None)
        control.use_partition(config, balance)
        control.swap_group(group)
        if config.elastic:
            control.grow_again()
        control.record_resize("restore")
        logger.warning("raypipe: back from %d to the configured %d stage(s) (layers per stage %s)",
                       running_stages, config.num_stages, balance)

    def _swap_in_place(self) -> None:
        """The running workers go (their state is snapshotted), and the configured pipeline
        is placed in their room; if the room went elsewhere, the fewer stages start again."""
        control = self._controller
        control.swap_group(None)
        try:
            group = control.partition_return.start_in_place(control.config.placement_timeout_s)
        except ray.exceptions.RayError as error:  # a new worker died while it started: asked for beside again
            logger.warning("raypipe: a worker of the configured pipeline died while it started in place (%s)",
                           str(error).strip().splitlines()[-1])
            control.partition_return = self._configured_return()
            control.partition_return.in_place = False
            group = None
        if group is not None:
            self._swap_in(group)
            return
        logger.warning("raypipe: the configured %d stage(s) could not be placed in the room the running ones left "
                       "within %gs (placement_timeout_s); going on with %d", control.configured[0].num_stages,
                       control.config.placement_timeout_s, control.config.num_stages)
        control.launch(None)

    def _configured_return(self) -> PartitionReturn:
        """The configured pipeline (one replica), asked for beside the running one."""
        control = self._controller
        configured, configured_balance = control.configured
        specs = layout(control.stage_specs(configured, configured_balance), 1, control.config.micro_batches_per_step)
        return PartitionReturn(control.executor.actor_class(), specs, control.bundle)

    def _fewer_stages(self, reports: list | None, view: LayoutView) -> list[int]:
        """The balance of the stages the failure policy picks (the most, fewer than now,
        that the memory model says fit a worker and that the room has workers for, the
        running workers' room included: they go before the new ones start)."""
        control = self._controller
        config, bundle = control.config, control.bundle
        costs = [layer_parameter_count(layer) for layer in control.model.layers]
        stats = [report.stats for report in reports[:config.num_stages]] if reports else None
        running = worker_layers(control.balance, config.num_stages, config.placement)
        predicted = (layer_bytes(running, [4 * cost for cost in costs], stats) if stats
                     else [8.0 * cost for cost in costs])
        capacity = cluster.worker_memory_bytes(control.device_memory)
        balances = {}  # the memory model's answer: each count of fewer stages that fits, and its balance
        for count in range(1, min(config.num_stages, len(costs) + 1)):
            balance = fewer_stages(costs, predicted, count + 1, count, capacity)
            if balance is not None and len(balance) == count:
                balances[count] = balance
        freed = [worker.node_id for worker in control.group.workers]  # every worker's bundle (a lost node's frees none)
        started = time.monotonic()
        while True:
            room = Room(cluster.placeable_workers(bundle), cluster.placeable_workers(bundle, freed))
            decision = decide_failure(replace(view, room=room, stage_counts_that_fit=tuple(balances),
                                              waited_for_room_s=time.monotonic() - started))
            if isinstance(decision, Repartition):
                return balances[decision.num_stages]
            if not isinstance(decision, WaitForRoom):
                reason = decision.message if isinstance(decision, Raise) else str(decision)
                raise PlacementError(
                    f"{reason} of {bundle}, {capacity / 2**30:.1f} GiB per worker, the model predicted at "
                    f"{sum(predicted) / 2**30:.2f} GiB; waited {config.placement_timeout_s:g}s "
                    "(placement_timeout_s). Saved checkpoints are intact: load_checkpoint resumes from the newest")
            time.sleep(0.5)


def fewer_stages_config(config: PipelineConfig, balance: list[int]) -> PipelineConfig:
    """The config of a re-partition to ``balance`` (layers per stage, one chunk each): a schedule of
    model chunks (interleaved_1f1b, zbv) becomes 1f1b, which runs on any number of stages with
    any number of micro-batches and holds no more than they do; the others stay."""
    chunked = config.virtual_stages > 1
    return config.replace(num_stages=len(balance), balance=balance,
                          **({"schedule": "1f1b", "virtual_stages": 1} if chunked else {}))
