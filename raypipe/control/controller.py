"""The controller: the one owner of the running layout.

It alone changes what runs: the :class:`~raypipe.runtime.group.StageGroup`
(workers and their placement groups), the topology, the partition of the
layers onto stages, the config in force, the snapshots (through its
:class:`~raypipe.executor.recovery.Recovery`), the placement groups asked for
(the :class:`~raypipe.executor.elastic.Resizer`'s, a re-partitioned run's way
back) and the snapshot keeper. Everything else reads a frozen :class:`Layout`.

It moves through explicit :class:`ControllerState` states, logging one INFO
line per transition (``controller <from> -> <to> (<reason>)``) and exporting
``raypipe_controller_state{state}`` when metrics are served::

    starting --placed--> running                 (--start failed--> stopped)
    running | repartitioned --a worker failed, the policy heals--> healing
    healing --healed on the configured partition--> running
    healing --healed on fewer stages--> repartitioned
    healing --Shrink (no room for a replacement)--> resizing --healed--> running
    healing --Repartition (no room for a whole pipeline)--> repartitioned
    running --Grow (a new replica ready)--> resizing --admitted--> running
    repartitioned --ReturnToConfigured--> resizing --swapped--> running
    any --Raise (too many failures, below min, nothing to heal from)--> failed
    any --shutdown--> stopped

Which way a change goes is decided by :mod:`raypipe.control.policy`; the
recovery, the resizer and :class:`~raypipe.control.partitioning.Partitioning`
carry the decisions out, through the controller's methods.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from raypipe.config import PipelineConfig
from raypipe.control.partitioning import Partitioning
from raypipe.control.view import LayoutView
from raypipe.core.micro_batches import MicroBatches
from raypipe.core.partition import worker_chunks
from raypipe.core.schedule import make_schedule
from raypipe.core.topology import Topology
from raypipe.errors import WorkersFailed
from raypipe.executor import make_executor
from raypipe.executor.base import Executor, StepOutcome
from raypipe.executor.elastic import Resizer, layout
from raypipe.executor.partition_return import PartitionReturn
from raypipe.executor.recovery import Recovered, Recovery
from raypipe.runtime import cluster
from raypipe.runtime.data_access import DEFAULT_SHIP_DATA_LIMIT_BYTES, datasets_for_readers
from raypipe.runtime.group import StageGroup, WorkerInfo
from raypipe.runtime.snapshot_keeper import start_keeper
from raypipe.stage.spec import WorkerSpec

logger = logging.getLogger("raypipe")


class ControllerState(enum.Enum):
    """Where the controller is; the metric's ``state`` label is the value."""

    STARTING = "starting"  # placing and starting the workers
    RUNNING = "running"  # the configured partition runs steps
    HEALING = "healing"  # replacing failed workers and restoring their state
    RESIZING = "resizing"  # replicas shrink or grow, or the configured partition comes back
    REPARTITIONED = "repartitioned"  # steps run on fewer stages than configured (no room for a whole pipeline)
    FAILED = "failed"  # a failure could not be healed: the run is over (load_checkpoint resumes)
    STOPPED = "stopped"  # shut down


STATES: tuple[str, ...] = tuple(state.value for state in ControllerState)


@dataclass(frozen=True)
class StageModel:
    """What every stage worker is built from: the layers and the user's factories."""

    layers: tuple
    optimizer: Callable | None
    loss_fn: Callable
    lr_scheduler: Callable | None
    loss_count_fn: Callable


@dataclass(frozen=True)
class Layout:
    """The running layout, frozen: what every reader outside the controller sees."""

    state: ControllerState
    config: PipelineConfig  # the config in force (a re-partitioned run's has fewer stages)
    balance: tuple[int, ...]  # layers per stage in force
    topology: Topology
    actors: tuple  # the workers' actor handles, in rank order
    workers: tuple[WorkerInfo, ...]
    configured_stages: int

    @property
    def first_replica(self) -> tuple:
        """Replica 0's workers, one per stage."""
        return self.actors[:self.topology.num_stages]

    @property
    def repartitioned(self) -> bool:
        return self.config.num_stages != self.configured_stages


class Controller:
    """Starts, heals, resizes, re-partitions and stops the stage workers of one run.

    ``metrics`` (a :class:`~raypipe.observability.metrics.MetricsExporter`, or None)
    gets the state, each heal and each resize; ``settle_saves()`` finishes a
    checkpoint save in flight before a heal or a swap reads the workers;
    ``steps()`` is the trainer's count of committed steps.
    """

    def __init__(self, config: PipelineConfig, balance: Sequence[int], model: StageModel, *,
                 metrics: Any = None, settle_saves: Callable[[], None] = lambda: None,
                 steps: Callable[[], int] = lambda: 0) -> None:
        self._config, self._balance = config, list(balance)
        self._configured = (config, list(balance))  # a re-partitioned run goes back to it when there is room
        self.model, self._metrics, self.settle_saves = model, metrics, settle_saves
        self._steps = steps  # the trainer's committed steps: where a resize happened, the first snapshot's step
        self.topology = Topology(config.num_stages, config.max_replicas)  # until placed: an elastic run's may be fewer
        self.schedule = make_schedule(config.schedule, config.num_stages, config.num_micro_batches,
                                      config.virtual_stages)
        self.executor: Executor = make_executor(config, self.schedule)
        self.recovery = Recovery(self.executor, self, self.give_datasets, self._recovered)
        self.partitioning = Partitioning(self)
        self.group: StageGroup | None = None
        self.resizer: Resizer | None = None  # an elastic run's: shrinks when a replacement cannot be placed, grows
        self.partition_return: PartitionReturn | None = None  # a re-partitioned run's way back
        self.keeper: Any = None  # a SnapshotKeeper when workers run off the driver's node
        self.use_gpu: bool | None = None
        self.bundle: dict[str, float] | None = None
        self.device_memory: int | None = None
        self.recoveries: list[Recovered] = []  # each healed failure event: how long, from where, steps replayed
        # (step, direction, replicas after): "shrink"/"grow" (elastic), "repartition"/"restore" (stages)
        self.resizes: list[tuple[int, str, int]] = []
        self._datasets: tuple[Any, Any] | None = None
        self._ship_limit = DEFAULT_SHIP_DATA_LIMIT_BYTES
        self._shipped: dict[int, Any] = {}  # shipped copies: the driver holds them while the stages read them
        self.state = ControllerState.STARTING
        self._export_state()

    # -- the frozen view ----------------------------------------------------
    @property
    def config(self) -> PipelineConfig:
        """The config in force (the one place it is held)."""
        return self._config

    @property
    def balance(self) -> list[int]:
        return list(self._balance)

    @property
    def layout(self) -> Layout:
        group = self.group
        return Layout(self.state, self._config, tuple(self._balance), self.topology,
                      () if group is None else tuple(group.actors), () if group is None else tuple(group.workers),
                      self._configured[0].num_stages)

    @property
    def configured(self) -> tuple[PipelineConfig, list[int]]:
        return self._configured[0], list(self._configured[1])

    # -- states ---------------------------------------------------------------
    def _enter(self, state: ControllerState, reason: str) -> None:
        if state is self.state:
            return
        logger.info("controller %s -> %s (%s)", self.state.value, state.value, reason)
        self.state = state
        self._export_state()

    def _export_state(self) -> None:
        if self._metrics is not None:
            self._metrics.record_controller_state(self.state.value, STATES)

    def heal_started(self, failure: WorkersFailed) -> None:
        """The recovery noted a failure event (again, while healing: the same heal)."""
        self._enter(ControllerState.HEALING, ", ".join(
            f"replica {replica} stage {stage} {why}" for (replica, stage), why in sorted(failure.workers.items())))

    def settled(self, reason: str) -> None:
        """A layout change is over: steps run on the configured partition, or on fewer stages."""
        layout_now = f"{self.topology.num_replicas} replica(s) of {self._config.num_stages} stage(s)"
        steady = ControllerState.REPARTITIONED if self.layout_repartitioned else ControllerState.RUNNING
        self._enter(steady, f"{reason}; {layout_now}")

    @property
    def layout_repartitioned(self) -> bool:
        return self._config.num_stages != self._configured[0].num_stages

    # -- start and stop -------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        """Place and start the workers (as many replicas as there is room for, at
        least ``min``) and take the first snapshot; what each worker reported."""
        config = self._config
        cluster.connect(config.ray_address, (self.topology.world_size + config.spare_workers) * config.cpus_per_stage)
        self.use_gpu = cluster.resolve_use_gpu(config)
        if cluster.num_alive_nodes() > 1:  # workers may run off this node: snapshots must outlive theirs
            self.keeper = start_keeper()
        self.bundle = cluster.worker_bundle(config, self.use_gpu)
        try:
            placed, pending = cluster.reserve_between(config.min_replicas, config.max_replicas,
                                                      [self.bundle] * config.num_stages, config.placement_timeout_s)
            self.topology = Topology(config.num_stages, len(placed))
            if config.elastic:
                self.resizer = Resizer(config, self.executor, self.stage_specs(), self.bundle, pending, self._resized)
            infos = self.launch(placed)
        except BaseException as error:
            self.stop(f"start failed: {type(error).__name__}")  # the keeper, placement groups asked for, workers
            raise
        self.device_memory = infos[0].get("device_memory_bytes")
        self.recovery.snapshot(self._steps(), first=True)
        self.settled("placed")
        return infos

    def stage_specs(self, config: PipelineConfig | None = None, balance: list[int] | None = None
                    ) -> list[WorkerSpec]:
        """One spec per stage of the partition in force (else of ``config`` split by ``balance``), as replica 0's."""
        config, balance = config or self._config, balance or self._balance
        model, last = self.model, config.loss_stage
        specs = []
        for stage, chunks in enumerate(worker_chunks(balance, config.num_stages, config.placement)):
            indices = [index for chunk in chunks for index in chunk]
            specs.append(WorkerSpec(
                stage=stage, num_stages=config.num_stages, layers=tuple(model.layers[i] for i in indices),
                layer_indices=tuple(indices), config=config, use_gpu=self.use_gpu, optimizer_factory=model.optimizer,
                loss_fn=model.loss_fn if stage == last else None, loss_count_fn=model.loss_count_fn,
                scheduler_factory=model.lr_scheduler,
                chunk_sizes=tuple(map(len, chunks))))
        return specs

    def launch(self, placed: list | None) -> list[dict[str, Any]]:
        """Start the workers of the partition and topology in force (in ``placed``
        placement groups, else reserved now) and connect them; what each reported."""
        specs = layout(self.stage_specs(), self.topology.num_replicas, self._config.micro_batches_per_step)
        self.group = StageGroup(self.executor.actor_class(), specs, self.bundle, self._config.placement_timeout_s,
                                placed)
        infos = self.group.wait_ready()
        self.executor.connect(self.group)
        return infos

    def stop(self, reason: str = "shutdown") -> None:
        """Free the workers, the placement groups asked for and the keeper. Idempotent."""
        if self.group is not None:
            self.executor.close()
            self.group.shutdown()
            self.group = None
            self._shipped = {}
        if self.resizer is not None:
            self.resizer.close()
        if self.partition_return is not None:
            self.partition_return.close()
            self.partition_return = None
        if self.keeper is not None:
            ray.kill(self.keeper)
            self.keeper = None
        self._enter(ControllerState.STOPPED, reason)

    # -- running --------------------------------------------------------------
    def run_step(self, data_step: int, batch: MicroBatches | None, loss_scale: float | None) -> StepOutcome:
        """One step, healed and redone after failures (see :class:`Recovery`)."""
        return self._ending_on_error(lambda: self.recovery.run_step(data_step, batch, loss_scale))

    def between_steps(self, run: Callable[[], Any], step: int, during: str) -> Any:
        """``run()`` (reads the workers, changes none), healed when a worker fails."""
        return self._ending_on_error(lambda: self.recovery.between_steps(run, step, during))

    def heal_if_broken(self, step: int, before: str) -> None:
        self._ending_on_error(lambda: self.recovery.heal_if_broken(step, before))

    def _ending_on_error(self, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except BaseException as error:
            if not self.executor.usable and self.state is not ControllerState.STOPPED:
                first_line = (str(error).splitlines() or [type(error).__name__])[0]
                self._enter(ControllerState.FAILED, first_line.rstrip(":")[:200])
            raise

    def committed(self, steps_done: int, logged: Any) -> None:
        self.recovery.committed(steps_done, logged)

    @property
    def failures(self) -> list[str]:
        return list(self.recovery.failures)

    # -- datasets -------------------------------------------------------------
    def attach_datasets(self, train: Any, validation: Any, ship_data_limit_bytes: int) -> None:
        self._datasets, self._ship_limit, self._shipped = (train, validation), ship_data_limit_bytes, {}
        self.give_datasets(range(self.topology.world_size))

    def give_datasets(self, indices: Sequence[int]) -> None:
        """Workers ``indices`` that read data (every replica's first and last stage) get the datasets,
        checked where each runs (a replacement too, which may run on another node)."""
        if self._datasets is None:
            return
        last = self._config.loss_stage
        readers = [(where.replica, where.stage, self.group.actors[rank]) for rank, where in
                   ((rank, self.topology.coordinates(rank)) for rank in indices) if where.stage in (0, last)]
        own = datasets_for_readers(readers, self._datasets, self.executor.get, self._ship_limit, self._shipped)
        self.executor.get([actor.attach_datasets.remote(*datasets) for (_, _, actor), datasets in zip(readers, own)])

    # -- layout changes (the recovery, the resizer and the partitioning call these) ----------------
    def repartition(self, reports: list | None, view: LayoutView) -> None:
        """No whole pipeline can be placed: the model on fewer stages (see :class:`Partitioning`)."""
        old_stages = self._config.num_stages
        self.partitioning.repartition(reports, view)
        self._enter(ControllerState.REPARTITIONED, f"re-partitioned from {old_stages} to "
                    f"{self._config.num_stages} stage(s): no room for a whole pipeline")

    def restore_partition(self) -> bool:
        """At a step boundary of a re-partitioned run: back to the configured stages when
        the policy says so. Whether the group changed."""
        return self.partitioning.restore_partition()

    def returning(self, reason: str) -> None:
        """A re-partitioned run's configured pipeline is taking over (beside or in place)."""
        self._enter(ControllerState.RESIZING, reason)

    def use_partition(self, config: PipelineConfig, balance: list[int]) -> None:
        """From now on ``config``'s stages, split by ``balance``, run on one replica."""
        self._config, self._balance, self.topology = config, list(balance), Topology(config.num_stages, 1)
        self.schedule = make_schedule(config.schedule, config.num_stages, config.num_micro_batches,
                                      config.virtual_stages)
        self.executor.config, self.executor.schedule = config, self.schedule  # the executor's own copy

    def swap_group(self, group: StageGroup | None) -> None:
        """The running workers go; ``group`` (ready, of the partition in force), if any, runs the next steps."""
        if self.group is not None:
            self.group.shutdown()
            self.recovery.forget_reports()  # of the workers that went
        self.group = group
        if group is not None:
            self.executor.connect(group)

    def grow_again(self) -> None:
        """An elastic run back on its configured stages asks for its other replicas again."""
        from raypipe.runtime import spread

        bundles = [self.bundle] * self._config.num_stages
        pending = [spread.replica_group(bundles) for _ in range(self._config.max_replicas - 1)]
        self.resizer = Resizer(self._config, self.executor, self.stage_specs(), self.bundle, pending, self._resized)

    def close_resizer(self) -> None:
        if self.resizer is not None:  # its placement groups are of the old partition
            self.resizer.close()
            self.resizer = None

    def record_resize(self, direction: str) -> None:
        self.resizes.append((self._steps(), direction, self.topology.num_replicas))
        if self._metrics is not None:
            self._metrics.record_resize(direction, self.topology.num_replicas)

    def _resized(self, direction: str, num_replicas: int, new_ranks: list[int]) -> None:
        """After an elastic resize: the new layout's topology, datasets for new readers, metrics."""
        self._enter(ControllerState.RESIZING, f"{direction} to {num_replicas} replica(s)")
        self.topology = Topology(self._config.num_stages, num_replicas)
        self.give_datasets(new_ranks)
        self.record_resize(direction)

    def _recovered(self, recovered: Recovered) -> None:
        self.recoveries.append(recovered)
        if self._metrics is not None:
            self._metrics.record_recovery(recovered.reasons, recovered.seconds, recovered.replayed_steps)
        self.settled(f"healed from the {recovered.source}")



__all__ = ["STATES", "Controller", "ControllerState", "Layout", "StageModel"]
