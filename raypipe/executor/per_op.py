"""The per-op executor: one Ray actor task per forward or backward op, wired by
object references (or Ray Direct Transport references).

The driver walks the lowered schedule in the dry-run simulator's order (each
stage's order kept, every receive after its send), so the submission order is
the schedule: a SEND hands the op's result reference to the peer, the peer's
op takes it as an argument, and Ray runs each actor's tasks in order.
"""
from __future__ import annotations

from typing import Any

import ray

from raypipe.comm.object_store import ObjectStoreTransport
from raypipe.config import PipelineConfig
from raypipe.core import lowering, ops
from raypipe.core.micro_batches import MicroBatches
from raypipe.core.ops import Op
from raypipe.core.simulator import simulate
from raypipe.executor.base import Executor, Submitted
from raypipe.runtime.group import StageGroup
from raypipe.stage.worker import StageWorker


class PerOpExecutor(Executor):
    """Submits every op as its own task; ``transport`` moves the tensors."""

    def __init__(self, config: PipelineConfig, schedule: list[list[Op]], transport: ObjectStoreTransport) -> None:
        super().__init__(config, schedule)
        self.transport = transport
        self._order = simulate(lowering.lower(schedule))

    def actor_class(self) -> Any:
        return self.transport.actor_class(StageWorker)

    def connect(self, group: StageGroup) -> None:
        super().connect(group)
        self.transport.connect(group.actors)

    def close(self) -> None:
        if self.group is not None and self.usable:
            self.transport.close(self.group.actors)

    def submit(self, step: int, batch: MicroBatches | None, loss_scale: float) -> Submitted:
        actors, last = self.group.actors, len(self.group.actors) - 1
        in_flight: dict[tuple[str, int, int], Any] = {}  # (what, stage, micro-batch) -> reference
        losses, outcomes = {}, {}
        for stage, op in self._order:
            actor, micro_batch = actors[stage], op.micro_batch
            if op.kind == ops.F:
                hidden = in_flight.pop(("activation", stage, micro_batch), None)
                if stage == 0 and batch is not None:
                    hidden = batch.inputs[micro_batch]
                labels = (None, None) if batch is None or stage < last else (
                    batch.targets[micro_batch], batch.weights[micro_batch])
                result = actor.forward.remote(micro_batch, hidden, *labels, step)
                in_flight[("output", stage, micro_batch)] = result
                if stage == last:
                    losses[micro_batch] = result
            elif op.kind == ops.B:
                gradient = in_flight.pop(("gradient", stage, micro_batch), None)
                scale = loss_scale if stage == last else 1.0
                in_flight[("input_gradient", stage, micro_batch)] = actor.backward.remote(micro_batch, gradient, scale)
            elif op.kind == ops.SEND_ACT:
                in_flight[("activation", op.peer, micro_batch)] = in_flight.pop(("output", stage, micro_batch))
            elif op.kind == ops.SEND_GRAD:
                in_flight[("gradient", op.peer, micro_batch)] = in_flight.pop(("input_gradient", stage, micro_batch))
            elif op.kind == ops.REDUCE_GRAD:
                # after every op of the stage (tasks of one actor run in order); raises
                # unless all of them ran, so no apply runs after a failed op anywhere
                outcomes[stage] = actor.finish_backward.remote(1.0 / loss_scale, self.config.clip_grad_value)
            # RECV_*: the reference is already in flight; OPTIMIZER_STEP: see run_step
        return Submitted([losses[mb] for mb in sorted(losses)], [outcomes[s] for s in sorted(outcomes)])

    def collect(self, submitted: Submitted) -> tuple[list[float], list[tuple[float, bool]]]:
        return ray.get(submitted.losses), ray.get(submitted.outcomes)

    def _repair(self) -> None:
        """Nothing to repair: a failed op leaves nothing behind in the transport."""
