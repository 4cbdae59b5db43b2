"""The controller: the one owner of the running layout and of the step loop.

It alone changes what runs: the :class:`~raypipe.runtime.group.StageGroup`
(workers and their placement groups), the topology, the partition of the
layers onto stages, the config in force, the snapshots, the placement groups
asked for (the :class:`~raypipe.control.elastic.Resizer`'s, a re-partitioned
run's :class:`~raypipe.control.partitioning.PartitionReturn`) and the snapshot
keeper. Everything else reads a frozen :class:`Layout`.

It moves through the states of :mod:`raypipe.control.states` (each a class with
its data), logging one INFO line per transition (``controller <from> -> <to>
(<reason>)``) and exporting ``raypipe_controller_state{state}`` when metrics are
served::

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

Slow workers are found after every step from the workers' own compute
(:mod:`raypipe.control.stragglers`): each is reported, and with ``on_slow="replace"``
swapped for a warm spare at the next step boundary, its state moved from it; with
``on_slow="rebalance"`` the layers are split again at the same number of stages, away
from its stage in every replica, the workers started again in their bundles and
adopting their new layers from a snapshot taken then (as a re-partition's do).

Every change reads: controller state -> policy (a pure decision of
:mod:`raypipe.control.policy` over a frozen :class:`~raypipe.control.view.LayoutView`)
-> mechanism (:mod:`~raypipe.control.compound` replaces workers,
:mod:`~raypipe.control.state_transfer` gives them state from
:mod:`~raypipe.control.snapshots` or :mod:`~raypipe.control.persisted`,
:mod:`~raypipe.control.elastic` resizes, :mod:`~raypipe.control.partitioning`
measures and starts another partition) -> controller state. Only this module asks
the policies, and no mechanism holds the controller.

A heal, so that a failure costs no step, no sample and no bit of the result:
when a step raises :class:`~raypipe.errors.WorkersFailed`,

1. the event is counted and the policy asked (raise, or replace): the failed
   workers are killed, the step's tasks on the others end, and the controller
   is :class:`~raypipe.control.states.Healing` (its workers, reasons, start);
2. at the next step boundary the failed workers are replaced from their specs,
   by warm spares where they are up, else in their bundles (Ray re-places a bundle
   whose node was lost), within ``replace_timeout_s``; with no room the policy
   shrinks, re-partitions onto fewer stages, or raises. At tensor_parallel t > 1 a
   spare is a group of t on one node and takes a whole stage's place: the stage's
   surviving ranks are released and replaced too;
3. the replacements get their state from the smallest source the policy picks: a
   data-parallel sibling (nothing replayed), else every worker restores the newest
   snapshot (an older one when it was lost; resharded with ZeRO-1 after a shrink),
   else the newest intact checkpoint, and the steps since are replayed;
4. communication groups are re-formed under a fresh rendezvous, dataset readers
   get their datasets again;
5. the failed step is redone.

A worker lost while a heal (or another layout change) runs is folded into it
(:mod:`raypipe.control.compound`). Seeds depend only on (step, micro-batch,
layer) and reductions run in a fixed order, so on the same layout the result is
bitwise that of a run without failures. Each failure event counts against
``max_failures``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import ray

from raypipe.config import PipelineConfig
from raypipe.control.compound import folded, lost_workers, replace_within
from raypipe.control.elastic import Resizer, replica_specs
from raypipe.control.partitioning import (PartitionReturn, fewer_stages_config, fewer_stages_that_fit, layer_step_costs,
                                          room)
from raypipe.control.persisted import PersistedCheckpoints
from raypipe.control.policy import (BELOW_MINIMUM, RELEASED, TOO_MANY_FAILURES, CopyFromSiblings, Grow, LoadCheckpoint,
                                    Raise, Repartition, RestoreSnapshot, ReturnToConfigured, Shrink, WaitForRoom,
                                    decide_failure, decide_scaling, replicas_hold_copies, spare_stages)
from raypipe.control.snapshots import LoggedStep, Snapshots
from raypipe.control.state_transfer import CopyLost, Load, StateTransfer, survivors_that_ended
from raypipe.control.states import (GROW, SHRINK, STATES, ControllerState, Failed, Healing, Recovered,
                                    Repartitioned, Resizing, Running, Starting, State, Stopped, heal_under_way)
from raypipe.control.stragglers import (ComputeHistory, RebalanceSlow, ReplaceSlow, SlowView, SlowWorker, decide_slow,
                                        find_slow, slowdowns, well_stage_seconds)
from raypipe.control.view import FailedWorker, LayoutView, repartitioned
from raypipe.core.micro_batches import MicroBatches
from raypipe.core.partition import worker_chunks
from raypipe.core.schedule import make_schedule
from raypipe.core.topology import Topology
from raypipe.errors import (BoundaryShapeChanged, PlacementError, RaypipeError, TooManyFailures, WorkersFailed,
                            place_name)
from raypipe.executor import make_executor
from raypipe.executor.base import Executor, StepOutcome
from raypipe.runtime import cluster
from raypipe.runtime.data_access import DEFAULT_SHIP_DATA_LIMIT_BYTES, datasets_for_readers
from raypipe.runtime.group import StageGroup, WorkerInfo
from raypipe.runtime.snapshot_keeper import start_keeper
from raypipe.stage.spec import WorkerSpec

logger = logging.getLogger("raypipe")


@dataclass(frozen=True)
class StageModel:
    """What every stage worker is built from: the layers and the user's factories."""

    layers: tuple
    optimizer: Callable | None
    loss_fn: Callable
    lr_scheduler: Callable | None
    loss_count_fn: Callable


class SlowFound(NamedTuple):
    """A worker found slow (:mod:`~raypipe.control.stragglers`): at which data step, which and by how
    much, on which node, and when (the end of its last compute op in that step, ``time.time()``)."""

    data_step: int
    worker: SlowWorker
    node_id: str
    at: float


class SlowReplaced(NamedTuple):
    """Workers found slow and swapped for warm spares (``on_slow="replace"``): their ranks, which spare
    took each place, and the seconds the swap took between two steps."""

    ranks: tuple[int, ...]
    spares: dict[int, str]
    seconds: float


class SlowRebalanced(NamedTuple):
    """Layers moved away from slow workers' stages (``on_slow="rebalance"``): after how many committed
    steps, the decision (the new layers per stage, the slowest stage's predicted seconds before and
    after, the slowdowns balanced for), the layers per stage before, and the seconds it took between
    two steps."""

    commits: int
    decision: RebalanceSlow
    balance_before: tuple[int, ...]
    seconds: float


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
        """Replica 0's workers, ``tensor_parallel`` per stage (in rank order)."""
        return self.actors[:self.topology.num_stages * self.topology.tensor_parallel]

    @property
    def repartitioned(self) -> bool:
        """Whether steps run on other stages than configured."""
        return repartitioned(self.config.num_stages, self.configured_stages)


class Controller:
    """Starts, runs, heals, resizes, re-partitions and stops the stage workers of one run.

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
        # until placed: an elastic run's may be fewer
        self.topology = Topology(config.num_stages, config.max_replicas, config.tensor_parallel)
        self.schedule = make_schedule(config.schedule, config.num_stages, config.num_micro_batches,
                                      config.virtual_stages)
        self.executor: Executor = make_executor(config, self.schedule)
        # what a heal restores from: the snapshots, and as the last resort the newest checkpoint and the steps since
        self.snapshots = Snapshots(self.executor, config.snapshot_every)
        self._persisted = PersistedCheckpoints(keep_batches=not config.snapshot_every)
        self._transfer = StateTransfer(self.executor, self._persisted, settle_saves)
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
        self._failures: list[str] = []  # each failure event, as the error named it
        self._commits = 0  # the steps every worker's state had ended after the last step that returned
        self._last_reports: list | None = None  # the last step's reports (a re-partition sizes stages by them)
        # the workers' own compute per step, against which a slow worker is found (control/stragglers.py)
        self._compute = ComputeHistory(config.slow_factor, config.slow_steps)
        self.slow_workers: list[SlowFound] = []  # every worker found slow, in order
        self.slow_replaced: list[SlowReplaced] = []  # every swap of slow workers for spares (on_slow="replace")
        self._slow_to_replace: tuple[int, ...] = ()  # ranks to swap for spares at the next step boundary
        self.slow_rebalanced: list[SlowRebalanced] = []  # every rebalance away from slow workers (on_slow="rebalance")
        self._slow_to_rebalance: RebalanceSlow | None = None  # the partition to take at the next step boundary
        # the slowdowns the partition in force was balanced for (their workers stay slow in their places), until
        # the workers change
        self._rebalanced_for: tuple[SlowWorker, ...] = ()
        self._datasets: tuple[Any, Any] | None = None
        self._ship_limit = DEFAULT_SHIP_DATA_LIMIT_BYTES
        self._shipped: dict[int, Any] = {}  # shipped copies: the driver holds them while the stages read them
        self.current_state: State = Starting()
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
    def state(self) -> ControllerState:
        """Which state the controller is in (:attr:`current_state` holds its data)."""
        return self.current_state.kind

    @property
    def layout(self) -> Layout:
        group = self.group
        return Layout(self.state, self._config, tuple(self._balance), self.topology,
                      () if group is None else tuple(group.actors), () if group is None else tuple(group.workers),
                      self._configured[0].num_stages)

    @property
    def configured(self) -> tuple[PipelineConfig, list[int]]:
        return self._configured[0], list(self._configured[1])

    @property
    def failures(self) -> list[str]:
        """Every failure event so far, as its error named it."""
        return list(self._failures)

    @property
    def spares(self) -> Any:
        """The running group's pool of warm spare workers (None without workers or spares)."""
        return None if self.group is None else self.group.spares

    # -- states ---------------------------------------------------------------
    def _enter(self, state: State) -> None:
        """``state`` from now on; a change of kind is logged and exported (a heal's data may change within it)."""
        before, self.current_state = self.current_state, state
        if state.kind is not before.kind:
            logger.info("controller %s -> %s (%s)", before.kind.value, state.kind.value, state.reason)
            self._export_state()

    def _export_state(self) -> None:
        if self._metrics is not None:
            self._metrics.record_controller_state(self.state.value, STATES)

    def _settled(self, reason: str) -> None:
        """A layout change (a heal too) is over: steps run on the configured partition, or on fewer stages."""
        reason = f"{reason}; {self.topology.num_replicas} replica(s) of {self._config.num_stages} stage(s)"
        self._compute.clear()  # other workers, or other layers on them: baselines start again
        self._slow_to_replace, self._slow_to_rebalance, self._rebalanced_for = (), None, ()  # of the layout before
        self._enter(Repartitioned(reason=reason) if self.layout.repartitioned else Running(reason=reason))

    # -- start and stop -------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        """Place and start the workers (as many replicas as there is room for, at
        least ``min``) and take the first snapshot; what each worker reported."""
        config = self._config
        cluster.connect(config.ray_address, (self.topology.world_size + config.spare_workers) * config.cpus_per_stage)
        self.use_gpu = cluster.resolve_use_gpu(config)
        if cluster.num_alive_nodes() > 1:  # workers may run off this node: snapshots must outlive theirs
            self.keeper = self.snapshots.keeper = self._transfer.keeper = start_keeper()
        self.bundle = cluster.worker_bundle(config, self.use_gpu)
        try:
            placed, pending = cluster.reserve_between(config.min_replicas, config.max_replicas,
                                                      [cluster.stage_bundle(self.bundle, config.tensor_parallel)]
                                                      * config.num_stages,
                                                      config.placement_timeout_s)
            self.topology = Topology(config.num_stages, len(placed), config.tensor_parallel)
            if config.elastic:
                self.resizer = Resizer(config, self.executor, self.stage_specs(), self.bundle, pending)
            infos = self.launch(placed)
        except BaseException as error:
            self.stop(f"start failed: {type(error).__name__}")  # the keeper, placement groups asked for, workers
            raise
        self.device_memory = infos[0].get("device_memory_bytes")
        self.snapshots.take(self._steps(), first=True)
        self._settled("placed")
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
        specs = replica_specs(self.stage_specs(), self.topology.num_replicas, self._config.micro_batches_per_step)
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
        self._enter(Stopped(reason=reason))

    # -- what the trainer, the checkpoint manager and the metrics call ----------------
    def run_step(self, data_step: int, batch: MicroBatches | None, loss_scale: float | None) -> StepOutcome:
        """One step, after any layout change due at this step boundary (a heal, a grow, the
        way back to the configured partition), healed and redone after any number of
        failure events within ``max_failures``."""
        return self._ending_on_error(lambda: self._step_loop(data_step, batch, loss_scale))

    def committed(self, steps_done: int, logged: LoggedStep) -> None:
        """After a committed step: logged for replay after a checkpoint; a snapshot when due."""
        self._persisted.committed(logged)
        self.snapshots.committed(steps_done, logged)

    def between_steps(self, run: Callable[[], Any], step: int, during: str) -> Any:
        """``run()``, a call that reads the workers and changes none of them (an
        evaluation, reading out their state), after the committed step ``step``:
        when a worker died or hung since that step or during ``run``, the group is
        healed (to the state of ``step``) and ``run`` runs again."""
        return self._ending_on_error(lambda: self._healed_around(run, step, during))

    def heal_if_broken(self, step: int, before: str) -> None:
        """Make the group whole (see :meth:`between_steps`) if a worker died or hung since step ``step``."""
        def check() -> None:
            failure = self._probe(step, f"found before {before}")
            if failure is not None:
                raise failure

        self.between_steps(check, step, f"before {before}")

    def evaluate(self, data_step: int, batch: MicroBatches | None) -> float:
        """The mean loss of ``batch`` (None: the validation dataset's ``data_step``), forward
        only, healed as :meth:`between_steps` after the trainer's committed steps."""
        return self.between_steps(lambda: self.executor.evaluate(data_step, batch), self._steps(), "during evaluate")

    def check_usable(self) -> None:
        """Raise when an earlier failure left the workers unusable."""
        self.executor.check_usable()

    def gather(self, refs: list, step: int, during: str) -> list:
        """The results of calls to the workers after the committed step ``step``; a worker
        that hangs first raises :class:`WorkersFailed` (for :meth:`between_steps` to heal)."""
        return self.executor.gather(refs, step, during)

    def get(self, refs: list) -> list:
        """The results of calls to the workers, raising raypipe's errors."""
        return self.executor.get(refs)

    def before_next_step(self, actors: list[Any]) -> None:
        """Calls just submitted to ``actors`` (a checkpoint's copy of the state) run before their next step."""
        self.executor.before_next_step(actors)

    def checkpoint_saved(self, root_uri: str, step: int, optimizer_parts: int) -> None:
        """A checkpoint of step ``step`` is being written: a heal with no snapshot left loads it
        and replays the steps since."""
        self._persisted.saved(root_uri, step, optimizer_parts)

    def state_loaded(self, steps: int, checkpoint: tuple[str, int, int] | None = None) -> None:
        """The workers' state was replaced outside a step, at ``steps`` committed steps: from the
        checkpoint ``(root_uri, step, optimizer_parts)``, or (None) from a state dict, which
        no checkpoint leads to. Older snapshots are void: a fresh one is taken."""
        if checkpoint is None:
            self._persisted.forget()
        else:
            self._persisted.loaded(*checkpoint)
        self.snapshots.take(steps, first=True)

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

    # -- the step loop ----------------------------------------------------------
    def _step_loop(self, data_step: int, batch: MicroBatches | None, loss_scale: float | None) -> StepOutcome:
        while True:
            try:
                with self._folded("while the layout changed"):  # a worker lost meanwhile: the same heal
                    self._change_layout()
                return self._run(data_step, batch, loss_scale)
            except WorkersFailed as failure:
                self._note(failure)
            except BoundaryShapeChanged as changed:
                self._keep_headers(changed)

    def _keep_headers(self, changed: BoundaryShapeChanged) -> None:
        """A boundary's signature changed with the data (``boundary_shapes="learned"``): the
        step changed nothing and every worker is back in a fresh group, so the same step runs
        again with headers on the keys it named. Not a failure: no ``max_failures`` is charged."""
        if set(changed.keys) <= self.executor.dynamic_keys:  # a marked key never raises this: a bug, not data
            raise changed
        logger.warning("raypipe: %s; retrying the step with headers on message key(s) %s",
                       str(changed).splitlines()[0], list(changed.keys))
        self.executor.mark_dynamic(changed.keys)

    def _change_layout(self) -> None:
        """At a step boundary, the one layout change due: the heal under way, else the slow workers
        to swap for spares, else the rebalance away from slow workers, else an elastic run's grow,
        else a re-partitioned run's way back to its configured stages."""
        healing = heal_under_way(self.current_state)
        if healing is not None:
            self._heal(healing)
        elif self._slow_to_replace:
            self._replace_slow()
        elif self._slow_to_rebalance is not None:
            self._rebalance_slow()
        elif self.resizer is not None:
            self._grow()
        elif self.partition_return is not None and self._return_to_configured():
            self.snapshots.fresh()

    def _healed_around(self, run: Callable[[], Any], step: int, during: str) -> Any:
        while True:
            try:
                with self._folded(during, step):  # an error of a worker lost: a failure to heal
                    healing = heal_under_way(self.current_state)
                    if healing is not None:
                        self._heal(healing)
                    return run()
            except WorkersFailed as failure:
                self._note(failure)

    def _run(self, data_step: int, batch: MicroBatches | None, loss_scale: float | None) -> StepOutcome:
        # a snapshot due is submitted with the step, which commits only once it is copied
        submitted, snapshot = self.executor.start_step(data_step, batch, loss_scale, snapshot=self.snapshots.due)
        if snapshot is not None:
            self.snapshots.keep_due(snapshot)
        outcome = self.executor.finish_step(submitted)
        self._commits = outcome.reports[0].commits
        self._last_reports = outcome.reports
        self._watch_speed(data_step, outcome.reports)
        return outcome

    def _watch_speed(self, data_step: int, reports: list) -> None:
        """Each worker's own compute in the step against its baseline, its stage in the other
        replicas and its tensor-parallel peers (:mod:`~raypipe.control.stragglers`): every
        worker's ratio to the metrics, one WARNING line for each worker newly found slow, and with
        ``on_slow="replace"`` the policy's :func:`~raypipe.control.stragglers.decide_slow` asked which
        to swap for spares at the next step boundary; with ``"rebalance"``, as workers are newly found,
        which partition to take there (each stage's time when well from the baselines, each layer's
        share from its cost)."""
        history, events = self._compute, [event for report in reports for event in report.events]
        history.record(events)
        view = history.view()
        if self._metrics is not None:
            self._metrics.record_slowdowns(slowdowns(view))
        topology, workers, found = self._group_topology(), self.executor.group.workers, find_slow(view)
        newly = history.newly_slow(found)
        for slow in newly:
            rank = topology.rank(slow.replica, slow.stage, slow.tp_rank)
            node = workers[rank].node_id
            at = max(event.end for event in events if (event.replica, event.stage, event.tp_rank) == slow.worker)
            self.slow_workers.append(SlowFound(data_step, slow, node, at))
            logger.warning("raypipe: slow worker replica %d stage %d tp_rank %d on node %s: its own compute is %.2fx "
                           "its baseline, %d steps in a row (slow_factor=%g, on_slow=%r)", slow.replica, slow.stage,
                           slow.tp_rank, node, slow.factor, self._config.slow_steps, self._config.slow_factor,
                           self._config.on_slow)
        if self._config.on_slow == "replace" and found:
            spares = self.spares
            decision = decide_slow(SlowView(found, self._config.on_slow, 0 if spares is None else spares.up_count(),
                                            topology.num_stages, topology.num_replicas, topology.tensor_parallel))
            left = {topology.rank(*slow.worker) for slow in newly}
            if isinstance(decision, ReplaceSlow):
                self._slow_to_replace = decision.ranks
                left &= set(decision.left)
            if left:  # said once, as workers are newly found slow (not at every step they stay slow and unswapped)
                logger.warning("raypipe: on_slow='replace' leaves %s in place: %s",
                               ", ".join(place_name(topology.place(rank)) for rank in sorted(left)), decision.why)
        elif self._config.on_slow == "rebalance" and newly and not self.layout.repartitioned:
            # asked once as workers are newly found slow (not at every step they stay slow): after a rebalance
            # their baselines start again at their slow pace, so they are found again only if they slow further
            decision = decide_slow(SlowView(
                found, self._config.on_slow, 0, topology.num_stages, topology.num_replicas, topology.tensor_parallel,
                balance=tuple(self._balance),
                stage_seconds=well_stage_seconds(view.baselines, topology.num_stages, self._rebalanced_for),
                layer_costs=tuple(layer_step_costs(self.model.layers, self._config)), rebalanced=self._rebalanced_for))
            if isinstance(decision, RebalanceSlow):
                self._slow_to_rebalance = decision
            else:
                logger.warning("raypipe: on_slow='rebalance' leaves the layers where they are: %s", decision.why)

    def _replace_slow(self) -> None:
        """``on_slow="replace"``, between two steps: each worker found slow is swapped for a warm
        spare that is up. A checkpoint save in flight is finished first; then its state is copied
        from it (alive, at the same step as every worker) into the spare through the object store,
        as a heal copies a sibling's, so nothing is replayed; the group is re-formed, the readers
        among them get their datasets, and a fresh snapshot is taken. The baselines start again
        (other workers)."""
        ranks, self._slow_to_replace = self._slow_to_replace, ()
        group, started = self.executor.group, time.monotonic()
        self.settle_saves()  # a checkpoint save in flight reads the workers about to go
        states = {rank: group.actors[rank].snapshot.remote() for rank in ranks}
        self.executor.wait(list(states.values()))  # copied before the workers go
        survivors = [actor for rank, actor in enumerate(group.actors) if rank not in ranks]
        spares = replace_within(group, list(ranks), self._config.replace_timeout_s)
        self.executor.get([group.actors[rank].restore.remote(states[rank]) for rank in ranks])
        self.executor.reconnect(survivors)
        self.give_datasets(ranks)
        self.snapshots.fresh()
        self._compute.clear()
        topology = self._group_topology()
        replaced = SlowReplaced(tuple(ranks), spares, time.monotonic() - started)
        self.slow_replaced.append(replaced)
        logger.warning("raypipe: swapped slow %s for %s in %.1fs, its state moved from it, no step replayed",
                       ", ".join("replica {} stage {} tp_rank {}".format(*topology.coordinates(rank)) for rank in ranks),
                       # a spare group (t > 1) is named once for its stage's ranks
                       ", ".join(dict.fromkeys(spares.get(rank, "a new process") for rank in ranks)), replaced.seconds)

    def _rebalance_slow(self) -> None:
        """``on_slow="rebalance"``, between two steps: the layers split as the decision says, the
        same stages in every replica, carried out as a re-partition is (:meth:`_relaunch`): a
        checkpoint save in flight is finished, every worker snapshotted, started again in its own
        bundle (its node: the slow place keeps a worker, now with its fewer layers) from its new
        spec, and adopts its layers from that snapshot; nothing is replayed and no failure is
        charged. The partition becomes the configured one (a run re-partitioned later returns to
        it), the baselines start again (other layers), and the slowdowns balanced for are kept
        until the workers change, so a later rebalance for another worker counts them."""
        decision, self._slow_to_rebalance = self._slow_to_rebalance, None
        started, before = time.monotonic(), tuple(self._balance)
        balance = list(decision.balance)
        config = self._config.replace(balance=balance)
        self.settle_saves()  # a checkpoint save in flight reads the workers about to go

        def restart_in_place() -> None:
            self._config, self._balance, self._configured = config, balance, (config, balance)
            self.executor.config = config  # the executor's own copy
            group = self.executor.group
            group.set_specs(replica_specs(self.stage_specs(), self._group_topology().num_replicas,
                                          config.micro_batches_per_step))
            if self.resizer is not None:  # a replica it adds takes the new layers
                self.resizer.take_partition(config, self.stage_specs())
            replace_within(group, list(range(len(group.actors))), config.replace_timeout_s)
            self._last_reports = None  # of the old layers: a re-partition must not size stages by them
            self.executor.connect(group)

        source = self._relaunch(restart_in_place)
        self.snapshots.fresh()
        self._compute.clear()
        self._rebalanced_for = decision.slowed
        rebalanced = SlowRebalanced(self._commits, decision, before, time.monotonic() - started)
        self.slow_rebalanced.append(rebalanced)
        logger.warning("raypipe: rebalanced away from slow %s: layers per stage %s -> %s in every replica, the "
                       "slowest stage predicted %.4gs -> %.4gs a step; in %.1fs, from the %s, no step replayed",
                       ", ".join(f"replica {slow.replica} stage {slow.stage} tp_rank {slow.tp_rank} "
                                 f"({slow.factor:.2f}x)" for slow in decision.slowed),
                       list(before), balance, decision.before, decision.after, rebalanced.seconds, source)

    def _ending_on_error(self, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except BaseException as error:
            if not self.executor.usable and self.state is not ControllerState.STOPPED:
                first_line = (str(error).splitlines() or [type(error).__name__])[0]
                self._enter(Failed(type(error).__name__, reason=first_line.rstrip(":")[:200]))
            raise

    def _probe(self, step: int, detail: str, known: dict[int, str] | None = None) -> WorkersFailed | None:
        """The workers found dead or hung now (with those ``known`` lost, by rank), as a failure
        after step ``step``; None when every one answers."""
        return lost_workers(self.executor.group.actors, self._config.hang_timeout_s, self._config.num_stages, step,
                            detail, self._config.tensor_parallel, known)

    def _folded(self, during: str, step: int | None = None) -> Any:
        """A worker lost ``during`` a layout change (or a call after step ``step``) raises
        :class:`WorkersFailed` (see :mod:`raypipe.control.compound`)."""
        return folded(lambda detail, known: self._probe(self._commits if step is None else step, detail, known),
                      during, lambda: self.executor.usable)

    # -- the heal: state -> policy -> mechanism -> state --------------------------------
    def _view(self, failed: dict[int, str] | None = None, **facts: Any) -> LayoutView:
        """The layout in force, the workers ``failed`` (rank: why), the failures so far and what a
        heal can restore from, with the decision point's ``facts``: what the policy decides over."""
        config, topology = self._config, self._group_topology()
        return LayoutView(
            num_stages=config.num_stages, replicas=topology.num_replicas, tensor_parallel=topology.tensor_parallel,
            min_replicas=config.min_replicas, max_replicas=config.max_replicas, elastic=self.resizer is not None,
            shard_optimizer=config.shard_optimizer,
            failed=tuple(FailedWorker(rank, *topology.coordinates(rank)[:2], why)
                         for rank, why in sorted((failed or {}).items())),
            failures=len(self._failures), max_failures=config.max_failures, snapshot_every=config.snapshot_every,
            snapshots=self.snapshots.views(), checkpoint_step=self._persisted.newest_step,
            # a re-partition keeps t: each new rank adopts the layers' parts of the same tp_rank's snapshots
            can_repartition=True,
            placement_timeout_s=config.placement_timeout_s, **facts)

    def _group_topology(self) -> Topology:
        """The ranks of the running group (a shrink changes it before the topology in force)."""
        config = self._config
        return Topology.of_workers(config.num_stages, len(self.executor.group.actors), config.tensor_parallel)

    def _note(self, failure: WorkersFailed) -> None:
        """A failure event: count it, ask the policy, kill its workers and let the step end on
        the others (a survivor found lost meanwhile is a failure event of its own); the heal
        under way (if any) takes them in."""
        under_way = heal_under_way(self.current_state)
        self._failures.append(str(failure))
        logger.warning("raypipe: %s; healing (failure %d of max_failures=%s)", failure, len(self._failures),
                       self._config.max_failures)
        topology = self._group_topology()
        failed = {topology.rank(*worker): why for worker, why in failure.workers.items()}
        known = dict(under_way.failed) if under_way is not None else {}
        decision = decide_failure(self._view({**known, **failed}))  # the survivors not asked yet
        if isinstance(decision, Raise):
            raise self._cannot_heal(decision, str(failure)) from failure
        state = self.current_state
        if under_way is None:  # a new heal; a grow cut short left workers with the grown layout's specs
            relayout = GROW if isinstance(state, Resizing) and state.direction == GROW else None
            under_way = Healing({}, frozenset(), time.monotonic(), relayout)
        reason = ", ".join(f"{place_name(place)} {why}" for place, why in sorted(failure.workers.items()))
        self._enter(replace(under_way, failed={**known, **failed}, reason=reason))
        self.executor.group.kill(list(failed))
        more = {rank: why for rank, why in self.executor.drain(failed).items() if rank not in failed}
        self._enter(replace(under_way, failed={**known, **failed}, reasons=under_way.reasons | set(failed.values()),
                            reason=reason))
        if more:  # survivors found dead or hung as the failed step ended (one stopped meanwhile): their own failure
            self._note(self.executor.workers_failed(failure.step, more, "found as the failed step ended"))

    def _heal(self, healing: Healing) -> None:
        """Replace the failed workers (or shrink, or re-partition, as the policy says), give
        them their state, re-form communication, replay, and settle."""
        failed = sorted(healing.failed)
        group = self.executor.group
        ended = self._survivors_ended(failed)
        decision = decide_failure(self._view(dict(healing.failed), survivors_ended_step=ended))
        if isinstance(decision, Raise):
            raise self._cannot_heal(decision, self._failures[-1])
        healing, released = self._release_for_spares(healing)
        failed, ended = sorted(healing.failed), None if ended is None else ended - released
        survivors = [actor for index, actor in enumerate(group.actors) if index not in failed]
        spares: dict[int, str] = {}  # the failed workers whose place a warm spare took
        try:
            spares = replace_within(group, failed, self._config.replace_timeout_s)
        except PlacementError as error:
            view = self._view(dict(healing.failed), unplaced=error.unplaced)
            decision = decide_failure(view)
            if isinstance(decision, Shrink):
                healing, failed, survivors = self._shrink(healing, decision)
                ended = self._survivors_ended(failed)
            elif isinstance(decision, (Repartition, WaitForRoom)):  # fewer stages: the room decides how many
                return self._healed(healing, *self._repartition(view, healing), failed=[])
            else:
                cannot = self._cannot_heal(decision, self._failures[-1], error)
                if cannot is error:
                    raise
                raise cannot from error
        if healing.relayout:  # the new layout first: with ZeRO-1 each worker rebuilds for its new owners
            self.executor.relayout(survivors)
            shrunk = healing.relayout == SHRINK
            replay, source = self._give_state(failed, ended, shrunk=shrunk)
            healing = replace(healing, relayout=None)
            if shrunk:
                self._resized(SHRINK, failed, healing)
            else:
                self._enter(healing)
                self.give_datasets(failed)
        else:
            replay, source = self._give_state(failed, ended)
            self.executor.reconnect(survivors)
            self.give_datasets(failed)
        if spares:
            source += f" (replaced by {', '.join(dict.fromkeys(spares[index] for index in sorted(spares)))})"
        self._healed(healing, replay, source, failed)

    def _release_for_spares(self, healing: Healing) -> tuple[Healing, frozenset[int]]:
        """With warm spares up at tensor_parallel > 1 (each a group of t: a stage's place), the
        stages the policy gives them (:func:`~raypipe.control.policy.spare_stages`) are swapped
        whole: their surviving ranks are killed and replaced with the failed ones (the state
        source restores them as any replacement). The heal with them, and their ranks."""
        if self._config.tensor_parallel == 1 or not self._config.spare_workers or self.spares is None:
            return healing, frozenset()
        swap = spare_stages(self._view(dict(healing.failed), spares_up=self.spares.up_count()))
        if not swap.released:
            return healing, frozenset()
        self.executor.group.kill(list(swap.released))
        healing = replace(healing, failed={**healing.failed, **dict.fromkeys(swap.released, RELEASED)})
        self._enter(healing)
        topology = self._group_topology()
        logger.warning("raypipe: %s swapped whole for warm spares: released %s",
                       ", ".join("replica {} stage {}".format(*topology.coordinates(first)[:2])
                                 for first in swap.stages),
                       ", ".join(place_name(topology.place(rank)) for rank in swap.released))
        return healing, frozenset(swap.released)

    def _survivors_ended(self, failed: list[int]) -> frozenset[int] | None:
        """The survivors whose state ended the failed step (all of them when one does not
        answer); None, without asking, when the replicas do not hold copies anyway."""
        if not replicas_hold_copies(self._view()):
            return None
        return survivors_that_ended(self.executor.group.actors, failed, self._commits, self._config.hang_timeout_s)

    def _give_state(self, failed: list[int], ended: frozenset[int] | None, shrunk: bool = False
                    ) -> tuple[list[LoggedStep], str]:
        """The replacements ``failed`` get their state from where the policy says (siblings
        when no survivor ``ended`` the failed step, else every worker rolls back; ``shrunk``
        with ZeRO-1: every worker adopts the snapshots of its stage in every replica of the
        old layout): the steps to replay, and where the state came from."""
        view = self._view(dict.fromkeys(failed, ""), survivors_ended_step=ended, replaced=True, shrunk=shrunk)
        decision = decide_failure(view)
        if isinstance(decision, CopyFromSiblings):
            return self._transfer.transfer_state(decision, self.snapshots.held)
        if isinstance(decision, RestoreSnapshot) and decision.reshard:
            per_replica = self._config.num_stages * self._config.tensor_parallel
            replay, source = self._restore(view, self._transfer.reshard(per_replica), as_taken=True)
            return replay, f"{source}, resharded"
        return self._restore(view)

    def _restore(self, view: LayoutView | None = None, load: Load | None = None, needed: int | None = None,
                 as_taken: bool = False) -> tuple[list[LoggedStep], str]:
        """Every worker back to the state the policy picks: the newest snapshot, an older one
        when a newer one was lost (a worker died while it was taken), the newest intact
        checkpoint when none is left; each copy that does not load is marked lost and the
        policy asked again. The steps to replay since, and which state it was. ``load``,
        ``needed``, ``as_taken``: see :meth:`StateTransfer.transfer_state`; ``view``: what
        the heal knows (default: the layout now)."""
        view = replace(view or self._view(), replaced=True)
        lost, lost_at, checkpoint_lost = "", set(), False
        while True:
            snapshots = tuple(replace(snapshot, lost=position in lost_at)
                              for position, snapshot in enumerate(view.snapshots))
            decision = decide_failure(replace(view, snapshots=snapshots, checkpoint_lost=checkpoint_lost))
            if isinstance(decision, RestoreSnapshot):
                position = max(position for position, snapshot in enumerate(snapshots)
                               if snapshot.step == decision.step and not snapshot.lost)
                what = f"restoring the snapshot of step {decision.step}"
            elif isinstance(decision, LoadCheckpoint):
                position, what = None, "loading the checkpoint"
                if self.snapshots.held:
                    logger.warning("raypipe: every snapshot was lost (%s); healing from the newest checkpoint", lost)
            else:
                self.executor.usable = False
                raise RaypipeError(f"no snapshot or checkpoint to restore (every copy was lost: {lost}); "
                                   "load_checkpoint resumes from the newest persisted checkpoint")
            try:
                replay, source = self._transfer.transfer_state(decision, self.snapshots.held, position, load, needed,
                                                               as_taken)
            except CopyLost as copy:
                failure = self._probe(self._commits, f"{what}: {copy.why}")  # lost with a worker: fold it in
                if failure is not None:
                    raise failure from None
                if position is None:
                    lost, checkpoint_lost = (f"{lost}; {copy.why}" if lost else copy.why), True
                else:
                    lost, lost_at = lost or copy.why, lost_at | {position}
                continue
            if isinstance(decision, RestoreSnapshot) and decision.older:
                logger.warning("raypipe: the snapshot of step %d was lost (%s); restored the one of step %d",
                               self.snapshots.held[-1].step, lost, decision.step)
            return replay, source

    def _cannot_heal(self, decision: Raise, failure: str, placement: PlacementError | None = None) -> RaypipeError:
        """The error that ends the run for the policy's ``decision``; the executor is unusable after it."""
        self.executor.usable = False
        if decision.reason == TOO_MANY_FAILURES:
            return TooManyFailures(self._config.max_failures, self._failures)
        if placement is not None:  # no room to replace, nor to shrink or re-partition
            return self.resizer.below_minimum(placement.unplaced) if decision.reason == BELOW_MINIMUM else placement
        return RaypipeError(f"{failure}: {decision.message}; load_checkpoint resumes from the newest checkpoint")

    def _healed(self, healing: Healing, replay: list[LoggedStep], source: str, failed: list[int]) -> None:
        """Replay the steps since the state restored, snapshot, record the heal and settle."""
        for logged in replay:
            self._run(logged.data_step, logged.batch, logged.loss_scale)
        self.snapshots.fresh()  # of the healed state: a lost one is never fallen back to again
        seconds = time.monotonic() - healing.since
        topology = self._group_topology()
        replaced = [place_name(topology.place(index)) for index in failed]
        logger.warning("raypipe: healed in %.1fs (replaced %s) from the %s, replayed %d step(s)",
                       seconds, replaced or "none", source, len(replay))
        recovered = Recovered(sorted(healing.reasons), seconds, len(replay), source)
        self.recoveries.append(recovered)
        if self._metrics is not None:
            self._metrics.record_recovery(recovered.reasons, recovered.seconds, recovered.replayed_steps)
        self._settled(f"healed from the {source}")

    # -- resizes ------------------------------------------------------------------
    def _shrink(self, healing: Healing, decision: Shrink) -> tuple[Healing, list[int], list[Any]]:
        """Drop the replicas the policy names (whose replacements found no room; an elastic
        run): the heal with its failed workers left (replaced), by their new ranks, and the
        survivors."""
        failed = healing.failed
        kept = self.resizer.shrink(decision.drop_replicas)
        self.snapshots.keep_only(kept)
        # by the new ranks from now on: a worker lost before the heal ends is added to these
        healing = replace(healing, failed={rank: failed[old] for rank, old in enumerate(kept) if old in failed},
                          relayout=SHRINK)
        self._enter(healing)
        actors = self.executor.group.actors
        return healing, sorted(healing.failed), [actors[rank] for rank, old in enumerate(kept) if old not in failed]

    def _grow(self) -> None:
        """Admit a new replica when one is ready and the scaling policy says so (the step
        boundary is the only time the layout changes), and snapshot the grown group."""
        ready = self.resizer.poll()
        config, running = self._config, self.resizer.running
        decision = decide_scaling(LayoutView(num_stages=config.num_stages, replicas=running,
                                             min_replicas=config.min_replicas, max_replicas=config.max_replicas,
                                             elastic=True, new_replicas_ready=ready))
        if not isinstance(decision, Grow):
            return
        self._enter(Resizing(GROW, reason=f"{GROW} to {running + decision.by} replica(s)"))  # a worker lost: relayout
        new_ranks = self.resizer.admit()
        if not new_ranks:
            self._settled("the new replica did not join")
            return
        self._resized(GROW, new_ranks)
        self.snapshots.fresh()
        self._settled("grew")

    def _resized(self, direction: str, new_ranks: list[int], healing: Healing | None = None) -> None:
        """After an elastic resize (``healing``: the heal a shrink is part of): the new
        layout's topology, datasets for new readers, metrics."""
        num_replicas = self.resizer.running
        self._enter(Resizing(direction, healing, reason=f"{direction} to {num_replicas} replica(s)"))
        self.topology = Topology(self._config.num_stages, num_replicas, self._config.tensor_parallel)
        self.give_datasets(new_ranks)
        self._record_resize(direction)

    def _record_resize(self, direction: str) -> None:
        self.resizes.append((self._steps(), direction, self.topology.num_replicas))
        if self._metrics is not None:
            self._metrics.record_resize(direction, self.topology.num_replicas)

    # -- partitions ---------------------------------------------------------------
    def _repartition(self, view: LayoutView, healing: Healing) -> tuple[list[LoggedStep], str]:
        """No whole pipeline can be placed (``view``: what the heal knows): one replica on as
        many fewer stages as the policy picks for the room (waiting up to
        ``placement_timeout_s`` for room, else :class:`PlacementError`); its workers adopt
        the layers of the old stages' newest whole snapshot (else the newest checkpoint),
        and the steps since are replayed."""
        old_stages = self._config.num_stages
        if self.resizer is not None:  # its placement groups are of the old partition
            self.resizer.close()
            self.resizer = None
        if self.partition_return is not None:  # its room too, while the fewer stages are placed
            self.partition_return.close()
            self.partition_return = None
        balance = self._fewer_stages(view)
        self._swap_group(None)  # the survivors' room goes to the new partition; their state is in snapshots
        config = fewer_stages_config(self._config, balance)
        self._use_partition(config, balance)
        self.launch(None)
        self.partition_return = self._configured_return()
        self._record_resize("repartition")
        logger.warning("raypipe: re-partitioned from %d to %d stage(s) (layers per stage %s, schedule %s): no room "
                       "for a whole pipeline of %d", old_stages, len(balance), balance, config.schedule, old_stages)
        self._enter(Repartitioned(healing, reason=f"re-partitioned from {old_stages} to {config.num_stages} "
                                                  "stage(s): no room for a whole pipeline"))
        self.give_datasets(range(len(self.executor.group.actors)))
        # every replica's snapshots with ZeRO-1 (each holds the optimizer part of the parameters it owned),
        # else one replica's: its p x t workers
        needed = None if config.shard_optimizer else old_stages * config.tensor_parallel
        replay, source = self._restore(load=self._transfer.adopt_layers(needed), needed=needed, as_taken=True)
        return replay, f"{source}, re-partitioned onto {config.num_stages} stage(s)"

    def _fewer_stages(self, view: LayoutView) -> list[int]:
        """The balance of the stages the failure policy picks (the most, fewer than now,
        that the memory model says fit a worker and that the room has workers for, the
        running workers' room included: they go before the new ones start)."""
        config, bundle = self._config, self.bundle
        fewer = fewer_stages_that_fit(self.model.layers, self._last_reports, config, self._balance,
                                      self.device_memory)
        running = list(self.group.workers)  # every worker's bundle is freed for the new partition
        started = time.monotonic()
        while True:
            decision = decide_failure(replace(view, room=room(bundle, running, config.tensor_parallel),
                                              stage_counts_that_fit=tuple(fewer.balances),
                                              waited_for_room_s=time.monotonic() - started))
            if isinstance(decision, Repartition):
                return fewer.balances[decision.num_stages]
            if not isinstance(decision, WaitForRoom):
                reason = decision.message if isinstance(decision, Raise) else str(decision)
                raise PlacementError(
                    f"{reason} of {bundle}, {fewer.capacity_bytes / 2**30:.1f} GiB per worker, the model predicted at "
                    f"{fewer.predicted_bytes / 2**30:.2f} GiB; waited {config.placement_timeout_s:g}s "
                    "(placement_timeout_s). Saved checkpoints are intact: load_checkpoint resumes from the newest")
            time.sleep(0.5)

    def _return_to_configured(self) -> bool:
        """At a step boundary of a re-partitioned run: once the configured pipeline's workers
        (started beside when there was room) are ready, they take over every layer and the
        running workers go; or, where the configured pipeline fits only in the running
        workers' room too, it takes their place. An elastic run then grows its replicas
        again. Whether the group changed."""
        returning, config = self.partition_return, self._config
        group = returning.poll()
        # the room is measured only while a swap in place may come (not started beside, not found impossible)
        measure = group is None and returning.in_place and not returning.started and config.snapshot_every
        decision = decide_scaling(LayoutView(
            num_stages=config.num_stages, replicas=self.topology.num_replicas,
            configured_stages=returning.num_stages, snapshot_every=config.snapshot_every,
            configured_ready_beside=group is not None, configured_started_beside=returning.started,
            return_in_place_allowed=returning.in_place,
            room=returning.room(self.group.workers) if measure else None))
        if not isinstance(decision, ReturnToConfigured):
            return False
        self._enter(Resizing("restore", reason=f"back to the configured {returning.num_stages} stage(s)"
                                                f"{' in place' if decision.in_place else ' beside'}"))
        self.settle_saves()  # a save in flight reads the running workers
        if not decision.in_place:
            group = returning.take_over(self.group)
            if group is not None:
                self._swap_in(group)
                self.give_datasets(range(self.topology.world_size))
            self._settled("the configured stages took over" if group is not None else "stayed")
            return group is not None
        source = self._relaunch(self._swap_in_place)  # the running workers are snapshotted and go first
        logger.warning("raypipe: the new workers took their state from the %s", source)
        self._settled(f"swapped in place from the {source}")
        return True

    def _relaunch(self, launch: Callable[[], None]) -> str:
        """Between steps, another group in place of this one (``launch()``: stop the
        workers, start those of another partition): every worker is snapshotted first,
        and the new workers adopt every layer of that snapshot (of an older one or a
        checkpoint when it was lost, the steps since redone). Where the state came from."""
        self.snapshots.take(self.snapshots.now_step())
        self.snapshots.wait(self.snapshots.held[-1])
        launch()
        self.give_datasets(range(len(self.executor.group.actors)))
        replay, source = self._restore(load=self._transfer.adopt_layers(), as_taken=True)
        for logged in replay:
            self._run(logged.data_step, logged.batch, logged.loss_scale)
        return source

    def _swap_in(self, group: StageGroup) -> None:
        """The configured pipeline's ``group`` (ready) replaces the running workers (the
        caller gives its readers the datasets)."""
        self.partition_return, running_stages = None, self._config.num_stages
        config, balance = self.configured
        self._swap_group(None)
        self._use_partition(config, balance)
        self._swap_group(group)
        if config.elastic:  # back on its configured stages: asks for its other replicas again
            self.resizer = Resizer(config, self.executor, self.stage_specs(), self.bundle, None)
        self._record_resize("restore")
        logger.warning("raypipe: back from %d to the configured %d stage(s) (layers per stage %s)",
                       running_stages, config.num_stages, balance)

    def _swap_in_place(self) -> None:
        """The running workers go (their state is snapshotted), and the configured pipeline
        is placed in their room; if the room went elsewhere, the fewer stages start again."""
        self._swap_group(None)
        try:
            group = self.partition_return.start_in_place(self._config.placement_timeout_s)
        except ray.exceptions.RayError as error:  # a new worker died while it started: asked for beside again
            logger.warning("raypipe: a worker of the configured pipeline died while it started in place (%s)",
                           str(error).strip().splitlines()[-1])
            self.partition_return = self._configured_return()
            self.partition_return.in_place = False
            group = None
        if group is not None:
            self._swap_in(group)
            return
        logger.warning("raypipe: the configured %d stage(s) could not be placed in the room the running ones left "
                       "within %gs (placement_timeout_s); going on with %d", self._configured[0].num_stages,
                       self._config.placement_timeout_s, self._config.num_stages)
        self.launch(None)

    def _configured_return(self) -> PartitionReturn:
        """The configured pipeline (one replica), asked for beside the running one."""
        configured, configured_balance = self.configured
        specs = replica_specs(self.stage_specs(configured, configured_balance), 1, self._config.micro_batches_per_step)
        return PartitionReturn(self.executor.actor_class(), specs, self.bundle)

    def _use_partition(self, config: PipelineConfig, balance: list[int]) -> None:
        """From now on ``config``'s stages, split by ``balance``, run on one replica."""
        self._config, self._balance, self.topology = config, list(balance), Topology(config.num_stages, 1,
                                                                                       config.tensor_parallel)
        self.schedule = make_schedule(config.schedule, config.num_stages, config.num_micro_batches,
                                      config.virtual_stages)
        self.executor.config, self.executor.schedule = config, self.schedule  # the executor's own copy

    def _swap_group(self, group: StageGroup | None) -> None:
        """The running workers go; ``group`` (ready, of the partition in force), if any, runs the next steps."""
        if self.group is not None:
            self.group.shutdown()
            self._last_reports = None  # of the workers that went: a re-partition must not size stages by them
        self.group = group
        if group is not None:
            self.executor.connect(group)


__all__ = ["STATES", "Controller", "ControllerState", "Layout", "SlowFound", "SlowRebalanced", "SlowReplaced",
           "StageModel"]
