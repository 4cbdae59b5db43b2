"""How the per-step executor's driver reaches its workers: the one thing its two
ways of running a step differ in (``PipelineConfig.step_calls``).

:class:`ActorTasks` (``"tasks"``) submits one ``run_step`` actor task per worker
and reads the results as Ray task results. :class:`Connections` (``"connections"``,
the default) sends the same ``run_step`` over a connection from the driver to
every worker (:mod:`raypipe.runtime.connection_calls`), at a fraction of the driver's
cost per step (one message each way per worker instead of a Ray task's round trip).

What changes with connections is how a step's end is seen:

- every worker returns its failure instead of raising it
  (:meth:`~raypipe.executor.per_step_worker.PerStepWorker.run_step_returning_failure`),
  so the cause is picked among all of them, as from task results;
- the driver waits on the connections and checks heartbeats in between, as it
  does on task results (:meth:`~raypipe.runtime.health.Watchdog.wait_until`);
- a dead worker closes its connection: the step's other workers end when their
  sends fail (on gloo) or once the driver aborts their communication (on NCCL,
  which releases no one: :meth:`~raypipe.executor.base.Executor.abort_communication`),
  and the connections are opened again over the healed group;
- the first failure read stops the wait: the workers still in the step are
  aborted, and their answers (:class:`~raypipe.errors.StepAborted`) read after.

The calls run on a thread of each worker's own, beside its actor tasks, so a
snapshot or checkpoint copy submitted between two steps is ordered before the
next step's commit by a numbered gate (:mod:`raypipe.stage.step_gate`). That
lets a snapshot wait for the step too: it is copied once the stage first waits
in the step, and submitted just after the step, whose gate number counts it
(:meth:`Connections.snapshot_workers`). Actor tasks run in submission order, so
there the snapshot is submitted just before the step it precedes and copies at once,
before the step's first op.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from multiprocessing import connection as connections
from typing import Any

import ray

from raypipe.comm import call_socket
from raypipe.errors import WorkersLost
from raypipe.executor.base import Executor, SnapshotTasks, StepOutcome, Submitted
from raypipe.executor.failures import first_cause
from raypipe.runtime.connection_calls import CallsBroken, ConnectionCalls


class StepDispatch(ABC):
    """One way of sending a step to the per-step executor's workers and reading its end
    (``executor``: the per-step executor, through the :class:`Executor` interface it
    implements, so this module needs nothing of the one that composes it)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def connect(self) -> None:
        """The executor has a new group (its workers joined it)."""

    def close(self) -> None:
        """The workers are about to be killed."""

    @abstractmethod
    def submit(self, step: int, arguments: list[tuple]) -> Submitted:
        """Start ``run_step(*arguments[rank])`` on every worker."""

    def start_step(self, step: int, arguments: list[tuple], snapshot: bool) -> tuple[Submitted, SnapshotTasks | None]:
        """:meth:`Executor.start_step` with the step's arguments: here the snapshot first, then the
        step (actor tasks run in submission order)."""
        snapshot_tasks = self.executor.snapshot_workers(self.executor.group.actors) if snapshot else None
        return self.submit(step, arguments), snapshot_tasks

    @abstractmethod
    def collect(self, submitted: Submitted) -> StepOutcome:
        """Every worker's report of the submitted step; see :meth:`Executor.collect`."""

    @abstractmethod
    def drain(self, failed: Collection[int]) -> dict[int, str]:
        """See :meth:`Executor.drain`."""

    def before_next_step(self, actors: list[Any]) -> None:
        """See :meth:`Executor.before_next_step`."""


class ActorTasks(StepDispatch):
    """One ``run_step`` actor task per worker (``step_calls="tasks"``)."""

    def submit(self, step: int, arguments: list[tuple]) -> Submitted:
        steps = [actor.run_step.remote(*worker_arguments)
                 for actor, worker_arguments in zip(self.executor.group.actors, arguments)]
        return Submitted(steps, steps, step)

    def collect(self, submitted: Submitted) -> StepOutcome:
        return self.executor.collect_task_results(submitted)

    def drain(self, failed: Collection[int]) -> dict[int, str]:
        return self.executor.drain_tasks(failed)


class Connections(StepDispatch):
    """The steps' calls over a connection to each worker (``step_calls="connections"``),
    opened again whenever the group's workers change."""

    def __init__(self, executor: Executor) -> None:
        super().__init__(executor)
        self._calls: ConnectionCalls | None = None
        self._gate_calls: dict[Any, int] = {}  # worker -> gate calls submitted (before_next_step, snapshot_workers)

    def connect(self) -> None:
        self._teardown()  # a new group (a re-partition): the old connections' workers are gone
        self._gate_calls = {}

    def close(self) -> None:
        self._teardown(wait=False)  # the workers are killed next: a hung one's call never ends

    def before_next_step(self, actors: list[Any]) -> None:
        """The steps run on a thread of each worker's own, beside its other calls:
        each of ``actors`` gets a numbered gate call after what was just submitted to
        it, and its next step waits for that number (:mod:`raypipe.stage.step_gate`)."""
        for actor in actors:
            actor.open_step_gate.remote(self._next_gate_call(actor))

    def _next_gate_call(self, actor: Any) -> int:
        """The number of ``actor``'s gate call about to be submitted (its next step waits for it)."""
        self._gate_calls[actor] = self._gate_calls.get(actor, 0) + 1
        return self._gate_calls[actor]

    def start_step(self, step: int, arguments: list[tuple], snapshot: bool) -> tuple[Submitted, SnapshotTasks | None]:
        """The step first, then (``snapshot``) its snapshot's tasks (:meth:`snapshot_workers`), whose
        gate numbers the step already counts, so the driver's tasks do not hold the step's start."""
        if not snapshot:
            return self.submit(step, arguments), None
        return self._send(step, arguments, gate_calls_to_come=1), self.snapshot_workers(self.executor.group.actors)

    def snapshot_workers(self, actors: list[Any]) -> SnapshotTasks:
        """Each worker's snapshot of the state the step just sent starts from (:meth:`start_step`):
        copied once that step first waits for a neighbour (stage 0 after its forwards, the others
        before their first activation arrives), not beside its first forward; the step's commit
        waits for the copy. Over open connections only: a snapshot waiting for a step would hold
        up the set-up of a new one.

        The snapshot call is the worker's next gate call itself (it opens the gate once the
        state is copied): one Ray task a worker a step, not two. The driver submits them one by
        one, ~0.3 ms each, after it has sent the step, so they do not hold the step's start (at a
        thousand workers, ~0.3 s a snapshot step): the step's first op that changes saved state
        waits for the task (the commit, long after it arrives; the first forward where the layers
        save buffers, which waits about as long as it waited for the step's own call when the
        tasks went first). The copy is stored (shipped into the object store) after the gate
        opened, beside the rest of the step and possibly past its commit: each task's second
        result says when it is (:attr:`SnapshotTasks.stored`)."""
        try:
            self._connected()
        except (ray.exceptions.RayError, OSError, WorkersLost):  # lost since the step was sent: its collect finds out
            return self.executor.snapshot_workers(actors)  # its gate call is the number the step waits for
        tasks = [actor.snapshot_at_first_wait.remote(self._next_gate_call(actor)) for actor in actors]
        return SnapshotTasks([state for state, _ in tasks], [stored for _, stored in tasks])

    def submit(self, step: int, arguments: list[tuple]) -> Submitted:
        return self._send(step, arguments)

    def _send(self, step: int, arguments: list[tuple], gate_calls_to_come: int = 0) -> Submitted:
        """Start the step (each worker once the calls it must follow have run, those submitted
        before and ``gate_calls_to_come`` after); a connection broken since the last step (a
        worker died between steps) is found here."""
        executor = self.executor
        gated = [(self._gate_calls.get(actor, 0) + gate_calls_to_come, worker_arguments)
                 for actor, worker_arguments in zip(executor.group.actors, arguments)]
        try:
            pending = self._connected().call(gated)
        except (ray.exceptions.RayError, OSError, WorkersLost) as error:
            found = self._teardown()
            # a worker that did not answer while its connection opened was found lost then: not asked again
            failed = ({**error.ranks, **found} if isinstance(error, WorkersLost)
                      else found or executor.watchdog().probe(executor.group.actors))
            if failed:
                raise executor.workers_failed(step, failed, f"found starting the step: {error}") from error
            pending = self._connected().call(gated)
        return Submitted(pending, pending, step)

    def collect(self, submitted: Submitted) -> StepOutcome:
        """Read every worker's result; a dead or hung worker raises
        :class:`~raypipe.errors.WorkersFailed`, any other failure drops the step
        everywhere and raises its cause."""
        executor = self.executor
        watchdog, pending, answers = executor.watchdog(), submitted.commits, {}
        failed = watchdog.wait_until(lambda timeout_s: _read_answers(pending, answers, timeout_s, until_failure=True),
                                     executor.group.actors)
        if failed:
            raise executor.workers_failed(submitted.step, failed, "found while waiting on the step")
        failures = [answer for answer in answers.values() if isinstance(answer, Exception)]
        broken = [failure for failure in failures if isinstance(failure, CallsBroken)]
        if broken:
            failed = watchdog.probe(executor.group.actors)
            if failed:
                cause = first_cause([f for f in failures if not isinstance(f, CallsBroken)]) or broken[0].error
                raise executor.workers_failed(submitted.step, failed, str(cause))
            executor.abort_communication()
            found = self._teardown()  # broken with every worker alive: close, connect afresh next step
            if found:  # ... unless one stopped meanwhile
                raise executor.workers_failed(submitted.step, found, str(broken[0].error))
            executor.drop_failed_step(broken[0].error, ended_everywhere=True)
        if failures:
            if len(answers) < len(pending):  # the others may wait on the failed one forever (NCCL): release them
                executor.abort_communication()
                failed = watchdog.wait_until(lambda timeout_s: _read_answers(pending, answers, timeout_s),
                                             executor.group.actors, deadline_s=executor.config.p2p_timeout_s)
                if failed:
                    raise executor.workers_failed(submitted.step, failed, str(first_cause(failures)))
            failures = [answer for answer in answers.values() if isinstance(answer, Exception)]
            executor.drop_failed_step(first_cause(failures), ended_everywhere=len(answers) == len(pending))
        results = [answers[rank] for rank in range(len(pending))]
        return StepOutcome(results[0].decision, results)

    def drain(self, failed: Collection[int]) -> dict[int, str]:
        """After :class:`~raypipe.errors.WorkersFailed` (workers ``failed``, killed):
        close the connections, which waits for the other workers' step to end, their
        heartbeats watched: a survivor found dead or hung meanwhile (stopped as the step
        failed: its step never ends) is returned, not waited for until ``p2p_timeout_s``.
        Closed with no step in flight too (a worker lost between steps), without waiting (no
        step runs; a survivor hung meanwhile would hold the wait): each survivor's snapshot
        waits for the next step's first wait over its connection (:meth:`snapshot_workers`),
        no step comes before the heal restores that snapshot, and the closed connection lets
        it go (else it waited ``p2p_timeout_s``)."""
        executor = self.executor
        submitted, executor.in_flight = executor.in_flight, None
        if submitted is not None:
            executor.abort_communication(failed)  # on NCCL nothing else ends their step
            return self._teardown(skip=failed)
        self._teardown(wait=False)
        return {}

    def _connected(self) -> ConnectionCalls:
        actors = self.executor.group.actors
        if self._calls is None or not self._calls.over(actors):
            self._teardown()
            config = self.executor.config
            self._calls = ConnectionCalls(actors, "run_step_returning_failure", config.p2p_timeout_s,
                                          config.hang_timeout_s)
        return self._calls

    def _teardown(self, wait: bool = True, skip: Collection[int] = ()) -> dict[int, str]:
        """The connections closed (:meth:`ConnectionCalls.teardown`): the workers found dead or hung
        waiting for their calls to end."""
        calls, self._calls = self._calls, None
        return {} if calls is None else calls.teardown(wait, skip)


def _read_answers(pending: list[Any], answers: dict[int, Any], timeout_s: float, until_failure: bool = False) -> bool:
    """Read into ``answers`` (rank -> result) every answer of ``pending`` (one
    :meth:`ConnectionCalls.call`'s connections) that arrives within ``timeout_s``; whether
    every rank answered (``until_failure``: or one answered with a failure). A read
    that fails gives :class:`CallsBroken` in that rank's place."""
    end = time.monotonic() + timeout_s
    while True:
        waiting = [connection for rank, connection in enumerate(pending) if rank not in answers]
        if not waiting or (until_failure and any(isinstance(answer, Exception) for answer in answers.values())):
            return True
        readable = connections.wait(waiting, max(0.0, end - time.monotonic()))
        if not readable:
            return False
        for connection in readable:
            rank = pending.index(connection)
            try:
                answers[rank] = call_socket.receive(connection)
            except Exception as error:  # noqa: BLE001 - EOFError, OSError, or an unpicklable reply
                answers[rank] = CallsBroken(rank, error if str(error) else EOFError("the connection was closed"))
