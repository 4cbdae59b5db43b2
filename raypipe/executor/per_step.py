"""The per-step executor: one ``run_step`` call per worker per step (see
:mod:`raypipe.executor.per_step_worker`); activations and gradients go straight
between neighbours over ``torch.distributed``. How the calls reach the workers
(a connection to each, or actor tasks) is its :mod:`~raypipe.executor.step_dispatch`."""
from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import ray

from raypipe.comm import nccl_emulation
from raypipe.comm.task_tensors import as_task_argument
from raypipe.config import PipelineConfig
from raypipe.core.micro_batches import MicroBatches
from raypipe.core.ops import Op
from raypipe.errors import WorkersLost
from raypipe.executor.base import Executor, SnapshotTasks, StepOutcome, Submitted
from raypipe.executor.per_step_worker import PerStepWorker
from raypipe.executor.step_dispatch import ActorTasks, Connections, StepDispatch
from raypipe.runtime.actor_classes import worker_actor_class
from raypipe.runtime.group import StageGroup
from raypipe.runtime.health import HUNG

logger = logging.getLogger("raypipe")


class PerStepExecutor(Executor):
    """Each worker runs its whole step from one call; ``config.step_calls`` picks how the
    driver sends it: over a connection to each worker (``"connections"``, the default) or as
    an actor task (``"tasks"``)."""

    def __init__(self, config: PipelineConfig, schedule: list[list[Op]]) -> None:
        super().__init__(config, schedule)
        self.dispatch: StepDispatch = (Connections if config.step_calls == "connections" else ActorTasks)(self)

    def actor_class(self) -> Any:
        return worker_actor_class(PerStepWorker)

    def connect(self, group: StageGroup) -> None:
        self.dispatch.connect()
        super().connect(group)
        self._join(group.actors)

    def close(self) -> None:
        """Every worker leaves the group before the trainer kills it; one that has not
        within ``hang_timeout_s`` is hung (and killed all the same), not waited for."""
        self.dispatch.close()
        if self.group is None or not self.usable:
            return
        try:
            ray.get([actor.leave_group.remote() for actor in self.group.actors], timeout=self.config.hang_timeout_s)
        except Exception:  # noqa: BLE001 - actors may already be gone or hung at shutdown
            pass

    def submit(self, step: int, batch: MicroBatches | None, loss_scale: float | None) -> Submitted:
        return self.dispatch.submit(step, self.step_arguments(step, batch, loss_scale))

    def collect(self, submitted: Submitted) -> StepOutcome:
        return self.dispatch.collect(submitted)

    def drain(self, failed: Collection[int]) -> dict[int, str]:
        return self.dispatch.drain(failed)

    def before_next_step(self, actors: list[Any]) -> None:
        self.dispatch.before_next_step(actors)

    def start_step(self, step: int, batch: MicroBatches | None, loss_scale: float | None,
                   snapshot: bool = False) -> tuple[Submitted, SnapshotTasks | None]:
        """:meth:`Executor.start_step`, in the order of the dispatch: over connections the snapshot's
        tasks go after the step, which waits for them
        (:meth:`~raypipe.executor.step_dispatch.Connections.start_step`)."""
        self.in_flight, snapshot_tasks = self.dispatch.start_step(step, self.step_arguments(step, batch, loss_scale),
                                                                  snapshot)
        return self.in_flight, snapshot_tasks

    def step_arguments(self, step: int, batch: MicroBatches | None, loss_scale: float | None) -> list[tuple]:
        """Each worker's ``run_step`` arguments, in rank order: each replica runs its
        block of the step's micro-batches (see :attr:`~raypipe.stage.spec.WorkerSpec.block`),
        weighted by the whole step's count."""
        last = self.config.loss_stage
        # the keys marked dynamic go to every worker with every step: both ends of each keep headers
        dynamic_keys = tuple(sorted(self.dynamic_keys))
        arguments = []
        for rank in range(len(self.group.actors)):
            spec = self.group.spec(rank)
            own = slice(spec.block.start, spec.block.stop)
            # all of a worker's micro-batches in one argument (one object-store entry at most)
            inputs = as_task_argument(batch.inputs[own]) if batch is not None and spec.stage == 0 else None
            targets, weights = ((as_task_argument(batch.targets[own]), batch.weights[own])
                                if batch is not None and spec.stage == last else (None, None))
            arguments.append((step, inputs, targets, weights, loss_scale, dynamic_keys))
        return arguments

    def relayout(self, survivors: list[Any]) -> None:
        """After the group resized: every worker that was in the old group leaves it,
        every worker takes its new spec, and all join a new group. The message keys marked
        dynamic named the old layout's boundaries and micro-batches: they are learned again."""
        self.dynamic_keys = frozenset()
        self.get_watched([actor.leave_group.remote() for actor in survivors])
        self.get_watched([actor.take_layout.remote(self.group.spec(rank))
                          for rank, actor in enumerate(self.group.actors)])
        self._join(self.group.actors)

    def _repair(self) -> None:
        """A failed step leaves the group broken (its failing stage left it): every
        worker leaves, and all join a new one under a fresh rendezvous."""
        self.get_watched([actor.leave_group.remote() for actor in self.group.actors])
        self._join(self.group.actors)

    def reconnect(self, survivors: list[Any]) -> None:
        """Survivors leave the broken group (locally: a gloo group with a dead member
        is never waited on), then every worker joins a new one."""
        self.get_watched([actor.leave_group.remote() for actor in survivors])
        self._join(self.group.actors)

    def _join(self, actors: list[Any]) -> None:
        """Every worker of ``actors`` (the group's, in rank order) joins a new group, the
        first one's rendezvous. When the join fails (a worker lost before or while it
        joined), the others are released from it; where a worker was lost, those whose join does
        not end within ``hang_timeout_s`` even so are named lost too (:class:`~raypipe.errors.WorkersLost`):
        past the rendezvous, a rank waits inside torch's group formation for a peer (or for
        the store of rank 0) that is gone or stopped, in a call nothing interrupts before
        ``p2p_timeout_s``, and the heal's next calls to it would queue behind it. Replaced,
        they cost a worker start instead."""
        address, port = self.get_watched([actors[0].rendezvous_address.remote()])[0]
        emulate_nccl = nccl_emulation.requested()  # the driver's environment decides for every worker
        self.groups_formed += 1
        joins = [actor.join_group.remote(address, port, self.config.p2p_timeout_s, emulate_nccl, self.groups_formed)
                 for actor in actors]
        try:
            self.get_watched(joins)
        except BaseException as error:
            # a worker lost (or failing) before it joined: the others would wait for it in the
            # rendezvous until p2p_timeout_s, and the heal's next calls to them behind that
            self.abort_communication()
            if not isinstance(error, (WorkersLost, ray.exceptions.RayActorError)):  # no worker lost: no one held
                raise
            lost = error.ranks if isinstance(error, WorkersLost) else {}
            blocked = self._joins_not_ending(joins, skip=lost)
            if blocked:
                ranks = ", ".join(f"rank {rank}" for rank in sorted(blocked))
                why = (str(error).strip().splitlines() or [repr(error)])[0]
                logger.warning("raypipe: %s still joining the group %gs after its formation failed (%s): held there "
                               "by a lost peer; replaced as hung", ranks, self.config.hang_timeout_s, why)
                raise WorkersLost({**blocked, **lost}) from error
            raise

    def _joins_not_ending(self, joins: list, skip: Collection[int]) -> dict[int, str]:
        """The ranks (but ``skip``) whose call of ``joins`` has not ended ``hang_timeout_s`` after
        the others were released from the join: each "hung" (in the join)."""
        waiting = {ref: rank for rank, ref in enumerate(joins) if rank not in skip}
        if not waiting:
            return {}
        _, pending = ray.wait(list(waiting), num_returns=len(waiting), timeout=self.config.hang_timeout_s,
                              fetch_local=False)
        return {waiting[ref]: HUNG for ref in pending}
