"""PipelineTrainer: the facade users see. It composes the
:class:`~raypipe.control.controller.Controller` (the one owner of the running
layout: workers, topology, partition, the config in force, snapshots), the
:class:`~raypipe.control.steps.TrainerStep` (a step from its batch to its result),
the checkpoint manager (:class:`~raypipe.checkpoint_manager.trainer_state.TrainerState`)
and the metrics, and keeps the step count and the loss scale."""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from raypipe.checkpoint_manager.trainer_state import TrainerState, TrainingProgress
from raypipe.config import PipelineConfig
from raypipe.control.controller import Controller, StageModel
from raypipe.control.steps import Batch, TrainerStep
from raypipe.core.loss_scale import LossScaler
from raypipe.core.micro_batches import count_samples
from raypipe.core.result import StepResult
from raypipe.models.hf.export import describe_llama
from raypipe.models.layers import LayerSpec, model_layers
from raypipe.planning.balance import resolve_balance
from raypipe.runtime.data_access import DEFAULT_SHIP_DATA_LIMIT_BYTES
from raypipe.runtime.group import WorkerInfo
from raypipe.stage.spec import WorkerSpec

logger = logging.getLogger("raypipe")

Model = nn.Sequential | Sequence[nn.Module] | Sequence[LayerSpec]


def _checkpoints_do(name: str) -> Callable:
    """A trainer method that is the checkpoint manager's ``name`` (its docstring and signature)."""
    @functools.wraps(getattr(TrainerState, name))
    def method(self: PipelineTrainer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._checkpoints, name)(*args, **kwargs)
    return method


class PipelineTrainer:
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
        config = (config or PipelineConfig()).replace()
        layers, layer_names = model_layers(model)
        config.validate(len(layers))
        if config.tensor_parallel > 1:  # DTensor is imported only where it is used (seconds of import)
            from raypipe.models.tensor_parallel import check_tensor_parallel

            check_tensor_parallel(layers, config.tensor_parallel, sequence_parallel=config.sequence_parallel)
        balance = resolve_balance(config, layers)  # "time": from the layers' costs, before any actor starts
        self._loss_count_fn = loss_count_fn or count_samples
        scaler = LossScaler(config.initial_loss_scale, config.growth_interval,
                            min_scale=config.min_loss_scale) if config.precision == "fp16" else None
        self._progress = TrainingProgress(0, scaler)
        self.metrics = None
        if config.metrics_port is not None:  # first: the controller exports its state from the start
            from raypipe.observability.metrics import MetricsExporter

            self.metrics = MetricsExporter(config.metrics_host, config.metrics_port)
        self._controller = Controller(
            config, balance, StageModel(tuple(layers), optimizer, loss_fn, lr_scheduler, self._loss_count_fn),
            metrics=self.metrics, settle_saves=lambda: self._checkpoints.settle_saves(),
            steps=lambda: self._progress.step_count)
        self._checkpoints = TrainerState(self._controller, self._progress, layer_names, describe_llama(layers))
        self._steps = TrainerStep(self._controller, self._progress, self._loss_count_fn, lambda: self.metrics)
        self._start()

    # -- lifecycle ------------------------------------------------------------
    def _start(self) -> None:
        try:
            infos = self._controller.start()
        except BaseException:
            self._close_metrics()
            raise
        self.num_parameters = sum(info["num_parameters"] for info in infos) // self.topology.num_replicas
        self.device_name = infos[0]["device_name"]

    # the layout in force, read from the controller (its one owner)
    config = property(lambda self: self._controller.config, doc="The config in force (fewer stages when "
                      "re-partitioned).")
    topology = property(lambda self: self._controller.topology, doc="The ranks of the layout in force.")
    balance = property(lambda self: self._controller.balance,
                       doc="Layers per stage in force (per virtual stage, in model order, with model chunks).")
    schedule = property(lambda self: self._controller.schedule, doc="The schedule in force.")
    recoveries = property(lambda self: self._controller.recoveries,
                          doc="Each healed failure event (a Recovered: how long, from where, steps replayed).")
    resizes = property(lambda self: self._controller.resizes, doc="(step_count, direction, replicas after) of each "
                       "resize: shrink/grow (elastic), repartition/restore (stages).")
    scaler = property(lambda self: self._progress.scaler, doc="The fp16 loss scaler, else None.")
    layout = property(lambda self: self._controller.layout, doc="The running layout, frozen (a "
                      ":class:`~raypipe.control.controller.Layout`: the workers' handles in rank order, the "
                      "partition, the topology and the config in force).")
    spares = property(lambda self: self._controller.spares, doc="The pool of warm spare workers "
                      "(``spare_workers``), else None.")

    @property
    def step_count(self) -> int:
        """Optimizer steps committed (a loaded checkpoint's count included)."""
        return self._progress.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._progress.step_count = value

    @property
    def use_gpu(self) -> bool | None:
        return self._controller.use_gpu

    @use_gpu.setter
    def use_gpu(self, value: bool) -> None:
        self._controller.use_gpu = value

    def _stage_specs(self) -> list[WorkerSpec]:
        return self._controller.stage_specs()

    @property
    def micro_batches_per_step(self) -> int:
        """A step's micro-batches: ``num_micro_batches x`` the most replicas, whatever the number running."""
        return self.config.micro_batches_per_step

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus scrape address, when ``metrics_port`` is configured."""
        return None if self.metrics is None else self.metrics.url

    @property
    def num_replicas(self) -> int:
        """The number of pipeline replicas that will run the next step."""
        return self.topology.num_replicas

    @property
    def workers(self) -> list[WorkerInfo]:
        """The live workers as ``WorkerInfo(replica, stage, node_id, pid, tp_rank)``, in (replica, stage,
        tp_rank) order."""
        return list(self._controller.layout.workers)

    @property
    def failures(self) -> list[str]:
        """Every failure event healed (or not) so far, as its error named it."""
        return self._controller.failures

    def shutdown(self) -> None:
        """Wait for a checkpoint save in flight, then free the stage actors, the
        placement group and the metrics server; then raise the save's error, if any."""
        try:
            self.wait_for_checkpoint()
        finally:
            self._controller.stop()
            self._close_metrics()

    def _close_metrics(self) -> None:
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

    # -- state in and out: the checkpoint manager's ---------------------------------
    state_dict = _checkpoints_do("state_dict")
    load_state_dict = _checkpoints_do("load_state_dict")
    save_checkpoint = _checkpoints_do("save_checkpoint")
    wait_for_checkpoint = _checkpoints_do("wait_for_checkpoint")
    load_checkpoint = _checkpoints_do("load_checkpoint")
    export_hf = _checkpoints_do("export_hf")

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
        self._controller.check_usable()
        batch = self._steps.split(inputs, targets)
        parts = targets if isinstance(targets, (list, tuple)) else [targets]
        num_samples = sum(part.shape[0] for part in parts)
        num_tokens = sum(part.numel() if part.dim() > 1 else part.shape[0] for part in parts)
        return self._steps.run(self.step_count, batch, start, num_samples, num_tokens, self.num_parameters,
                               self._peak_flops())

    def step_from_datasets(self, step: int, num_samples: int, num_tokens: int) -> StepResult:
        """One optimizer step whose micro-batches the first and last stages read
        themselves (``(step, micro_batch)`` of the datasets given to :meth:`attach_datasets`)."""
        start = time.time()
        self._controller.check_usable()
        return self._steps.run(step, None, start, num_samples, num_tokens, self.num_parameters, self._peak_flops())

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
        self._controller.attach_datasets(train, validation, ship_data_limit_bytes)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean loss over ``(inputs, targets)`` with a forward-only pass."""
        self._controller.check_usable()
        batch = self._steps.split(inputs, targets)
        return self._steps.evaluated(self._controller.evaluate(self.step_count, batch))

    def evaluate_from_datasets(self, step: int) -> float:
        """Validation loss of the validation dataset's ``step``, read by the stages."""
        self._controller.check_usable()
        return self._steps.evaluated(self._controller.evaluate(step, None))

    def fit(self, dataset: Any, steps: int, **options: Any) -> list[StepResult]:
        """Train for ``steps`` steps on ``dataset``; see :func:`raypipe.fit.fit`."""
        from raypipe.fit import fit

        return fit(self, dataset, steps, **options)

    def _peak_flops(self) -> float | None:
        if self.config.peak_flops_per_second is not None:
            return self.config.peak_flops_per_second
        if not self.use_gpu:
            return None
        from raypipe.observability.mfu import peak_flops_for_device

        return peak_flops_for_device(self.device_name, self.config.precision)  # fp32: the FP32 peak, not bf16
