"""PipelineTrainer: the facade users see. Config -> topology -> group of stage
workers -> executor; it keeps the step count, the loss scale and the metrics."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch
from torch import nn

from raypipe.checkpoint.trainer_state import TrainerState
from raypipe.config import PipelineConfig
from raypipe.core.loss_scale import LossScaler
from raypipe.core.micro_batches import MicroBatches, count_samples, loss_weights, split_micro_batches
from raypipe.core.partition import partition_by_cost, stage_layer_ranges
from raypipe.core.result import StepResult
from raypipe.core.schedule import make_schedule
from raypipe.core.step_decision import NONFINITE, OVERFLOW, StepDecision
from raypipe.core.topology import Topology
from raypipe.errors import NonFiniteError
from raypipe.executor import make_executor
from raypipe.executor.elastic import Resizer, layout
from raypipe.executor.partition_return import PartitionReturn
from raypipe.executor.partitioning import Partitioning
from raypipe.executor.recovery import Recovered, Recovery
from raypipe.executor.snapshot import LoggedStep
from raypipe.models.hf.export import describe_llama
from raypipe.models.layers import LayerSpec, layer_parameter_count, model_layers
from raypipe.observability.step_report import build_step_result
from raypipe.runtime import cluster
from raypipe.runtime.data_access import DEFAULT_SHIP_DATA_LIMIT_BYTES, datasets_for_readers
from raypipe.runtime.group import StageGroup, WorkerInfo
from raypipe.runtime.snapshot_keeper import start_keeper
from raypipe.stage.spec import WorkerSpec

logger = logging.getLogger("raypipe")

Model = nn.Sequential | Sequence[nn.Module] | Sequence[LayerSpec]
Batch = torch.Tensor | Sequence[torch.Tensor]


class PipelineTrainer(TrainerState, Partitioning):
    """Train ``model`` with pipeline parallelism over Ray stage actors.

    ``model`` is an ``nn.Sequential``, a list of modules, or a list of
    :class:`~raypipe.LayerSpec` (built inside the stage actors). ``loss_fn(output,
    target)`` returns the mean loss of one micro-batch; ``optimizer(params)``
    builds each stage's optimizer. ``loss_count_fn(target)`` counts what
    ``loss_fn`` averages over (default: the micro-batch's samples), so that the
    weighted sum over micro-batches is the exact global-batch mean.
    ``lr_scheduler(optimizer)`` optionally builds each stage's scheduler, stepped
    after every applied optimizer step (not after an fp16 overflow skip).
    """

    def __init__(self, model: Model, loss_fn: Callable, optimizer: Callable | None = None,
                 config: PipelineConfig | None = None, *,
                 loss_count_fn: Callable[[torch.Tensor], int] | None = None,
                 lr_scheduler: Callable | None = None) -> None:
        self.config = config = (config or PipelineConfig()).replace()
        layers, self._layer_names = model_layers(model)
        self._llama = describe_llama(layers)  # what export_hf and checkpoints need of a LLaMA, else None
        config.validate(len(layers))
        self.topology = Topology(config.num_stages, config.max_replicas)  # until placed: an elastic run's may be fewer
        self.balance = list(config.balance or partition_by_cost([layer_parameter_count(l) for l in layers],
                                                                config.num_stages))
        self._configured = (config, list(self.balance))  # a re-partitioned run goes back to it when there is room
        self._partition_return: PartitionReturn | None = None
        self.schedule = make_schedule(config.schedule, config.num_stages, config.num_micro_batches)
        self._loss_count_fn = loss_count_fn or count_samples
        self.scaler = LossScaler(config.initial_loss_scale, config.growth_interval,
                                 min_scale=config.min_loss_scale) if config.precision == "fp16" else None
        self.step_count = 0
        self.metrics = None
        self.recoveries: list[Recovered] = []  # each healed failure event: how long, from where, steps replayed
        # (step_count, direction, replicas after): "shrink"/"grow" (elastic), "repartition"/"restore" (stages)
        self.resizes: list[tuple[int, str, int]] = []
        self._damaged_checkpoints: set[tuple[str, int]] = set()  # (root, step) a load fell back past
        self._group: StageGroup | None = None
        self._datasets: tuple[Any, Any] | None = None
        self._ship_limit = DEFAULT_SHIP_DATA_LIMIT_BYTES
        self._shipped: dict[int, Any] = {}  # shipped copies: the driver holds them while the stages read them
        self._pending_save = None  # the checkpoint save in flight (a PendingSave)
        self._executor = make_executor(config, self.schedule)
        self._recovery = Recovery(self._executor, config, self._give_datasets, self._record_recovery)
        self._recovery.settle_saves = self._settle_saves
        self._recovery.repartition = self._repartition
        self._recovery.restore_partition = self._restore_partition
        self._model = (layers, optimizer, loss_fn, lr_scheduler)
        self._start()

    # -- lifecycle ------------------------------------------------------------
    def _start(self) -> None:
        config = self.config
        cluster.connect(config.ray_address, self.topology.world_size * config.cpus_per_stage)
        self.use_gpu = cluster.resolve_use_gpu(config)
        if cluster.num_alive_nodes() > 1:  # workers may run off this node: snapshots must outlive theirs
            self._recovery.keeper = start_keeper()
        self._bundle = cluster.worker_bundle(config, self.use_gpu)
        try:
            placed, pending = cluster.reserve_between(config.min_replicas, config.max_replicas,
                                                      [self._bundle] * config.num_stages, config.placement_timeout_s)
            self.topology = Topology(config.num_stages, len(placed))
            if config.elastic:
                self._recovery.resizer = Resizer(config, self._executor, self._stage_specs(), self._bundle, pending,
                                                 self._resized)
            infos = self._launch(placed)
        except BaseException:
            self.shutdown()  # the keeper, placement groups asked for, workers started
            raise
        self.num_parameters = sum(info["num_parameters"] for info in infos) // self.topology.num_replicas
        self.device_name = infos[0]["device_name"]
        self._device_memory = infos[0].get("device_memory_bytes")
        self._start_metrics()
        self._recovery.snapshot(self.step_count, first=True)

    def _stage_specs(self, config: PipelineConfig | None = None, balance: list[int] | None = None
                     ) -> list[WorkerSpec]:
        """One spec per stage of the current partition (else of ``config`` split by ``balance``), as replica 0's."""
        config, balance = config or self.config, balance or self.balance
        layers, optimizer, loss_fn, lr_scheduler = self._model
        last = config.num_stages - 1
        return [WorkerSpec(stage=stage, num_stages=config.num_stages, layers=tuple(layers[i] for i in indices),
                           layer_indices=tuple(indices), config=config, use_gpu=self.use_gpu,
                           optimizer_factory=optimizer, loss_fn=loss_fn if stage == last else None,
                           loss_count_fn=self._loss_count_fn, scheduler_factory=lr_scheduler)
                for stage, indices in enumerate(stage_layer_ranges(balance))]

    def _launch(self, placed: list | None) -> list[dict[str, Any]]:
        """Start the workers of the current partition and topology (in ``placed``
        placement groups, else reserved now) and connect them; what each reported."""
        specs = layout(self._stage_specs(), self.topology.num_replicas, self.micro_batches_per_step)
        self._group = StageGroup(self._executor.actor_class(), specs, self._bundle, self.config.placement_timeout_s,
                                 placed)
        infos = self._group.wait_ready()
        self._executor.connect(self._group)
        return infos

    def _record_resize(self, direction: str) -> None:
        self.resizes.append((self.step_count, direction, self.topology.num_replicas))
        if self.metrics is not None:
            self.metrics.record_resize(direction, self.topology.num_replicas)

    @property
    def micro_batches_per_step(self) -> int:
        """A step's micro-batches: ``num_micro_batches x`` the most replicas, whatever the number running."""
        return self.config.micro_batches_per_step

    def _resized(self, direction: str, num_replicas: int, new_ranks: list[int]) -> None:
        """After an elastic resize: the new layout's topology, datasets for new readers, metrics."""
        self.topology = Topology(self.config.num_stages, num_replicas)
        self._give_datasets(new_ranks)
        self._record_resize(direction)

    def _start_metrics(self) -> None:
        if self.config.metrics_port is None:
            return
        from raypipe.observability.metrics import MetricsExporter

        self.metrics = MetricsExporter(self.config.metrics_host, self.config.metrics_port)

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus scrape address, when ``metrics_port`` is configured."""
        return None if self.metrics is None else self.metrics.url

    @property
    def num_replicas(self) -> int:
        """The number of pipeline replicas that will run the next step."""
        return self.topology.num_replicas

    @property
    def _first_replica(self) -> list:
        return self._group.actors[:self.topology.num_stages]

    @property
    def workers(self) -> list[WorkerInfo]:
        """The live workers as ``WorkerInfo(replica, stage, node_id, pid)``, in (replica, stage) order."""
        return [] if self._group is None else self._group.workers

    def shutdown(self) -> None:
        """Wait for a checkpoint save in flight, then free the stage actors, the
        placement group and the metrics server; then raise the save's error, if any."""
        try:
            self.wait_for_checkpoint()
        finally:
            self._free()

    def _free(self) -> None:
        if self._group is not None:
            self._executor.close()
            self._group.shutdown()
            self._group = None
            self._shipped = {}
        if self._recovery.resizer is not None:
            self._recovery.resizer.close()
        if self._partition_return is not None:
            self._partition_return.close()
            self._partition_return = None
        if self._recovery.keeper is not None:
            ray.kill(self._recovery.keeper)
            self._recovery.keeper = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def __enter__(self) -> PipelineTrainer:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        try:
            self.shutdown()
        except Exception:
            if exc_type is None:
                raise
            # the exception leaving the block is the one to see; the save's error is logged
            logger.exception("raypipe: the checkpoint save in flight failed")

    # -- training ---------------------------------------------------------------
    def step(self, inputs: Batch, targets: Batch) -> StepResult:
        """One optimizer step over the global batch ``(inputs, targets)``.

        Tensors are split into :attr:`micro_batches_per_step` micro-batches
        with ``torch.tensor_split`` (each running replica runs a contiguous
        block); lists of tensors are taken as the micro-batches themselves (they
        may differ in shape, e.g. sequence length). The loss is
        the exact mean over the whole batch, whatever the number of replicas.
        """
        start = time.time()
        self._executor.check_usable()
        batch = self._split(inputs, targets)
        parts = targets if isinstance(targets, (list, tuple)) else [targets]
        num_samples = sum(part.shape[0] for part in parts)
        num_tokens = sum(part.numel() if part.dim() > 1 else part.shape[0] for part in parts)
        return self._run_step(self.step_count, batch, start, num_samples, num_tokens)

    def step_from_datasets(self, step: int, num_samples: int, num_tokens: int) -> StepResult:
        """One optimizer step whose micro-batches the first and last stages read
        themselves (``(step, micro_batch)`` of the datasets given to :meth:`attach_datasets`)."""
        start = time.time()
        self._executor.check_usable()
        return self._run_step(step, None, start, num_samples, num_tokens)

    def attach_datasets(self, train: Any, validation: Any = None,
                        ship_data_limit_bytes: int = DEFAULT_SHIP_DATA_LIMIT_BYTES) -> None:
        """Send the datasets to the stages that read them (every replica's first and last).

        A dataset's step is :attr:`micro_batches_per_step` micro-batches
        (``get(step, index)``); each running replica reads its block. Each
        reader first opens the datasets where it runs (see
        :func:`raypipe.runtime.data_access.datasets_for_readers`): one that cannot
        open a local dataset gets its shards through the object store, up to
        ``ship_data_limit_bytes``; any other problem raises a DataAccessError
        naming the path, the worker and its node, before any step runs."""
        self._datasets, self._ship_limit, self._shipped = (train, validation), ship_data_limit_bytes, {}
        self._give_datasets(range(self.topology.world_size))

    def _give_datasets(self, indices: Sequence[int]) -> None:
        """Workers ``indices`` that read data (every replica's first and last stage) get the datasets,
        checked where each runs (a replacement too, which may run on another node)."""
        if self._datasets is None:
            return
        last = self.topology.num_stages - 1
        readers = [(where.replica, where.stage, self._group.actors[rank]) for rank, where in
                   ((rank, self.topology.coordinates(rank)) for rank in indices) if where.stage in (0, last)]
        own = datasets_for_readers(readers, self._datasets, self._executor.get, self._ship_limit, self._shipped)
        self._executor.get([actor.attach_datasets.remote(*datasets) for (_, _, actor), datasets in zip(readers, own)])

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean loss over ``(inputs, targets)`` with a forward-only pass."""
        self._executor.check_usable()
        batch = self._split(inputs, targets)
        return self._record_eval(self._recovery.between_steps(
            lambda: self._executor.evaluate(self.step_count, batch), self.step_count, "during evaluate"))

    def evaluate_from_datasets(self, step: int) -> float:
        """Validation loss of the validation dataset's ``step``, read by the stages."""
        self._executor.check_usable()
        return self._record_eval(self._recovery.between_steps(lambda: self._executor.evaluate(step, None),
                                                              self.step_count, "during evaluate"))

    def fit(self, dataset: Any, steps: int, **options: Any) -> list[StepResult]:
        """Train for ``steps`` steps on ``dataset``; see :func:`raypipe.fit.fit`."""
        from raypipe.fit import fit

        return fit(self, dataset, steps, **options)

    # -- step internals -------------------------------------------------------
    def _split(self, inputs: Batch, targets: Batch) -> MicroBatches:
        """The step's :attr:`micro_batches_per_step` micro-batches (``torch.tensor_split``
        sizes, or given as lists) and their loss weights over the whole step.

        The executor ships them as task arguments (see :mod:`raypipe.comm.task_tensors`).
        """
        count = self.micro_batches_per_step
        input_parts, target_parts = split_micro_batches(inputs, targets, count)
        weights = loss_weights([self._loss_count_fn(part) for part in target_parts])
        return MicroBatches(input_parts, target_parts, weights)

    def _run_step(self, data_step: int, batch: MicroBatches | None, start: float, num_samples: int,
                  num_tokens: int) -> StepResult:
        loss_scale = self.scaler.scale if self.scaler else None
        failures_before = len(self._recovery.failures)
        outcome = self._recovery.run_step(data_step, batch, loss_scale)
        failures = self._recovery.failures[failures_before:]
        decision = outcome.decision
        self._check_finite(decision)
        if self.scaler:
            self.scaler.update(decision.skip_reason == OVERFLOW)
        result = build_step_result(
            step=self.step_count, loss=decision.loss, grad_norm=decision.grad_norm,
            max_norm=self.config.clip_grad_norm, skip_reason=decision.skip_reason, loss_scale=loss_scale,
            step_time=time.time() - start, num_samples=num_samples, num_tokens=num_tokens,
            reports=outcome.reports, num_parameters=self.num_parameters, peak_flops=self._peak_flops(),
            num_devices=self.topology.world_size)
        result.recovered, result.failures = bool(failures), failures
        self.step_count += 1
        self._recovery.committed(self.step_count, LoggedStep(data_step, batch, loss_scale))
        if self.metrics is not None:
            self.metrics.record_step(result)
        return result

    @property
    def failures(self) -> list[str]:
        """Every failure event healed (or not) so far, as its error named it."""
        return list(self._recovery.failures)

    def _record_recovery(self, recovered: Recovered) -> None:
        self.recoveries.append(recovered)
        if self.metrics is not None:
            self.metrics.record_recovery(recovered.reasons, recovered.seconds, recovered.replayed_steps)

    def _check_finite(self, decision: StepDecision) -> None:
        """``nonfinite="raise"``: a non-finite step (nothing was applied) raises. In fp16 an
        overflow lowers the loss scale instead, unless the scale is already at its floor."""
        if self.config.nonfinite != "raise" or not decision.skipped:
            return
        if decision.skip_reason == NONFINITE:
            raise NonFiniteError(self.step_count, decision.first_nonfinite_stage, "the update was skipped")
        if self.scaler.scale <= self.scaler.min_scale:
            raise NonFiniteError(self.step_count, decision.first_nonfinite_stage,
                                 f"gradients overflow at the minimum loss scale {self.scaler.min_scale:g}")

    def _record_eval(self, loss: float) -> float:
        if self.metrics is not None:
            self.metrics.record_eval(loss)
        return loss

    def _peak_flops(self) -> float | None:
        if self.config.peak_flops_per_second is not None:
            return self.config.peak_flops_per_second
        if not self.use_gpu:
            return None
        from raypipe.observability.metrics import peak_flops_for_device

        return peak_flops_for_device(self.device_name)
