"""PipelineTrainer: the driver. It places stage actors, submits each step's
schedule as actor tasks wired by object references, reduces the gradient norm
and overflow flag over all stages, and tells every stage to step (or not)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import ray
import torch
from torch import nn

from raypipe.runtime import cluster
from raypipe.config import PipelineConfig
from raypipe.errors import RaypipeError, StageError, StepAborted
from raypipe.models.layers import LayerSpec, layer_parameter_count, model_layers, split_state_by_layer
from raypipe.core.partition import partition_by_cost, stage_layer_ranges
from raypipe.core.loss_scale import LossScaler
from raypipe.core.result import StepResult
from raypipe.core.schedule import make_schedule, submission_order
from raypipe.core.micro_batches import count_samples, loss_weights, split_micro_batches
from raypipe.observability.step_report import build_step_result
from raypipe.comm.transport import make_transport

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
        config.validate(len(layers))
        self.balance = list(config.balance or partition_by_cost([layer_parameter_count(l) for l in layers],
                                                                config.num_stages))
        self.schedule = make_schedule(config.schedule, config.num_stages, config.num_micro_batches)
        self._order = submission_order(self.schedule)
        self._loss_count_fn = loss_count_fn or count_samples
        self.scaler = LossScaler(config.initial_loss_scale, config.growth_interval,
                                 min_scale=config.min_loss_scale) if config.precision == "fp16" else None
        self.step_count = 0
        self._broken = False
        self._actors: list[Any] = []
        self._group = None
        self.metrics = None
        self._lr_scheduler = lr_scheduler
        self._start_actors(layers, optimizer, loss_fn)

    # -- lifecycle ------------------------------------------------------------
    def _start_actors(self, layers: list, optimizer: Callable | None, loss_fn: Callable) -> None:
        cluster.connect(self.config.ray_address)
        self.config.use_gpu = cluster.resolve_use_gpu(self.config)
        self._transport = make_transport(self.config.transport, self.config.p2p_timeout_s)
        self._group = cluster.reserve_stages(self.config)
        try:
            args = [(stage, self.config.num_stages, [layers[i] for i in indices], list(indices), optimizer,
                     loss_fn if stage == self.config.num_stages - 1 else None, self.config, self._loss_count_fn,
                     self._lr_scheduler)
                    for stage, indices in enumerate(stage_layer_ranges(self.balance))]
            self._actors = cluster.create_actors(self._transport.actor_class(), self._group, self.config, args)
            infos = self._get([actor.ready.remote() for actor in self._actors])
            self._transport.connect(self._actors)
        except BaseException:
            self.shutdown()
            raise
        self.num_parameters = sum(info["num_parameters"] for info in infos)
        self.device_name = infos[0]["device_name"]
        self._start_metrics()

    def _start_metrics(self) -> None:
        if self.config.metrics_port is None:
            return
        from raypipe.observability.metrics import MetricsExporter

        self.metrics = MetricsExporter(self.config.metrics_host, self.config.metrics_port)

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus scrape address, when ``metrics_port`` is configured."""
        return None if self.metrics is None else self.metrics.url

    def shutdown(self) -> None:
        """Free the stage actors, the placement group and the metrics server."""
        if self._actors and not self._broken:
            self._transport.close(self._actors)
        cluster.release(self._actors, self._group)
        self._actors, self._group = [], None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def __enter__(self) -> PipelineTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- training ---------------------------------------------------------------
    def step(self, inputs: Batch, targets: Batch) -> StepResult:
        """One optimizer step over the global batch ``(inputs, targets)``.

        Tensors are split into ``num_micro_batches`` with ``torch.tensor_split``;
        lists of tensors are taken as the micro-batches themselves (they may
        differ in shape, e.g. sequence length).
        """
        start = time.time()
        self._check_usable()
        input_parts, target_parts, weights = self._split(inputs, targets)
        submitted = self._submit("forward", input_parts, target_parts, weights)
        parts = targets if isinstance(targets, (list, tuple)) else [targets]
        num_samples = sum(part.shape[0] for part in parts)
        num_tokens = sum(part.numel() if part.dim() > 1 else part.shape[0] for part in parts)
        return self._finish_step(submitted, start, num_samples=num_samples, num_tokens=num_tokens)

    def step_from_datasets(self, step: int, num_samples: int, num_tokens: int) -> StepResult:
        """One optimizer step whose micro-batches the first and last stages read
        themselves (``(step, micro_batch)`` of the datasets given to :meth:`attach_datasets`)."""
        start = time.time()
        self._check_usable()
        none = [None] * self.config.num_micro_batches
        submitted = self._submit("forward", none, none, none, data_step=step)
        return self._finish_step(submitted, start, num_samples, num_tokens)

    def attach_datasets(self, train: Any, validation: Any = None) -> None:
        """Send the datasets to the stages that read them (first and last)."""
        readers = {0, self.config.num_stages - 1}
        self._get([self._actors[stage].attach_datasets.remote(train, validation) for stage in readers])

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean loss over ``(inputs, targets)`` with a forward-only pass."""
        input_parts, target_parts, weights = self._split(inputs, targets)
        loss = sum(self._get(self._submit("evaluate", input_parts, target_parts, weights).losses))
        if self.metrics is not None:
            self.metrics.record_eval(loss)
        return loss

    def evaluate_from_datasets(self, step: int) -> float:
        """Validation loss of the validation dataset's ``step``, read by the stages."""
        none = [None] * self.config.num_micro_batches
        loss = sum(self._get(self._submit("evaluate", none, none, none, data_step=step).losses))
        if self.metrics is not None:
            self.metrics.record_eval(loss)
        return loss

    def fit(self, dataset: Any, steps: int, **options: Any) -> list[StepResult]:
        """Train for ``steps`` steps on ``dataset``; see :func:`raypipe.fit.fit`."""
        from raypipe.fit import fit

        return fit(self, dataset, steps, **options)

    # -- step internals -------------------------------------------------------
    def _split(self, inputs: Batch, targets: Batch) -> tuple[list, list, list[float]]:
        """Micro-batches (``torch.tensor_split`` sizes, or given as lists) and their loss weights.

        They travel as task arguments: Ray inlines small ones and puts large ones
        in the object store as it submits the task that needs them.
        """
        input_parts, target_parts = split_micro_batches(inputs, targets, self.config.num_micro_batches)
        weights = loss_weights([self._loss_count_fn(part) for part in target_parts])
        return input_parts, target_parts, weights

    def _submit(self, method: str, input_parts: list, target_parts: list, weights: list,
                data_step: int | None = None) -> _Submitted:
        """Submit every stage's ops of one step (or one evaluation) in schedule order."""
        step = self.step_count if data_step is None else data_step
        if method == "forward" and self._transport.whole_step:
            return self._submit_whole_step(step, input_parts, target_parts, weights)
        last = self.config.num_stages - 1
        scale = self.scaler.scale if self.scaler else 1.0
        if method == "evaluate":
            order = [(stage, op) for op in self.schedule[0] if op.kind == "F" for stage in range(last + 1)]
        else:
            order = self._order
        forward, backward = {}, {}
        for stage, op in order:
            actor, mb = self._actors[stage], op.micro_batch
            if op.kind == "F":
                x = input_parts[mb] if stage == 0 else forward[(stage - 1, mb)]
                extra = (target_parts[mb], weights[mb]) if stage == last else (None, None)
                forward[(stage, mb)] = getattr(actor, method).remote(mb, x, *extra, step)
            else:
                grad = None if stage == last else backward[(stage + 1, mb)]
                backward[(stage, mb)] = actor.backward.remote(mb, grad, scale if stage == last else 1.0)
        losses = [forward[(last, mb)] for mb in range(self.config.num_micro_batches)]
        if method == "evaluate":
            return _Submitted(losses, [])
        # submitted after every op: each actor runs its tasks in order, and
        # finish_backward raises unless every op of its stage ran
        inv_scale = 1.0 / scale
        return _Submitted(losses, [a.finish_backward.remote(inv_scale, self.config.clip_grad_value)
                                   for a in self._actors])

    def _submit_whole_step(self, step: int, inputs: list, targets: list, weights: list) -> _Submitted:
        """p2p: one ``run_step`` task per stage; each returns its loss share and grad stats."""
        last = self.config.num_stages - 1
        given = inputs[0] is not None  # else the stages read the datasets
        scale = self.scaler.scale if self.scaler else 1.0
        return _Submitted([], [actor.run_step.remote(step, inputs if stage == 0 and given else None,
                                                     targets if stage == last and given else None,
                                                     weights if stage == last and given else None,
                                                     scale, 1.0 / scale, self.config.clip_grad_value)
                               for stage, actor in enumerate(self._actors)])

    def _finish_step(self, submitted: _Submitted, start: float, num_samples: int, num_tokens: int) -> StepResult:
        max_norm = self.config.clip_grad_norm
        apply_refs = None
        if self._can_apply_early():
            # Nothing to reduce first: step without a driver round trip. Every stage's
            # apply depends on every stage's outcome, and an outcome raises unless its
            # stage's step is whole, so a failure anywhere keeps every stage from stepping.
            apply_refs = self._submit_apply(None, 0.0, False, after=submitted.outcomes)
        try:
            losses, stats = self._losses_and_grad_stats(submitted)
            grad_norm = float(torch.tensor([s[0] for s in stats], dtype=torch.float32).sum().sqrt())
            found_inf = any(s[1] for s in stats)
            if apply_refs is None:
                apply_refs = self._submit_apply(max_norm, grad_norm, found_inf)
            reports = ray.get(apply_refs)
        except ray.exceptions.RayError as error:
            self._fail_step(submitted, error)
        loss_scale = self.scaler.scale if self.scaler else None
        if self.scaler:
            self.scaler.update(found_inf)
        result = build_step_result(
            step=self.step_count, loss=float(sum(losses)),
            grad_norm=grad_norm, max_norm=max_norm, skipped=found_inf, loss_scale=loss_scale,
            step_time=time.time() - start, num_samples=num_samples, num_tokens=num_tokens, reports=reports,
            num_parameters=self.num_parameters, peak_flops=self._peak_flops(), num_devices=self.config.num_stages)
        self.step_count += 1
        if self.metrics is not None:
            self.metrics.record_step(result)
        return result

    def _can_apply_early(self) -> bool:
        """No global norm to clip by and no overflow to check: stages may step at once."""
        return self.config.clip_grad_norm is None and self.scaler is None

    def _losses_and_grad_stats(self, submitted: _Submitted) -> tuple[list, list]:
        if self._transport.whole_step:
            outputs = ray.get(submitted.outcomes)
            return [outputs[-1]["loss"]], [output["grad_stats"] for output in outputs]
        return ray.get(submitted.losses), ray.get(submitted.outcomes)

    def _fail_step(self, submitted: _Submitted, error: ray.exceptions.RayError) -> NoReturn:
        """Report the step's first real failure, once every stage has dropped the step.

        No stage stepped its optimizer (each apply depends on every stage's outcome),
        so dropping the partial gradients and activations leaves every parameter,
        optimizer and scheduler state as it was before the step.
        """
        refs = submitted.losses + submitted.outcomes
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.p2p_timeout_s, fetch_local=False)
        cause = _first_failure(done) or error
        try:
            if len(done) < len(refs):
                raise TimeoutError("a stage never finished the failed step")
            self._abort_step()
        except (ray.exceptions.RayError, TimeoutError):
            self._broken = True  # a stage died or hangs: the group cannot be made whole again
        raise _as_raypipe_error(cause, self._stage_of) from _cause_of(cause)

    def _check_usable(self) -> None:
        if self._broken:
            raise RaypipeError("a stage died or never finished a failed step, so the pipeline cannot be made "
                               "whole again: shut this trainer down and start a new one (load_checkpoint resumes)")

    def _submit_apply(self, max_norm: float | None, total_norm: float, skip: bool, after: list = ()) -> list:
        return [a.apply.remote(max_norm, total_norm, skip, *after) for a in self._actors]

    def _peak_flops(self) -> float | None:
        if self.config.peak_flops_per_second is not None:
            return self.config.peak_flops_per_second
        if not self.config.use_gpu:
            return None
        from raypipe.observability.metrics import peak_flops_for_device

        return peak_flops_for_device(self.device_name)

    def _get(self, refs: list) -> list:
        """``ray.get`` that turns stage failures into raypipe's errors on the driver."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as error:
            raise _as_raypipe_error(error, self._stage_of) from _cause_of(error)

    def _abort_step(self) -> None:
        """Every stage drops the failed step's partial state; the transport is made whole."""
        ray.get([actor.abort_step.remote() for actor in self._actors])
        self._transport.reconnect(self._actors)

    def _stage_of(self, error: Exception) -> int | str:
        actor_id = getattr(error, "actor_id", None)
        for stage, actor in enumerate(self._actors):
            if actor_id and actor._actor_id.hex() == actor_id:
                return stage
        return "?"

    # -- state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model, with the user's parameter names (``model.state_dict()`` keys)."""
        per_layer: dict[int, dict] = {}
        for states in self._get([actor.state_dict.remote() for actor in self._actors]):
            per_layer.update(states)
        return {f"{self._layer_names[index]}.{key}": value
                for index in sorted(per_layer) for key, value in per_layer[index].items()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Scatter a full state dict (keys as :meth:`state_dict`) to the stages."""
        per_layer = split_state_by_layer(state_dict, self._layer_names)
        calls = []
        for actor, indices in zip(self._actors, stage_layer_ranges(self.balance)):
            calls.append(actor.load_state_dict.remote({i: per_layer[i] for i in indices}))
        self._get(calls)


    def save_checkpoint(self, root_uri: str, extra: dict | None = None) -> int:
        """Write a sharded checkpoint of every layer and the trainer's state; returns its step.

        Stages write their own layers in parallel; the manifest, written last,
        makes the checkpoint complete.
        """
        from raypipe.checkpoint.store import write_manifest

        layer_files: dict[int, str] = {}
        for files in self._get([a.save_checkpoint.remote(str(root_uri), self.step_count) for a in self._actors]):
            layer_files.update(files)
        state = {"step_count": self.step_count, "scaler": self.scaler.state_dict() if self.scaler else None,
                 "layer_names": self._layer_names, **(extra or {})}
        write_manifest(str(root_uri), self.step_count, layer_files, extra=state)
        return self.step_count

    def load_checkpoint(self, root_uri: str, step: int | None = None) -> dict:
        """Load the newest complete checkpoint (or ``step``) into any partition; returns its extra state."""
        from raypipe.checkpoint.store import latest_checkpoint, read_manifest

        step = latest_checkpoint(str(root_uri)) if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint under {root_uri}")
        extra = read_manifest(str(root_uri), step).get("extra", {})
        self._get([a.load_checkpoint.remote(str(root_uri), step) for a in self._actors])
        self.step_count = extra.get("step_count", step)
        if self.scaler and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        return extra


@dataclass
class _Submitted:
    """The references of one submitted step: the last stage's per-micro-batch
    losses (per-op executor) and one outcome per stage (its grad stats, or its
    whole ``run_step``), which raises unless that stage's step is whole."""

    losses: list
    outcomes: list


def _first_failure(refs: list) -> BaseException | None:
    """The step's cause: the first stage error that is not a consequence
    (:class:`StepAborted`) of another; else the first failure of any kind."""
    failures = []
    for ref in refs:
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            failures.append(error.cause if isinstance(error.cause, StageError) else error)
        except ray.exceptions.RayError as error:
            failures.append(error)
    causes = [f for f in failures if isinstance(f, StageError) and not isinstance(f, StepAborted)]
    return (causes or failures or [None])[0]


def _as_raypipe_error(error: BaseException, stage_of: Callable[[Exception], int | str]) -> RaypipeError:
    """A failure seen through Ray, as the raypipe error a user can act on."""
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, RaypipeError):
        error = error.cause
    if isinstance(error, StageError):
        return type(error)(error.stage, error.op, error.micro_batch, error.message,
                           error.remote_traceback, error.original)
    if isinstance(error, RaypipeError):
        return error
    if isinstance(error, ray.exceptions.RayActorError):
        return RaypipeError(f"stage {stage_of(error)} died: {error}")
    return RaypipeError(f"a stage task failed: {error}")


def _cause_of(error: BaseException) -> BaseException | None:
    if isinstance(error, ray.exceptions.RayTaskError):
        error = error.cause
    return getattr(error, "original", None)
