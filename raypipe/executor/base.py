"""The Executor interface: who drives a step over a group of stage workers.

An executor submits one step (:meth:`Executor.submit`), collects its outcome
(:meth:`Executor.collect`), and on failure aborts it (:meth:`Executor.abort`):
every worker drops the step, the transport is made whole, and the cause is
raised. :meth:`Executor.run_step` is that path, plus the commit: every stage
applies its optimizer step, or none does.

Every stage's apply depends on every stage's outcome, and an outcome raises
unless its stage's step is whole, so a failure anywhere reaches no optimizer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NoReturn

import ray
import torch

from raypipe.config import PipelineConfig
from raypipe.core.micro_batches import MicroBatches
from raypipe.core.ops import Op
from raypipe.errors import RaypipeError
from raypipe.executor.failures import as_raypipe_error, first_failure, original_cause
from raypipe.runtime.group import StageGroup


@dataclass
class Submitted:
    """The references of one submitted step: the last stage's per-micro-batch
    losses (when they come separately) and one outcome per stage."""

    losses: list
    outcomes: list


@dataclass
class StepOutcome:
    """What the workers reported for one committed (or skipped) step."""

    losses: list[float]
    grad_norm: float
    found_inf: bool
    reports: list


class Executor(ABC):
    """Drives steps of ``schedule`` over the workers of a :class:`StageGroup`."""

    def __init__(self, config: PipelineConfig, schedule: list[list[Op]]) -> None:
        self.config, self.schedule = config, schedule
        self.group: StageGroup | None = None
        self.usable = True  # False once a worker died or hung: the group cannot be made whole

    @abstractmethod
    def actor_class(self) -> Any:
        """The Ray actor class of this executor's workers."""

    def connect(self, group: StageGroup) -> None:
        """Set up communication between the group's (ready) workers."""
        self.group = group

    def close(self) -> None:
        """Tear down what :meth:`connect` set up."""

    @abstractmethod
    def submit(self, step: int, batch: MicroBatches | None, loss_scale: float) -> Submitted:
        """Submit every worker's ops of one training step (``batch`` None: the
        first and last stages read the step from their datasets)."""

    @abstractmethod
    def collect(self, submitted: Submitted) -> tuple[list[float], list[tuple[float, bool]]]:
        """Wait for a step's losses and per-stage (squared grad norm, found inf)."""

    @abstractmethod
    def _repair(self) -> None:
        """Make the transport usable again after every worker dropped a failed step."""

    def run_step(self, step: int, batch: MicroBatches | None, loss_scale: float = 1.0,
                 clip_grad_norm: float | None = None, check_overflow: bool = False) -> StepOutcome:
        """One step, committed on every stage or on none."""
        submitted = self.submit(step, batch, loss_scale)
        applied = None
        if clip_grad_norm is None and not check_overflow:
            applied = self._submit_apply(None, 0.0, False, after=submitted.outcomes)  # no round trip
        try:
            losses, stats = self.collect(submitted)
            grad_norm, found_inf = global_grad_norm(stats)
            if applied is None:
                applied = self._submit_apply(clip_grad_norm, grad_norm, found_inf)
            reports = ray.get(applied)
        except ray.exceptions.RayError as error:
            self.abort(submitted, error)
        return StepOutcome(losses, grad_norm, found_inf, reports)

    def abort(self, submitted: Submitted, error: BaseException) -> NoReturn:
        """Wait for the failed step to end everywhere, have every worker drop it,
        repair the transport, and raise the step's first real failure."""
        refs = submitted.losses + submitted.outcomes
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.p2p_timeout_s, fetch_local=False)
        cause = first_failure(done) or error
        try:
            if len(done) < len(refs):
                raise TimeoutError("a stage never finished the failed step")
            ray.get([actor.abort_step.remote() for actor in self.group.actors])
            self._repair()
        except (ray.exceptions.RayError, TimeoutError):
            self.usable = False
        raise as_raypipe_error(cause, self.group.index_of) from original_cause(cause)

    def evaluate(self, step: int, batch: MicroBatches | None) -> float:
        """Mean loss of one batch, forward only, through the object store."""
        actors, count = self.group.actors, self.config.num_micro_batches
        last = len(actors) - 1
        losses = []
        for micro_batch in range(count):
            hidden = None if batch is None else batch.inputs[micro_batch]
            for stage, actor in enumerate(actors):
                targets, weight = (None, None) if batch is None or stage < last else (
                    batch.targets[micro_batch], batch.weights[micro_batch])
                hidden = actor.evaluate.remote(micro_batch, hidden, targets, weight, step)
            losses.append(hidden)
        return sum(self.get(losses))

    def get(self, refs: list) -> list:
        """``ray.get`` that raises raypipe's errors."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as error:
            raise as_raypipe_error(error, self.group.index_of) from original_cause(error)

    def check_usable(self) -> None:
        """Raise unless another step can run on this group."""
        if not self.usable:
            raise RaypipeError("a stage died or never finished a failed step, so the pipeline cannot be made "
                               "whole again: shut this trainer down and start a new one (load_checkpoint resumes)")

    def _submit_apply(self, max_norm: float | None, total_norm: float, skip: bool, after: list = ()) -> list:
        return [actor.apply.remote(max_norm, total_norm, skip, *after) for actor in self.group.actors]


def global_grad_norm(stats: list[tuple[float, bool]]) -> tuple[float, bool]:
    """The global L2 norm (fp32) from every stage's squared norm, and whether any overflowed."""
    squares = torch.tensor([squared for squared, _ in stats], dtype=torch.float32)
    return float(squares.sum().sqrt()), any(found_inf for _, found_inf in stats)
