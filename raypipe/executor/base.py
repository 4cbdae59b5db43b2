"""The Executor interface: who drives a step over a group of stage workers.

An executor submits one step (:meth:`Executor.submit`), collects its outcome
(:meth:`Executor.collect`), and on failure aborts it (:meth:`Executor.abort`):
every worker drops the step, the transport is made whole, and the cause is
raised. :meth:`Executor.start_step` and :meth:`Executor.finish_step` are that path.

A failed worker's neighbours are released by gloo at once (a receive from a
peer that left raises), but not by NCCL: there a neighbour blocked on the failed
worker waits until NCCL's watchdog fires. So as soon as one worker's step failed
or a worker is found dead or hung, the driver aborts the others' communication
(:meth:`Executor.abort_communication`: each survivor's
:meth:`~raypipe.comm.p2p.P2PChannel.abort`, on its health thread), and their
steps end with :class:`~raypipe.errors.StepAborted`.

The commit is part of the step: every worker gets every stage's gradient
statistics (as task arguments, or by an all-reduce inside the group), decides
the same way (:func:`raypipe.core.step_decision.decide_step`) and steps or skips.
A worker's statistics exist only when all of its ops ran, so a failure anywhere
reaches no optimizer, and the driver waits once per step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Callable, Collection, Iterable
from typing import Any, NoReturn

import ray

from raypipe.comm.object_store import ByReference
from raypipe.comm.task_tensors import as_task_argument
from raypipe.config import PipelineConfig
from raypipe.core.micro_batches import MicroBatches
from raypipe.core.ops import Op, worker_and_chunk
from raypipe.core.result import StageReport
from raypipe.core.step_decision import StepDecision
from raypipe.core.topology import Topology
from raypipe.errors import RaypipeError, WorkersFailed, WorkersLost
from raypipe.executor.failures import as_raypipe_error, first_failure, original_cause
from raypipe.runtime.group import StageGroup
from raypipe.runtime.health import Watchdog, ended_or_failed, get_watched, wait_watched


@dataclass
class Submitted:
    """The references of one submitted step: one outcome per worker (raises
    unless that worker's ops all ran) and one commit per worker (its report)."""

    outcomes: list
    commits: list
    step: int = 0
    intermediates: list = field(default_factory=list)  # per-op: every op's result, read once the step failed

    @property
    def refs(self) -> list:
        """Every reference of the step, once each."""
        return list({ref: None for ref in self.outcomes + self.commits})


@dataclass
class SnapshotTasks:
    """Every worker's snapshot task, just submitted: ``states``, each worker's state (a
    result the driver owns, so it outlives the worker), by rank; ``stored``, where the
    next step may commit before a state is stored (its worker lets the commit go once the
    state is copied, and ships it after), each task's second result, small, which reads
    True once its state is stored (Ray stores a task's results together); None where that
    commit comes after the state is stored."""

    states: list
    stored: list | None = None


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
        self.usable = True  # False once a failed step could not be dropped: the group cannot be made whole
        self.in_flight: Submitted | None = None  # the step being run
        self.groups_formed = 0  # how many times the workers joined a group: an abort names the one it is for

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
        """Wait for the step's commit on every worker (a failure raises Ray's error;
        a worker that stops answering its heartbeat raises :class:`WorkersFailed`)."""
        return self.collect_task_results(submitted)

    def collect_task_results(self, submitted: Submitted) -> StepOutcome:
        """:meth:`collect` of a step whose commits are Ray task results."""
        failed = self.watchdog().wait_until(ended_or_failed(submitted.commits), self.group.actors)
        if failed:
            raise self.workers_failed(submitted.step, failed, "found while waiting on the step")
        reports = ray.get(submitted.commits)  # a failure raises (and not every worker may have ended yet)
        return StepOutcome(reports[0].decision, reports)

    def snapshot_workers(self, actors: list[Any]) -> SnapshotTasks:
        """Submit every one of ``actors``' :meth:`snapshot` (results owned by the driver),
        ordered before their next step's commit. Actor tasks run in submission order, so
        each is copied and stored at once, before the next step's first op."""
        refs = [actor.snapshot.remote() for actor in actors]
        self.before_next_step(actors)
        return SnapshotTasks(refs)

    def before_next_step(self, actors: list[Any]) -> None:
        """Calls just submitted to ``actors`` and not waited for (a snapshot, a
        checkpoint's copy of the state) must run before their next step. Actor tasks
        run in submission order, so here there is nothing to do."""

    @abstractmethod
    def _repair(self) -> None:
        """Make the transport usable again after every worker dropped a failed step."""

    def start_step(self, step: int, batch: MicroBatches | None, loss_scale: float | None,
                   snapshot: bool = False) -> tuple[Submitted, SnapshotTasks | None]:
        """Submit one step (:meth:`submit`) and, with ``snapshot``, every worker's snapshot of the
        state that step starts from (:meth:`snapshot_workers`: its tasks, for the caller to keep),
        ordered before the step's commit. Here the snapshot is submitted first: actor tasks run in
        submission order. :meth:`finish_step` waits for the step."""
        snapshot_tasks = self.snapshot_workers(self.group.actors) if snapshot else None
        self.in_flight = self.submit(step, batch, loss_scale)
        return self.in_flight, snapshot_tasks

    def finish_step(self, submitted: Submitted) -> StepOutcome:
        """The step :meth:`start_step` submitted, committed on every worker or on none: one wait
        for the driver."""
        try:
            outcome = self.collect(submitted)
        except ray.exceptions.RayError as error:
            self.abort(submitted, error)
        self.in_flight = None
        return outcome

    def abort(self, submitted: Submitted, error: BaseException) -> NoReturn:
        """Wait for the failed step to end everywhere. When workers died, hung or
        cannot be reached, raise :class:`WorkersFailed` (the trainer heals it);
        otherwise have every worker drop the step, repair the transport, and raise
        the step's first real failure."""
        refs = submitted.refs
        self.abort_communication()
        watchdog = self.watchdog()
        failed = watchdog.wait(refs, self.group.actors, deadline_s=self.config.p2p_timeout_s) or watchdog.probe(
            self.group.actors)
        if failed:
            raise self.workers_failed(submitted.step, failed, str(first_failure(self._finished(refs)) or error))
        done = self._finished(refs)
        self._read_errors(submitted.intermediates)
        self.drop_failed_step(first_failure(done) or error, ended_everywhere=len(done) == len(refs))

    def drop_failed_step(self, cause: BaseException, ended_everywhere: bool) -> NoReturn:
        """Have every worker drop the failed step, repair the transport, and raise
        ``cause`` (the group stays unusable when the step did not end everywhere)."""
        self.in_flight = None
        try:
            if not ended_everywhere:
                raise TimeoutError("a stage never finished the failed step")
            self.get_watched([actor.abort_step.remote() for actor in self.group.actors])
            self._repair()
        except (ray.exceptions.RayError, WorkersLost, TimeoutError):
            self.usable = False
        raise as_raypipe_error(cause, self.group.index_of) from original_cause(cause)

    def drain(self, failed: Collection[int]) -> dict[int, str]:
        """After :class:`WorkersFailed` (workers ``failed``, killed): wait for the
        failed step's tasks on the other workers to end (they fail once their peers
        are gone); returns any other worker found failed meanwhile."""
        return self.drain_tasks(failed)

    def drain_tasks(self, failed: Collection[int]) -> dict[int, str]:
        """:meth:`drain` of a step whose ops are Ray tasks."""
        submitted, self.in_flight = self.in_flight, None
        if submitted is None:
            return {}
        # outcomes and commits are per worker, in rank order
        refs = list({ref: None for refs in (submitted.outcomes, submitted.commits) for index, ref in enumerate(refs)
                     if index not in failed})
        self.abort_communication(failed)
        more = self.watchdog().wait(refs, self.group.actors, deadline_s=self.config.p2p_timeout_s)
        self._read_errors(refs + submitted.intermediates)
        return more

    def abort_communication(self, failed: Collection[int] = ()) -> None:
        """Release every worker but ``failed`` from a step blocked on a peer (NCCL
        releases no one when a peer fails; see the module's docstring), or from joining the
        group being formed while a peer was lost before it joined. The calls run
        on the workers' health threads; a worker that does not answer within a second
        (hung, or gone) is not waited for: the heartbeats find it. Workers without a
        group of their own (the per-op executor's) have nothing to abort."""
        aborts = [getattr(actor, "abort_communication", None) for index, actor in enumerate(self.group.actors)
                  if index not in failed]
        # a call still queued when the group is formed again must not abort the new one
        calls = [abort.remote(self.groups_formed) for abort in aborts if abort is not None]
        if not calls:
            return
        done, _ = ray.wait(calls, num_returns=len(calls), timeout=1.0, fetch_local=False)
        self._read_errors(done)

    def _read_errors(self, refs: list) -> None:
        """Read every finished error of a failed step, so that Ray does not print them as unhandled."""
        for ref in self._finished(refs):
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - errors are expected; a direct-transport result cannot be read here
                pass

    def relayout(self, survivors: list[Any]) -> None:
        """After the group resized (an elastic run): the workers take their new specs and
        communication is re-formed (``survivors``: the workers that were in the old group)."""
        raise NotImplementedError(f"{type(self).__name__} runs a fixed number of replicas")

    def reconnect(self, survivors: list[Any]) -> None:
        """Re-form communication after workers were replaced: ``survivors`` (the
        workers that were not) leave what they were part of, then every worker of
        the group joins afresh."""
        self.connect(self.group)

    def watchdog(self) -> Watchdog:
        """The heartbeat watchdog that finds a dead or hung worker while the driver waits."""
        return Watchdog(self.config.hang_timeout_s)

    def topology(self) -> Topology:
        """The ranks of the group running now (a resize changes it before the layout in force)."""
        return Topology.of_workers(self.config.num_stages, len(self.group.actors), self.config.tensor_parallel)

    def workers_failed(self, step: int, failed: dict[int, str], detail: str) -> WorkersFailed:
        """The error of ``failed`` workers (rank -> why) found during ``step``, to be healed."""
        topology = self.topology()
        return WorkersFailed(step, {topology.place(index): why for index, why in failed.items()}, detail)

    @staticmethod
    def _finished(refs: list) -> list:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return done

    def evaluate(self, step: int, batch: MicroBatches | None) -> float:
        """Mean loss of one batch, forward only, through the object store; every
        replica's pipeline takes its own block of micro-batches, as in a step. With tensor
        parallelism each tp_rank's pipeline runs the same forwards (its stages' ranks issue
        their collectives together: each worker runs its calls in the order sent), and the
        loss is tp_rank 0's (every rank's is the same)."""
        config = self.config
        last, t, topology = config.num_virtual_stages - 1, config.tensor_parallel, self.topology()
        losses, others = [], []
        for replica in range(topology.num_replicas):
            for tp_rank in range(t):
                ranks = topology.pipeline_ranks(replica, tp_rank)
                pipeline = [self.group.actors[rank] for rank in ranks]
                for micro_batch, index in enumerate(self.group.spec(ranks[0]).block):
                    hidden = None if batch is None else as_task_argument(batch.inputs[index])
                    for virtual_stage in range(last + 1):  # through every chunk, in model order
                        stage, chunk = worker_and_chunk(virtual_stage, topology.num_stages, config.placement)
                        targets, weight = (None, None) if batch is None or virtual_stage < last else (
                            as_task_argument(batch.targets[index]), batch.weights[index])
                        # the previous stage's output by reference, fetched in the call: a call
                        # waiting for its argument would hold back the worker's heartbeats
                        passed = ByReference(hidden) if isinstance(hidden, ray.ObjectRef) else hidden
                        hidden = pipeline[stage].evaluate.remote(micro_batch, passed, targets, weight, step, chunk)
                    (others if tp_rank else losses).append(hidden)
        return sum(self.gather(losses + others, step, "during evaluate")[:len(losses)])

    def gather(self, refs: list, step: int, during: str) -> list:
        """:meth:`get` of calls to the workers, after the committed step ``step``; raises
        :class:`WorkersFailed` if a worker hangs first (a plain get would block forever)."""
        failed = self.watchdog().wait(refs, self.group.actors)
        if failed:
            raise self.workers_failed(step, failed, during)
        return self._raypipe_errors(ray.get, refs)  # every call done: watched already

    def get(self, refs: list) -> list:
        """:meth:`get_watched`, raising raypipe's errors."""
        return self._raypipe_errors(self.get_watched, refs)

    def get_watched(self, refs: list) -> list:
        """``ray.get`` of calls to the workers, the group's workers watched meanwhile
        (:func:`~raypipe.runtime.health.get_watched`): one found dead or hung first raises
        :class:`~raypipe.errors.WorkersLost` (a heal folds it in) instead of a wait that a
        stopped worker's call ends only when gRPC's keepalive gives up on it; Ray's errors
        are raised as they are."""
        return get_watched(refs, self.group.actors, self.config.hang_timeout_s)

    def _raypipe_errors(self, get: Callable[[list], list], refs: list) -> list:
        try:
            return get(refs)
        except ray.exceptions.RayError as error:
            raise as_raypipe_error(error, self.group.index_of) from original_cause(error)

    def wait(self, refs: list) -> None:
        """Until calls to the workers are done (their results not fetched), the group's workers
        watched meanwhile as :meth:`get` watches them."""
        wait_watched(refs, self.group.actors, self.config.hang_timeout_s)

    #: message keys that keep headers under boundary_shapes="learned" (only the per-step executor learns signatures)
    dynamic_keys: frozenset[int] = frozenset()

    def mark_dynamic(self, keys: Iterable[int]) -> None:
        """Message ``keys`` keep headers from the next step on (after a
        :class:`~raypipe.errors.BoundaryShapeChanged`); the executors whose transports send
        no learned signatures have nothing to mark."""
        self.dynamic_keys = self.dynamic_keys | frozenset(keys)

    def check_usable(self) -> None:
        """Raise unless another step can run on this group."""
        if not self.usable:
            raise RaypipeError("a stage died or never finished a failed step, so the pipeline cannot be made "
                               "whole again: shut this trainer down and start a new one (load_checkpoint resumes)")
