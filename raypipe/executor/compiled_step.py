"""The per-step executor driven through a Ray compiled graph (``step_calls="compiled"``):
the same ``run_step`` on every worker, but each step's arguments go to the
workers through the graph's channels instead of as actor tasks, which takes the
driver's cost per step from Ray's task round trip (~3 ms for two workers here)
to about a millisecond.

The price is CPU: Ray's channels are polled, so every worker's graph loop spins
on a core while it waits for the next step, and the driver spins while it waits
for the results. That is the trade vLLM makes on GPU nodes with cores to spare;
on a small CPU machine the spinning takes the cores the stages compute on, so
actor tasks stay the default (:class:`PerStepExecutor`).

What changes with the graph is how a step's end is seen:

- every worker returns its failure instead of raising it
  (:meth:`~raypipe.executor.per_step_worker.PerStepWorker.run_step_returning_failure`),
  so the cause is picked among all of them, as from task results;
- a result cannot be polled, so heartbeats are checked on a thread
  (:class:`~raypipe.runtime.health.BackgroundWatch`) while the driver reads; a
  hung worker is killed and the graph torn down, which ends the read;
- a dead worker tears the graph down (Ray does): the step's other workers end
  when their sends fail, and the graph is compiled again over the healed group.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any

import ray

from raypipe.core.micro_batches import MicroBatches
from raypipe.executor.base import StepOutcome, Submitted
from raypipe.executor.failures import first_cause
from raypipe.executor.per_step import PerStepExecutor
from raypipe.runtime.compiled_graph import CompiledCalls, GraphBroken
from raypipe.runtime.group import StageGroup
from raypipe.runtime.health import BackgroundWatch


class CompiledStepExecutor(PerStepExecutor):
    """A :class:`PerStepExecutor` whose steps reach the workers through one compiled
    graph, compiled again whenever the group's workers change."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._calls: CompiledCalls | None = None
        self._watch = BackgroundWatch()
        self._gate_calls: dict[Any, int] = {}  # worker -> gate calls submitted (see before_next_step)

    def connect(self, group: StageGroup) -> None:
        self._teardown()  # a new group (a re-partition): the old graph's workers are gone
        self._gate_calls = {}
        super().connect(group)

    def close(self) -> None:
        self._watch.close()
        self._teardown()
        super().close()

    def before_next_step(self, actors: list[Any]) -> None:
        """The graph's steps run on a thread of each worker's own, beside its other
        calls: each of ``actors`` gets a numbered gate call after what was just
        submitted to it, and its next step waits for that number
        (:mod:`raypipe.stage.step_gate`)."""
        for actor in actors:
            self._gate_calls[actor] = self._gate_calls.get(actor, 0) + 1
            actor.open_step_gate.remote(self._gate_calls[actor])

    def submit(self, step: int, batch: MicroBatches | None, loss_scale: float | None) -> Submitted:
        """Start the step (each worker once the calls it must follow have run); a
        graph torn down since the last step (a worker died between steps) is found here."""
        arguments = [(self._gate_calls.get(actor, 0), step_arguments) for actor, step_arguments
                     in zip(self.group.actors, self.step_arguments(step, batch, loss_scale))]
        try:
            references = self._compiled().call(arguments)
        except ray.exceptions.RayError as error:
            self._teardown()
            failed = self._watchdog().probe(self.group.actors)
            if failed:
                raise self._workers_failed(step, failed, f"found starting the step: {error}") from error
            references = self._compiled().call(arguments)
        return Submitted(references, references, step)

    def collect(self, submitted: Submitted) -> StepOutcome:
        """Read every worker's result; a dead or hung worker raises
        :class:`~raypipe.errors.WorkersFailed`, any other failure drops the step
        everywhere and raises its cause."""
        calls, watchdog = self._calls, self._watchdog()
        with self._watch.watching(watchdog, self.group.actors,
                                  lambda failed: self._end_execution(calls, failed)) as watch:
            results = CompiledCalls.results(submitted.commits)
        failures = [result for result in results if isinstance(result, Exception)]
        broken = [failure for failure in failures if isinstance(failure, GraphBroken)]
        if broken:
            failed = watch.failed or watchdog.probe(self.group.actors)
            if failed:
                cause = first_cause([f for f in failures if not isinstance(f, GraphBroken)]) or broken[0].error
                raise self._workers_failed(submitted.step, failed, str(cause))
            self._teardown()  # broken with every worker alive: end the loops, compile afresh next step
            self._drop_failed_step(broken[0].error, ended_everywhere=True)
        if failures:
            self._drop_failed_step(first_cause(failures), ended_everywhere=True)
        return StepOutcome(results[0].decision, results)

    def drain(self, failed: Collection[int]) -> dict[int, str]:
        """After :class:`~raypipe.errors.WorkersFailed` (workers ``failed``, killed):
        tear the graph down, which waits for the other workers' step to end."""
        submitted, self.in_flight = self.in_flight, None
        if submitted is not None:
            self._teardown()
        return {}

    def _compiled(self) -> CompiledCalls:
        actors = self.group.actors
        if self._calls is None or not self._calls.over(actors):
            self._teardown()
            self._calls = CompiledCalls(actors, "run_step_returning_failure")
        return self._calls

    def _end_execution(self, calls: CompiledCalls, failed: dict[int, str]) -> None:
        """From the watch thread: kill the failed workers (recovery would) and tear the
        graph down, which ends the driver's read."""
        self.group.kill(list(failed))
        calls.teardown()

    def _teardown(self) -> None:
        calls, self._calls = self._calls, None
        if calls is not None:
            calls.teardown()
