"""The per-step executor: one ``run_step`` task per worker per step (see
:mod:`raypipe.executor.per_step_worker`); activations and gradients go straight
between neighbours over ``torch.distributed``."""
from __future__ import annotations

from typing import Any

import ray

from raypipe.comm.task_tensors import as_task_argument
from raypipe.core.micro_batches import MicroBatches
from raypipe.executor.base import Executor, Submitted
from raypipe.executor.per_step_worker import PerStepWorker
from raypipe.runtime.group import StageGroup
from raypipe.runtime.health import worker_actor_class


class PerStepExecutor(Executor):
    """Each worker runs its whole step; the driver submits one task per worker."""

    def actor_class(self) -> Any:
        return worker_actor_class(PerStepWorker)

    def connect(self, group: StageGroup) -> None:
        super().connect(group)
        self._join(group.actors)

    def close(self) -> None:
        if self.group is None or not self.usable:
            return
        try:
            ray.get([actor.leave_group.remote() for actor in self.group.actors], timeout=30)
        except Exception:  # noqa: BLE001 - actors may already be gone at shutdown
            pass

    def submit(self, step: int, batch: MicroBatches | None, loss_scale: float | None) -> Submitted:
        """Replica ``r`` runs the step's micro-batches ``r*m .. r*m + m - 1``
        (``m = num_micro_batches``), weighted by the whole step's count."""
        num_stages, count = self.config.num_stages, self.config.num_micro_batches
        steps = []
        for rank, actor in enumerate(self.group.actors):
            replica, stage = divmod(rank, num_stages)
            own = slice(replica * count, (replica + 1) * count)
            # all of a worker's micro-batches in one argument (one object-store entry at most)
            inputs = as_task_argument(batch.inputs[own]) if batch is not None and stage == 0 else None
            targets, weights = ((as_task_argument(batch.targets[own]), batch.weights[own])
                                if batch is not None and stage == num_stages - 1 else (None, None))
            steps.append(actor.run_step.remote(step, inputs, targets, weights, loss_scale))
        return Submitted(steps, steps, step)

    def _repair(self) -> None:
        """A failed step leaves the group broken (its failing stage left it): every
        worker leaves, and all join a new one under a fresh rendezvous."""
        ray.get([actor.leave_group.remote() for actor in self.group.actors])
        self._join(self.group.actors)

    def reconnect(self, survivors: list[Any]) -> None:
        """Survivors leave the broken group (locally: a gloo group with a dead member
        is never waited on), then every worker joins a new one."""
        ray.get([actor.leave_group.remote() for actor in survivors])
        self._join(self.group.actors)

    def _join(self, actors: list[Any]) -> None:
        address, port = ray.get(actors[0].rendezvous_address.remote())
        ray.get([actor.join_group.remote(address, port, self.config.p2p_timeout_s) for actor in actors])
