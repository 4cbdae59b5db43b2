"""A trainer's partition of the model onto stages, when the cluster changes under it.

When not even one whole pipeline can be placed (a one-replica run, or every
replica lost a worker, with no room for a replacement), the model goes on with
one replica on the most stages that can be placed and that the memory model says
fit (:mod:`raypipe.planning.repartition`); the new workers adopt every layer of
the old ones' newest snapshot and the steps since are redone. Such a run is
slower per step and holds more per worker, so it goes back to the configured
stages as soon as there is room for them
(:class:`~raypipe.executor.partition_return.PartitionReturn`), and an elastic
run then grows its replicas again. A mixin of
:class:`~raypipe.trainer.PipelineTrainer`, whose config, group, executor and
recovery it changes.
"""
from __future__ import annotations

import logging
import time

from raypipe.config import PipelineConfig
from raypipe.core.schedule import make_schedule
from raypipe.core.topology import Topology
from raypipe.errors import PlacementError
from raypipe.executor.elastic import Resizer, layout
from raypipe.executor.partition_return import PartitionReturn
from raypipe.models.layers import layer_parameter_count
from raypipe.planning.repartition import fewer_stages, layer_bytes
from raypipe.runtime import cluster, spread
from raypipe.runtime.group import StageGroup

logger = logging.getLogger("raypipe")


class Partitioning:
    """Fewer stages when no whole pipeline fits, and back (of a :class:`~raypipe.trainer.PipelineTrainer`)."""

    def _repartition(self, reports: list | None) -> None:
        """Not even one whole pipeline can be placed: start one replica on fewer stages
        when the merged stages are predicted to fit a worker (waiting up to
        ``placement_timeout_s`` for room), else raise :class:`PlacementError`. The
        recovery then gives the new workers the state of the old ones."""
        old_stages = self.config.num_stages
        self._group.shutdown()  # the survivors' room goes to the new partition; their state is in snapshots
        if self._recovery.resizer is not None:  # its placement groups are of the old partition
            self._recovery.resizer.close()
            self._recovery.resizer = None
        if self._partition_return is not None:  # its room too, while the fewer stages are placed
            self._partition_return.close()
            self._partition_return = None
        balance = self._fewer_stages(reports)
        self._use_partition(self.config.replace(num_stages=len(balance), balance=balance), balance)
        self._launch(None)
        configured, configured_balance = self._configured
        self._partition_return = PartitionReturn(
            self._executor.actor_class(), layout(self._stage_specs(configured, configured_balance), 1,
                                                 self.micro_batches_per_step), self._bundle)
        self._record_resize("repartition")
        logger.warning("raypipe: re-partitioned from %d to %d stage(s) (layers per stage %s): no room for a whole "
                       "pipeline of %d", old_stages, len(balance), balance, old_stages)

    def _restore_partition(self) -> bool:
        """At a step boundary of a re-partitioned run: once the configured pipeline's
        workers (started beside when there was room) are ready, they take over every
        layer and the running workers go; or, where the configured pipeline fits only
        in the running workers' room too, it takes their place (see
        :mod:`~raypipe.executor.partition_return`). An elastic run then grows its
        replicas again. Whether the group changed."""
        returning = self._partition_return
        if returning is None:
            return False
        group = returning.poll()
        if group is not None:
            self._settle_saves()  # a save in flight reads the running workers
            group = returning.take_over(self._group)
            if group is not None:
                self._swap_in(group)
                self._give_datasets(range(self.topology.world_size))
            return group is not None
        if self.config.snapshot_every and returning.fits_in_place(self._group.workers):
            self._settle_saves()
            source = self._recovery.relaunch(self._swap_in_place)
            logger.warning("raypipe: the new workers took their state from the %s", source)
            return True
        return False

    def _swap_in(self, group: StageGroup) -> None:
        """The configured pipeline's ``group`` (ready) replaces the running workers (the
        caller gives its readers the datasets)."""
        self._partition_return, running_stages = None, self.config.num_stages
        self._group.shutdown()
        config, balance = self._configured
        self._use_partition(config, balance)
        self._group = group
        self._executor.connect(group)
        if config.elastic:
            self._grow_again()
        self._record_resize("restore")
        logger.warning("raypipe: back from %d to the configured %d stage(s) (layers per stage %s)",
                       running_stages, config.num_stages, balance)

    def _swap_in_place(self) -> None:
        """The running workers go (their state is snapshotted), and the configured pipeline
        is placed in their room; if the room went elsewhere, the fewer stages start again."""
        self._group.shutdown()
        group = self._partition_return.start_in_place(self.config.placement_timeout_s)
        if group is not None:
            self._swap_in(group)
            return
        logger.warning("raypipe: the configured %d stage(s) could not be placed in the room the running ones left "
                       "within %gs (placement_timeout_s); going on with %d", self._configured[0].num_stages,
                       self.config.placement_timeout_s, self.config.num_stages)
        self._launch(None)

    def _grow_again(self) -> None:
        """An elastic run back on its configured stages asks for its other replicas again."""
        bundles = [self._bundle] * self.config.num_stages
        pending = [spread.replica_group(bundles) for _ in range(self.config.max_replicas - 1)]
        self._recovery.resizer = Resizer(self.config, self._executor, self._stage_specs(), self._bundle, pending,
                                         self._resized)

    def _use_partition(self, config: PipelineConfig, balance: list[int]) -> None:
        """The trainer, its executor and its recovery run ``config``'s stages, split by ``balance``, on one replica."""
        self.config, self.balance, self.topology = config, balance, Topology(len(balance), 1)
        self.schedule = make_schedule(config.schedule, len(balance), config.num_micro_batches)
        self._executor.config = self._recovery.config = config
        self._executor.schedule = self.schedule

    def _fewer_stages(self, reports: list | None) -> list[int]:
        """The balance of the most stages (fewer than now) that fits the room there is."""
        costs = [layer_parameter_count(layer) for layer in self._model[0]]
        stats = [report.stats for report in reports[:self.config.num_stages]] if reports else None
        predicted = (layer_bytes(self.balance, [4 * cost for cost in costs], stats) if stats
                     else [8.0 * cost for cost in costs])
        capacity = cluster.worker_memory_bytes(self._device_memory)
        deadline = time.monotonic() + self.config.placement_timeout_s
        while True:
            placeable = cluster.placeable_workers(self._bundle)
            balance = fewer_stages(costs, predicted, self.config.num_stages, placeable, capacity)
            if balance is not None:
                return balance
            if time.monotonic() > deadline:
                raise PlacementError(
                    f"no whole pipeline of {self.config.num_stages} stage(s) can be placed, and no partition onto "
                    f"fewer stages fits: room for {placeable} worker(s) of {self._bundle}, {capacity / 2**30:.1f} "
                    f"GiB per worker, the model predicted at {sum(predicted) / 2**30:.2f} GiB; waited "
                    f"{self.config.placement_timeout_s:g}s (placement_timeout_s). Saved checkpoints are intact: "
                    "load_checkpoint resumes from the newest")
            time.sleep(0.5)
