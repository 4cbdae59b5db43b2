"""TrainerStep: one optimizer step from a global batch to its StepResult, around the
controller's run of it. The facade (:class:`~raypipe.trainer.PipelineTrainer`) owns
the public API; this owns what a step does before and after the pipeline runs it."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from raypipe.control.controller import Controller
from raypipe.control.snapshots import LoggedStep
from raypipe.core.micro_batches import MicroBatches, loss_weights, split_micro_batches
from raypipe.core.packed import is_packed
from raypipe.core.result import StepResult, TimelineMark
from raypipe.core.step_decision import NONFINITE, OVERFLOW, StepDecision
from raypipe.errors import ConfigError, NonFiniteError
from raypipe.observability.step_report import build_step_result

Batch = torch.Tensor | Sequence[torch.Tensor]


class TrainerStep:
    """Splits a global batch into weighted micro-batches, runs the step on ``controller``,
    and carries out its decision: the fp16 loss scale's update, ``nonfinite="raise"``, the
    committed step count (``progress.step_count``), the step logged for replay, the metrics.

    ``progress`` is the trainer's :class:`~raypipe.checkpoint_manager.trainer_state.TrainingProgress`
    (the step count and the fp16 scaler, which checkpoints carry); ``metrics()`` the
    exporter in use, or None.
    """

    def __init__(self, controller: Controller, progress: Any, loss_count_fn: Callable[[torch.Tensor], int],
                 metrics: Callable[[], Any]) -> None:
        self._controller, self._progress = controller, progress
        self._loss_count_fn, self._metrics = loss_count_fn, metrics

    def split(self, inputs: Batch, targets: Batch) -> MicroBatches:
        """The step's ``micro_batches_per_step`` micro-batches (``torch.tensor_split`` sizes, or
        given as lists) and their loss weights over the whole step.

        The executor ships them as task arguments (see :mod:`raypipe.comm.task_tensors`).
        """
        config = self._controller.config
        if config.tensor_parallel > 1 and (config.sequence_parallel or config.num_stages > 1):
            check_sequence_length(inputs, config.tensor_parallel, sequence_parallel=config.sequence_parallel)
        input_parts, target_parts = split_micro_batches(inputs, targets, config.micro_batches_per_step)
        weights = loss_weights([self._loss_count_fn(part) for part in target_parts])
        return MicroBatches(input_parts, target_parts, weights)

    def run(self, data_step: int, batch: MicroBatches | None, start: float, num_samples: int, num_tokens: int,
            num_parameters: int, peak_flops: float | None) -> StepResult:
        """Run one step (``batch`` None: the stages read step ``data_step`` of their datasets)
        and commit it; ``start`` is when the caller began it (``time.time()``)."""
        scaler = self._progress.scaler
        loss_scale = scaler.scale if scaler else None
        failures_before, slow_before = len(self._controller.failures), len(self._controller.slow_workers)
        outcome = self._controller.run_step(data_step, batch, loss_scale)
        failures = self._controller.failures[failures_before:]
        decision = outcome.decision
        self._check_finite(decision)
        if scaler:
            scaler.update(decision.skip_reason == OVERFLOW)
        config = self._controller.config
        result = build_step_result(
            step=self._progress.step_count, loss=decision.loss, grad_norm=decision.grad_norm,
            max_norm=config.clip_grad_norm, skip_reason=decision.skip_reason, loss_scale=loss_scale,
            step_time=time.time() - start, num_samples=num_samples, num_tokens=num_tokens,
            reports=outcome.reports, num_parameters=num_parameters, peak_flops=peak_flops,
            num_devices=self._controller.topology.world_size)
        result.recovered, result.failures = bool(failures), failures
        result.marks = [TimelineMark(*found.worker.worker, found.at, f"slow {found.worker.factor:.2f}x")
                        for found in self._controller.slow_workers[slow_before:]]
        self._progress.step_count += 1
        self._controller.committed(self._progress.step_count, LoggedStep(data_step, batch, loss_scale))
        metrics = self._metrics()
        if metrics is not None:
            metrics.record_step(result)
        return result

    def _check_finite(self, decision: StepDecision) -> None:
        """``nonfinite="raise"``: a non-finite step (nothing was applied) raises. In fp16 an
        overflow lowers the loss scale instead, unless the scale is already at its floor."""
        if self._controller.config.nonfinite != "raise" or not decision.skipped:
            return
        step, scaler = self._progress.step_count, self._progress.scaler
        if decision.skip_reason == NONFINITE:
            raise NonFiniteError(step, decision.first_nonfinite_stage, "the update was skipped")
        if scaler.scale <= scaler.min_scale:
            raise NonFiniteError(step, decision.first_nonfinite_stage,
                                 f"gradients overflow at the minimum loss scale {scaler.min_scale:g}")

    def evaluated(self, loss: float) -> float:
        """An evaluation's loss, reported."""
        metrics = self._metrics()
        if metrics is not None:
            metrics.record_eval(loss)
        return loss


def check_sequence_length(inputs: Any, tensor_parallel: int, *, sequence_parallel: bool = True) -> None:
    """Raise :class:`ConfigError` unless a batch's sequence (dimension 1; a packed batch's last)
    divides by ``tensor_parallel``: sequence parallelism shards it over a stage's ranks, and without
    it each rank sends its ``1/tensor_parallel`` slice of it across a stage boundary."""
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        return
    length = inputs.shape[-1] if is_packed(inputs) else inputs.shape[1]
    if length % tensor_parallel and not sequence_parallel:
        raise ConfigError("tensor_parallel", tensor_parallel, f"without sequence parallelism each tensor-parallel "
                          f"rank sends its 1/{tensor_parallel} slice of the sequence across a stage boundary, and "
                          f"the batch's sequence length {length} does not divide by it (use a sequence length "
                          "that divides)")
    if length % tensor_parallel:
        raise ConfigError("tensor_parallel", tensor_parallel, f"sequence parallelism shards the sequence, and the "
                          f"batch's sequence length {length} does not divide by it (use a sequence length that "
                          "divides, or, on one stage, sequence_parallel=False)")
