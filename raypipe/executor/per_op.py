"""The per-op executor: one Ray actor task per forward or backward op, wired by
object references (or Ray Direct Transport references).

The driver walks the lowered schedule in the dry-run simulator's order (each
stage's order kept, every receive after the op that made what it receives), so
the submission order is the schedule: a RECV takes the reference of the op
whose result the peer sends, the next op takes it as an argument, and Ray runs
each actor's tasks in order. A batched EXCHANGE is just its sends and receives
here: references need no rendezvous.
"""
from __future__ import annotations

from typing import Any

from raypipe.comm.object_store import ObjectStoreTransport
from raypipe.comm.task_tensors import as_task_argument
from raypipe.config import PipelineConfig
from raypipe.core import ops
from raypipe.core.micro_batches import MicroBatches
from raypipe.core.ops import Op
from raypipe.core.schedule import dry_run
from raypipe.executor.base import Executor, Submitted
from raypipe.runtime.actor_classes import worker_actor_class
from raypipe.runtime.group import StageGroup
from raypipe.stage.worker import StageWorker


class PerOpExecutor(Executor):
    """Submits every op as its own task; ``transport`` moves the tensors."""

    def __init__(self, config: PipelineConfig, schedule: list[list[Op]], transport: ObjectStoreTransport) -> None:
        super().__init__(config, schedule)
        self.transport = transport
        self._order = dry_run(schedule)  # cached: the trainer's make_schedule ran it

    def actor_class(self) -> Any:
        return worker_actor_class(StageWorker, self.transport.tensor_transport)

    def connect(self, group: StageGroup) -> None:
        super().connect(group)
        self.transport.connect(group.actors)

    def close(self) -> None:
        if self.group is not None and self.usable:
            self.transport.close(self.group.actors)

    def submit(self, step: int, batch: MicroBatches | None, loss_scale: float | None) -> Submitted:
        wiring = _Wiring(self.group.actors, step, batch, 1.0 if loss_scale is None else loss_scale,
                         self.config.clip_grad_value)
        for stage, op in self._order:
            wiring.submit(stage, op)
        stats = [wiring.outcomes[stage] for stage in range(len(self.group.actors))]
        # Ray resolves the references to every stage's statistics before a commit runs
        commits = [actor.commit.remote(loss_scale is not None, *stats) for actor in self.group.actors]
        return Submitted(stats, commits, step, wiring.created)

    def reconnect(self, survivors: list[Any]) -> None:
        """The transport's group is made anew over every worker (the object store has none)."""
        self.transport.close(survivors)
        self.transport.connect(self.group.actors)

    def _repair(self) -> None:
        """Nothing to repair: a failed op leaves nothing behind in the transport."""


class _Wiring:
    """One step's tasks, submitted op by op: a RECV takes the reference of the
    peer's op whose result it receives, and the stage's next op takes it as an argument."""

    def __init__(self, actors: list[Any], step: int, batch: MicroBatches | None, loss_scale: float,
                 clip_value: float | None) -> None:
        self.actors, self.last, self.step, self.batch = actors, len(actors) - 1, step, batch
        self.loss_scale, self.clip_value = loss_scale, clip_value
        self.in_flight: dict[tuple[str, int, int], Any] = {}  # (what, stage, micro-batch) -> reference
        self.outcomes: dict[int, Any] = {}
        self.created: list = []  # every op's reference, so that a failed step's errors are all read
        # SEND_*: the receive takes the reference; OPTIMIZER_STEP: the commit, after every op
        self._handlers = {ops.F: self._forward, ops.B: self._backward, ops.I: self._backward, ops.W: self._weight,
                          ops.RECV_ACT: self._receive,
                          ops.RECV_GRAD: self._receive, ops.REDUCE_GRAD: self._finish}

    def submit(self, stage: int, op: ops.LoweredOp) -> None:
        for part in op.unbatched():  # an exchange: its sends and receives, in order
            handler = self._handlers.get(part.kind)
            if handler is not None:
                handler(stage, part)

    def _forward(self, stage: int, op: ops.LoweredOp) -> None:
        micro_batch, batch = op.micro_batch, self.batch
        hidden = self.in_flight.pop(("activation", stage, micro_batch), None)
        if stage == 0 and batch is not None:
            hidden = as_task_argument(batch.inputs[micro_batch])
        labels = (None, None) if batch is None or stage < self.last else (
            as_task_argument(batch.targets[micro_batch]), batch.weights[micro_batch])
        self.in_flight[("output", stage, micro_batch)] = output = self.actors[stage].forward.remote(
            micro_batch, hidden, *labels, self.step)
        self.created.append(output)

    def _backward(self, stage: int, op: ops.LoweredOp) -> None:
        gradient = self.in_flight.pop(("gradient", stage, op.micro_batch), None)
        scale = self.loss_scale if stage == self.last else 1.0
        # B, or the input gradient I of a split backward (its W comes later, in _weight)
        method = self.actors[stage].backward if op.kind == ops.B else self.actors[stage].backward_input
        self.in_flight[("input_gradient", stage, op.micro_batch)] = gradient = method.remote(
            op.micro_batch, gradient, scale)
        self.created.append(gradient)

    def _weight(self, stage: int, op: ops.LoweredOp) -> None:
        self.created.append(self.actors[stage].backward_weight.remote(op.micro_batch))

    def _receive(self, stage: int, op: ops.LoweredOp) -> None:
        # the simulator lists a receive only once its send was posted, so after the op that made the tensor
        sent, received = ("output", "activation") if op.kind == ops.RECV_ACT else ("input_gradient", "gradient")
        self.in_flight[(received, stage, op.micro_batch)] = self.in_flight.pop((sent, op.peer, op.micro_batch))

    def _finish(self, stage: int, _: ops.LoweredOp) -> None:
        # after every op of the stage (tasks of one actor run in order); raises
        # unless all of them ran, so no commit runs after a failed op anywhere
        self.outcomes[stage] = self.actors[stage].finish_backward.remote(1.0 / self.loss_scale, self.clip_value)
