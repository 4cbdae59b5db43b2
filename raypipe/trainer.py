"""PipelineTrainer: the facade users see. Config -> topology -> group of stage
workers -> executor; it keeps the step count, the loss scale and the metrics."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch
from torch import nn

from raypipe.checkpoint.pending import PendingSave, SavedCheckpoint
from raypipe.config import PipelineConfig
from raypipe.core.loss_scale import LossScaler
from raypipe.core.micro_batches import MicroBatches, count_samples, loss_weights, split_micro_batches
from raypipe.core.partition import partition_by_cost, stage_layer_ranges
from raypipe.core.result import StepResult
from raypipe.core.schedule import make_schedule
from raypipe.core.step_decision import NONFINITE, OVERFLOW, StepDecision
from raypipe.core.topology import Topology
from raypipe.core.validation import check_int
from raypipe.errors import CheckpointError, NonFiniteError, RaypipeError
from raypipe.executor import make_executor
from raypipe.executor.recovery import LoggedStep, Recovered, Recovery
from raypipe.models.hf.export import describe_llama
from raypipe.models.layers import LayerSpec, layer_parameter_count, model_layers, split_state_by_layer
from raypipe.observability.step_report import build_step_result
from raypipe.runtime import cluster
from raypipe.runtime.data_access import DEFAULT_SHIP_DATA_LIMIT_BYTES, datasets_for_readers
from raypipe.runtime.group import StageGroup, WorkerInfo
from raypipe.runtime.snapshot_keeper import start_keeper
from raypipe.stage.spec import WorkerSpec

logger = logging.getLogger("raypipe")

Model = nn.Sequential | Sequence[nn.Module] | Sequence[LayerSpec]
Batch = torch.Tensor | Sequence[torch.Tensor]


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
        self.config = config = (config or PipelineConfig()).replace()
        layers, self._layer_names = model_layers(model)
        self._llama = describe_llama(layers)  # what export_hf and checkpoints need of a LLaMA, else None
        config.validate(len(layers))
        self.topology = Topology(config.num_stages, config.num_replicas)
        self.balance = list(config.balance or partition_by_cost([layer_parameter_count(l) for l in layers],
                                                                config.num_stages))
        self.schedule = make_schedule(config.schedule, config.num_stages, config.num_micro_batches)
        self._loss_count_fn = loss_count_fn or count_samples
        self.scaler = LossScaler(config.initial_loss_scale, config.growth_interval,
                                 min_scale=config.min_loss_scale) if config.precision == "fp16" else None
        self.step_count = 0
        self.metrics = None
        self.recoveries: list[Recovered] = []  # each healed failure event: how long, from where, steps replayed
        self._damaged_checkpoints: set[tuple[str, int]] = set()  # (root, step) a load fell back past
        self._group: StageGroup | None = None
        self._datasets: tuple[Any, Any] | None = None
        self._ship_limit = DEFAULT_SHIP_DATA_LIMIT_BYTES
        self._shipped: dict[int, Any] = {}  # shipped copies: the driver holds them while the stages read them
        self._pending_save: PendingSave | None = None  # the checkpoint save in flight
        self._executor = make_executor(config, self.schedule)
        self._recovery = Recovery(self._executor, config, self._give_datasets, self._record_recovery)
        self._recovery.settle_saves = self._settle_saves
        self._start(layers, optimizer, loss_fn, lr_scheduler)

    # -- lifecycle ------------------------------------------------------------
    def _start(self, layers: list, optimizer: Callable | None, loss_fn: Callable,
               lr_scheduler: Callable | None) -> None:
        cluster.connect(self.config.ray_address, self.topology.world_size * self.config.cpus_per_stage)
        self.use_gpu = cluster.resolve_use_gpu(self.config)
        last = self.topology.num_stages - 1
        specs = [WorkerSpec(stage=stage, num_stages=self.topology.num_stages, replica=replica,
                            layers=tuple(layers[i] for i in indices), layer_indices=tuple(indices),
                            config=self.config, ops=tuple(self.schedule[stage]), use_gpu=self.use_gpu,
                            optimizer_factory=optimizer, loss_fn=loss_fn if stage == last else None,
                            loss_count_fn=self._loss_count_fn, scheduler_factory=lr_scheduler)
                 for replica in range(self.topology.num_replicas)  # in rank order: replica-major
                 for stage, indices in enumerate(stage_layer_ranges(self.balance))]
        if cluster.num_alive_nodes() > 1:  # workers may run off this node: snapshots must outlive theirs
            self._recovery.keeper = start_keeper()
        self._group = StageGroup(self._executor.actor_class(), specs, cluster.worker_bundle(self.config, self.use_gpu),
                                 self.config.placement_timeout_s)
        try:
            infos = self._group.wait_ready()
            self._executor.connect(self._group)
        except BaseException:
            self.shutdown()
            raise
        self.num_parameters = sum(info["num_parameters"] for info in infos)
        self.device_name = infos[0]["device_name"]
        self._start_metrics()
        self._recovery.snapshot(self.step_count, first=True)

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

        Tensors are split into ``num_micro_batches x num_replicas`` micro-batches
        with ``torch.tensor_split`` (replica ``r`` runs the ``r``-th block of
        ``num_micro_batches``); lists of tensors are taken as the micro-batches
        themselves (they may differ in shape, e.g. sequence length). The loss is
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

        A dataset's step is ``num_micro_batches x num_replicas`` micro-batches
        (``get(step, index)``); replica ``r`` reads the ``r``-th block. Each
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
        return self._record_eval(self._recovery.evaluate(lambda: self._executor.evaluate(self.step_count, batch),
                                                         self.step_count))

    def evaluate_from_datasets(self, step: int) -> float:
        """Validation loss of the validation dataset's ``step``, read by the stages."""
        self._executor.check_usable()
        return self._record_eval(self._recovery.evaluate(lambda: self._executor.evaluate(step, None),
                                                         self.step_count))

    def fit(self, dataset: Any, steps: int, **options: Any) -> list[StepResult]:
        """Train for ``steps`` steps on ``dataset``; see :func:`raypipe.fit.fit`."""
        from raypipe.fit import fit

        return fit(self, dataset, steps, **options)

    # -- step internals -------------------------------------------------------
    def _split(self, inputs: Batch, targets: Batch) -> MicroBatches:
        """The step's ``num_micro_batches x num_replicas`` micro-batches (``torch.tensor_split``
        sizes, or given as lists) and their loss weights over the whole step.

        The executor ships them as task arguments (see :mod:`raypipe.comm.task_tensors`).
        """
        count = self.config.num_micro_batches * self.topology.num_replicas
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

    # -- state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model, with the user's parameter names (``model.state_dict()`` keys)."""
        per_layer: dict[int, dict] = {}
        for states in self._executor.get([actor.state_dict.remote() for actor in self._first_replica]):
            per_layer.update(states)
        return {f"{self._layer_names[index]}.{key}": value
                for index in sorted(per_layer) for key, value in per_layer[index].items()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Scatter a full state dict (keys as :meth:`state_dict`) to the stages."""
        per_layer = split_state_by_layer(state_dict, self._layer_names)
        ranges = stage_layer_ranges(self.balance) * self.topology.num_replicas  # every replica, in rank order
        self._executor.get([actor.load_state_dict.remote({i: per_layer[i] for i in indices})
                            for actor, indices in zip(self._group.actors, ranges)])
        self._recovery.persisted.forget()
        self._recovery.snapshot(self.step_count, first=True)

    def save_checkpoint(self, root_uri: str, extra: dict | None = None, keep_last: int | None = None, *,
                        wait: bool = True) -> int:
        """Write a sharded checkpoint of every layer and the trainer's state; returns its step.

        Stages write their own layers in parallel (once: the first replica's,
        every replica holds the same; with ``shard_optimizer`` the other replicas
        write their optimizer parts); the manifest, written last, makes the
        checkpoint complete. ``keep_last=k`` then deletes all but the newest ``k``
        complete checkpoints under ``root_uri``.

        ``wait=False`` saves in the background: each worker copies its state to
        host memory (the state after the last step; training stalls only for that
        copy) and a thread of the worker writes the files while the next steps
        run; a driver thread writes the manifest once every file is written, then
        prunes. While a save is in flight each worker holds one more host copy of
        its state: its weights and its optimizer state (``raypipe plan`` prints
        it). At most one save is in flight: a save first waits for the one before,
        and so do :meth:`wait_for_checkpoint`, :meth:`load_checkpoint`,
        :meth:`export_hf` and :meth:`shutdown`; there a failed write raises
        :class:`~raypipe.CheckpointError` naming the file. A worker lost while it
        writes leaves that checkpoint incomplete (never loaded) with a warning,
        and the next step heals it; with ``wait=True`` that raises instead.
        """
        from raypipe.checkpoint.pending import SaveRequest

        self.wait_for_checkpoint()
        if keep_last is not None:
            check_int("keep_last", keep_last, 1, allowed="must be an int >= 1 (checkpoints kept), or None for all")
        self._executor.check_usable()
        step, writers = self.step_count, self._first_replica
        self._replace_damaged(str(root_uri), step)
        if self._optimizer_parts() > 1:  # ZeRO-1: the other replicas' optimizer state, as blobs
            writers = list(self._group.actors)
        names = [f"replica {replica} stage {stage}" for replica, stage in
                 (divmod(rank, self.topology.num_stages) for rank in range(len(writers)))]
        self._pending_save = PendingSave(SaveRequest(str(root_uri), step, writers, names, self._manifest_extra(extra),
                                                     keep_last, self.config.hang_timeout_s))
        self._recovery.persisted.saved(str(root_uri), step, self._optimizer_parts())
        if wait:
            saved = self.wait_for_checkpoint()
            if not saved.complete:
                raise RaypipeError(f"checkpoint step {step} under {root_uri} is not complete: a worker was lost "
                                   "while writing it (see the warning); the next step heals it, then save again")
        return step

    def wait_for_checkpoint(self) -> SavedCheckpoint | None:
        """Wait for the background save in flight, if any; returns what it wrote
        (``complete`` is False when a worker was lost while writing it), or None
        when no save was in flight. A failed write raises
        :class:`~raypipe.CheckpointError` naming the file (once: the save is over)."""
        pending, self._pending_save = self._pending_save, None
        return None if pending is None else pending.result()

    def _replace_damaged(self, root_uri: str, step: int) -> None:
        """A complete checkpoint is never overwritten, except one that a load found damaged."""
        from raypipe.checkpoint.store import delete_checkpoint

        if (root_uri, step) in self._damaged_checkpoints:
            logger.warning("raypipe: replacing the damaged checkpoint of step %d under %s", step, root_uri)
            delete_checkpoint(root_uri, step)
            self._damaged_checkpoints.discard((root_uri, step))

    def _settle_saves(self) -> None:
        """Before a heal loads a checkpoint: the save in flight completes, or fails and is reported."""
        try:
            self.wait_for_checkpoint()
        except RaypipeError as error:
            logger.warning("raypipe: %s", error)

    def _manifest_extra(self, extra: dict | None) -> dict:
        state = {"step_count": self.step_count, "scaler": self.scaler.state_dict() if self.scaler else None,
                 "layer_names": self._layer_names, "optimizer_parts": self._optimizer_parts(), **(extra or {})}
        if self._llama is not None:
            state["model"] = self._llama  # lets `raypipe export` convert the checkpoint
        try:  # now, not when a background save writes its manifest
            json.dumps(state)
        except TypeError as error:
            raise TypeError(f"checkpoint extra metadata is not JSON-serializable: {error}") from None
        return state

    def export_hf(self, uri: str, dtype: str = "bf16") -> str:
        """Write the model as a Hugging Face LLaMA directory (``config.json``, one safetensors shard per
        layer, written by the stages in parallel, and the index); ``dtype`` "bf16", "fp16" or "fp32".

        Only for a LLaMA built with ``llama_layers`` or ``from_pretrained``. Returns ``uri``.
        """
        from raypipe.models.hf.export import check_dtype, prepare_output, write_index_and_config

        if self._llama is None:
            raise ValueError("export_hf needs a LLaMA model (raypipe.models.llama.llama_layers or from_pretrained)")
        check_dtype(dtype)
        self.wait_for_checkpoint()
        self._executor.check_usable()
        prepare_output(str(uri))
        n_blocks = self._llama["llama_config"]["n_layers"]
        written = self._executor.get([actor.export_hf.remote(str(uri), dtype, n_blocks)
                                      for actor in self._first_replica])
        write_index_and_config(str(uri), self._llama, dtype, [shard for shards in written for shard in shards])
        return str(uri)

    def _optimizer_parts(self) -> int:
        return self.topology.num_replicas if self.config.shard_optimizer else 1

    def load_checkpoint(self, root_uri: str, step: int | None = None) -> dict:
        """Load checkpoint ``step`` into any partition; returns its extra state.

        Without ``step``: the newest intact one. A damaged file (missing, truncated,
        failing its checksum) makes the load fall back to the next older complete
        checkpoint, with a warning naming the file; with ``step`` it raises
        :class:`~raypipe.CheckpointError` naming it."""
        from raypipe.checkpoint.store import list_checkpoints

        self.wait_for_checkpoint()
        if step is not None:
            return self._load_checkpoint(str(root_uri), step)
        steps = list_checkpoints(str(root_uri))
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint under {root_uri}")
        damaged = []
        for candidate in reversed(steps):
            try:
                return self._load_checkpoint(str(root_uri), candidate)
            except CheckpointError as error:
                logger.warning("raypipe: checkpoint step %d is damaged (%s); trying an older one", candidate, error)
                damaged.append(error)
                self._damaged_checkpoints.add((str(root_uri), candidate))  # a save of that step replaces it
        raise damaged[0]  # none intact: the newest one's damage

    def _load_checkpoint(self, root_uri: str, step: int) -> dict:
        from raypipe.checkpoint.store import read_manifest

        extra = read_manifest(str(root_uri), step).get("extra", {})
        parts = extra.get("optimizer_parts", 1)
        self._executor.get([actor.load_checkpoint.remote(str(root_uri), step, parts) for actor in self._group.actors])
        self.step_count = extra.get("step_count", step)
        if self.scaler and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        self._recovery.persisted.loaded(str(root_uri), step, parts)
        self._recovery.snapshot(self.step_count, first=True)
        return extra
