"""The Executor interface: who drives a step over a group of stage workers.

An executor submits one step (:meth:`Executor.submit`), collects its outcome
(:meth:`Executor.collect`), and on failure aborts it (:meth:`Executor.abort`):
every worker drops the step, the transport is made whole, and the cause is
raised. :meth:`Executor.run_step` is that path.

The commit is part of the step: every worker gets every stage's gradient
statistics (as task arguments, or by an all-reduce inside the group), decides
the same way (:func:`raypipe.core.step_decision.decide`) and steps or skips.
A worker's statistics exist only when all of its ops ran, so a failure anywhere
reaches no optimizer, and the driver waits once per step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NoReturn

import ray

from raypipe.comm.task_tensors import as_task_argument
from raypipe.config import PipelineConfig
from raypipe.core.micro_batches import MicroBatches
from raypipe.core.ops import Op
from raypipe.core.result import StageReport
from raypipe.core.step_decision import StepDecision
from raypipe.errors import RaypipeError
from raypipe.executor.failures import as_raypipe_error, first_failure, original_cause
from raypipe.runtime.group import StageGroup


@dataclass
class Submitted:
    """The references of one submitted step: one outcome per worker (raises
    unless that worker's ops all ran) and one commit per worker (its report)."""

    outcomes: list
    commits: list


@dataclass
class StepOutcome:
    """What the workers reported for one committed (or skipped) step."""

    decision: StepDecision
    reports: list[StageReport]


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
    def submit(self, step: int, batch: MicroBatches | None, loss_scale: float | None) -> Submitted:
        """Submit every worker's ops of one training step, its commit included
        (``batch`` None: the first and last stages read the step from their
        datasets; ``loss_scale`` None: no dynamic loss scale)."""

    def collect(self, submitted: Submitted) -> StepOutcome:
        """Wait for the step's commit on every worker (a failure raises Ray's error)."""
        reports = ray.get(submitted.commits)
        return StepOutcome(reports[0].decision, reports)

    @abstractmethod
    def _repair(self) -> None:
        """Make the transport usable again after every worker dropped a failed step."""

    def run_step(self, step: int, batch: MicroBatches | None, loss_scale: float | None = None) -> StepOutcome:
        """One step, committed on every worker or on none: one wait for the driver."""
        submitted = self.submit(step, batch, loss_scale)
        try:
            return self.collect(submitted)
        except ray.exceptions.RayError as error:
            self.abort(submitted, error)

    def abort(self, submitted: Submitted, error: BaseException) -> NoReturn:
        """Wait for the failed step to end everywhere, have every worker drop it,
        repair the transport, and raise the step's first real failure."""
        refs = list({ref: None for ref in submitted.outcomes + submitted.commits})
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
        """Mean loss of one batch, forward only, through the object store; every
        replica's pipeline takes its own block of micro-batches, as in a step."""
        num_stages, count = self.config.num_stages, self.config.num_micro_batches
        losses = []
        for index in range(count * self.config.num_replicas):
            replica, micro_batch = divmod(index, count)
            pipeline = self.group.actors[replica * num_stages:(replica + 1) * num_stages]
            hidden = None if batch is None else as_task_argument(batch.inputs[index])
            for stage, actor in enumerate(pipeline):
                targets, weight = (None, None) if batch is None or stage < num_stages - 1 else (
                    as_task_argument(batch.targets[index]), batch.weights[index])
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

