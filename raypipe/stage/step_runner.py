"""The step runner: one worker's whole step, its lowered op list run in order over
a channel to its peers. Written once: the per-step worker runs it over
:class:`~raypipe.comm.p2p.P2PChannel` (torch.distributed, between Ray actors), and
the in-process harness (:mod:`raypipe.testing.op_interpreter`) over an in-memory
channel, so the exactness matrices run the code that trains.

What each compute op does is :class:`~raypipe.stage.worker.StageWorker`'s (forward,
backward, backward_input, backward_weight, the gradient statistics, the commit);
this module says when: receive before a compute op needs a neighbour's tensor, send
after it made one, post an EXCHANGE's sends and receives together (each receive waited
for by the op that uses it, where the channel leaves it so: gloo's), then end the step
as every worker ends it: the replicas of the stage sum their gradients (onto each
gradient's owner with ZeRO-1) while the last sends finish, one all-reduce of every
virtual stage's gradient statistics, the same decision and commit on every worker,
and ZeRO-1's gather of the parameters each owner stepped.

A worker may hold several model chunks: what a chunk makes for a virtual stage that
is this worker's own other chunk (zbv's turn on the last worker) is handed straight
to that chunk's input, as the lowering has no message there.

A step that fails leaves the channel at once (so peers blocked on this worker fail
instead of waiting) and drops its partial state; when the channel had been aborted
(another worker failed first) the failure is named a
:class:`~raypipe.errors.StepAborted`, the consequence, not the cause.
"""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from raypipe.comm.replicas import Owners
from raypipe.comm.step_messages import DeferredReceive
from raypipe.config import PipelineConfig
from raypipe.core import ops
from raypipe.core.result import OpEvent, StageReport
from raypipe.core.schedule import PLACEMENT
from raypipe.core.step_decision import StageGradStats
from raypipe.errors import StepAborted
from raypipe.stage.chunks import Key
from raypipe.stage.worker import StageWorker


class ReplicaChannel(Protocol):
    """A worker's link to the same stage of the other replicas (with one replica every
    method does nothing and the reduction's handle is None)."""

    def start_gradient_reduction(self, gradients: list[torch.Tensor], owners: Owners = None) -> Any:
        """Start summing ``gradients`` over the replicas, onto every replica (``owners`` None)
        or onto each gradient's owner only (ZeRO-1); a handle for the finish, None without replicas."""

    def finish_gradient_reduction(self, pending: Any) -> None:
        """Wait for the reduction ``pending`` and write the sums back in place."""

    def gather_parameters(self, tensors: list[torch.Tensor], owners: Owners) -> None:
        """ZeRO-1, after the owners stepped: every replica's ``tensors`` get their owner's values."""


class StepChannel(Protocol):
    """What the step runner needs of a transport: messages to the other stages of its
    pipeline, each named by its message key (:func:`raypipe.core.ops.message_key`, the same
    on both ends) and its peer stage; the step's small all-reduce; the replicas' link."""

    replicas: ReplicaChannel

    @property
    def aborted(self) -> bool:
        """Whether the step was released from outside (another worker failed)."""

    def expect_activations(self, expected: list[tuple[int, int]]) -> None:
        """The step's activations to come, each a (message key, peer stage): posted ahead where the transport can."""

    def send_activation(self, tensor: Any, key: int, peer: int) -> None:
        """Send an activation (a tensor or a tree of them) to stage ``peer``."""

    def recv_activation(self, key: int, peer: int) -> Any:
        """The activation of message ``key`` from stage ``peer``, once it came."""

    def send_gradient(self, gradient: Any, key: int, peer: int) -> None:
        """Send an input gradient back to stage ``peer``."""

    def recv_gradient(self, key: int, peer: int) -> Any:
        """The gradient of message ``key`` from stage ``peer``, once it came."""

    def exchange(self, sends: list[tuple[ops.LoweredOp, Any]], receives: list[ops.LoweredOp],
                 key_of: Callable[[ops.LoweredOp], int],
                 header_first: Collection[ops.LoweredOp] = ()) -> list[Any]:
        """One EXCHANGE: ``sends`` (each part with its tensor) and ``receives`` posted together; what each
        receive got, or a :class:`~raypipe.comm.step_messages.DeferredReceive` that the op using it waits for."""

    def finish_sends(self) -> None:
        """Wait until every send started has completed."""

    def expect_statistics(self, length: int) -> None:
        """The step's :meth:`all_reduce_sum` of ``length`` numbers to come: its receives posted ahead
        where the transport can."""

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """The element-wise sum of ``values`` over every worker of the run."""

    def leave(self) -> None:
        """Leave the step's group at once: every peer blocked on this worker fails."""

    @property
    def sent_bytes(self) -> int:
        """Payload bytes sent to other stages since the channel was made (activations and gradients)."""


@dataclass
class _Step:
    """One step's tensors in flight on one worker, by (chunk, micro-batch), and its end."""

    number: int
    inputs: list
    targets: list
    weights: list
    loss_scale: float | None
    started: float = field(default_factory=time.time)
    sent_before: int = 0  # the channel's sent bytes when the step started
    stats: list[StageGradStats] = field(default_factory=list)  # every virtual stage's, after the all-reduce
    report: StageReport | None = None
    # received, or handed on by this worker's own previous (next) chunk
    activations: dict[Key, Any] = field(default_factory=dict)
    gradients: dict[Key, Any] = field(default_factory=dict)
    outputs: dict[Key, Any] = field(default_factory=dict)  # to send
    input_gradients: dict[Key, Any] = field(default_factory=dict)  # to send

    def unused(self) -> list[Key]:
        """What the step's ops made or received and never used (a lowering's bug)."""
        return sorted({*self.activations, *self.gradients, *self.outputs, *self.input_gradients})


class StepRunner:
    """Runs ``worker``'s lowered ops of a step (:meth:`~raypipe.stage.spec.WorkerSpec.lowered_ops` of its spec)
    over ``channel``; built once per layout."""

    def __init__(self, worker: StageWorker, channel: StepChannel) -> None:
        spec = worker.spec
        self.worker, self.channel = worker, channel
        self.ops = spec.lowered_ops()
        self.key_of = message_keys(spec.stage, spec.num_stages, spec.num_chunks, PLACEMENT[spec.config.schedule])
        self._expected_activations = [(self.key_of(op), op.peer) for op in ops.unbatch(self.ops)
                                      if op.kind == ops.RECV_ACT]
        # the statistics' receives are posted before the worker first waits for a peer: on the first rank one from
        # every other worker of the run, so not before stage 0's first forward, which every other stage waits for
        self._statistics_posted_before = first_receive(self.ops)
        # each handler takes the op (its micro-batch and chunk; a send's or receive's peer too)
        self._handlers: dict[str, Callable[[ops.LoweredOp, _Step], None]] = {
            ops.RECV_ACT: self._recv_activation, ops.F: self._forward, ops.SEND_ACT: self._send_activation,
            ops.RECV_GRAD: self._recv_gradient, ops.B: self._backward, ops.SEND_GRAD: self._send_gradient,
            ops.EXCHANGE: self._exchange, ops.I: self._backward_input, ops.W: self._backward_weight,
            ops.REDUCE_GRAD: self._reduce, ops.OPTIMIZER_STEP: self._commit}

    def run(self, step: int, inputs: list | None, targets: list | None, weights: list | None,
            loss_scale: float | None = None, before_op: Callable[[int], None] | None = None) -> StageReport:
        """The worker's whole step ``step`` on its block of micro-batches (``inputs``,
        ``targets`` and loss ``weights`` per micro-batch, None where the worker reads its
        own or needs none); ``before_op(index)`` runs before op number ``index`` (the
        per-step worker's gates). The report of the commit.

        On any failure the worker leaves the channel first, releasing its peers (and
        failing their reduction, so no stage steps), and drops the step's state."""
        none = [None] * len(self.worker.block)
        state = _Step(step, inputs or none, targets or none, weights or none, loss_scale,
                      sent_before=self.channel.sent_bytes)
        try:
            self.channel.expect_activations(self._expected_activations)
            with self.worker.step_scope():  # with tensor parallelism, the loss's stage: vocabulary-parallel loss
                for index, op in enumerate(self.ops):
                    if index == self._statistics_posted_before:
                        self.channel.expect_statistics(_statistics_length(self.worker.config))
                    if before_op is not None:
                        before_op(index)
                    self._handlers[op.kind](op, state)
        except BaseException as error:
            aborted = self.channel.aborted
            self._leave_failed_step(error)
            if aborted and not isinstance(error, StepAborted):  # e.g. an operation on the group being aborted
                worker = self.worker
                raise StepAborted(worker.stage_index, "step", None, f"the step was aborted ({error})",
                                  replica=worker.named_replica) from None
            raise
        return state.report

    def _leave_failed_step(self, error: BaseException) -> None:
        """Leave now, so that peers blocked on this worker fail at once, and drop the step.

        Every pending operation holds the group's connections open: the channel's own,
        and any in the frames of the error's traceback (cleared: only the error's text
        travels)."""
        for failure in (error, error.__cause__):
            if failure is not None and failure.__traceback__ is not None:
                traceback.clear_frames(failure.__traceback__)
        self.channel.leave()
        self.worker.abort_step()

    def _timed_receive(self, receives: list[ops.LoweredOp], start: float) -> None:
        """The timeline's "recv" events of ``receives``, waited for since ``start``."""
        worker, end = self.worker, time.time()
        for op in receives:
            worker.add_event(OpEvent(worker.stage_index, "recv", op.micro_batch, start, end, worker.replica, op.chunk,
                                     worker.spec.tp_rank))

    def _recv_activation(self, op: ops.LoweredOp, state: _Step) -> None:
        start = time.time()
        state.activations[op.chunk, op.micro_batch] = self.channel.recv_activation(self.key_of(op), op.peer)
        self._timed_receive([op], start)

    def _taken(self, op: ops.LoweredOp, received: Any) -> Any:
        """What ``op`` uses, received for it: a receive an exchange left to this op is waited for now."""
        if not isinstance(received, DeferredReceive):
            return received
        start = time.time()
        value = received.result()
        self._timed_receive([op], start)
        return value

    def _forward(self, op: ops.LoweredOp, state: _Step) -> None:
        worker, chunk, micro_batch = self.worker, op.chunk, op.micro_batch
        hidden = (state.inputs[micro_batch] if worker.chunks.is_first(chunk)
                  else self._taken(op, state.activations.pop((chunk, micro_batch))))
        output = worker.forward(micro_batch, hidden, state.targets[micro_batch], state.weights[micro_batch],
                                state.number, chunk, read_loss=False)  # the loss is read once, with the norm
        if chunk != worker.chunks.last:
            self._hand_on(op, ops.SEND_ACT, output, state)

    def _send_activation(self, op: ops.LoweredOp, state: _Step) -> None:
        self.channel.send_activation(state.outputs.pop((op.chunk, op.micro_batch)), self.key_of(op), op.peer)

    def _recv_gradient(self, op: ops.LoweredOp, state: _Step) -> None:
        start = time.time()
        state.gradients[op.chunk, op.micro_batch] = self.channel.recv_gradient(self.key_of(op), op.peer)
        self._timed_receive([op], start)

    def _backward(self, op: ops.LoweredOp, state: _Step) -> None:
        self._backpropagate(op, state, self.worker.backward)

    def _backward_input(self, op: ops.LoweredOp, state: _Step) -> None:
        self._backpropagate(op, state, self.worker.backward_input)

    def _backpropagate(self, op: ops.LoweredOp, state: _Step, backward: Callable) -> None:
        """B or I of one micro-batch on one chunk: its input gradient goes to the previous virtual stage."""
        chunks, chunk, micro_batch = self.worker.chunks, op.chunk, op.micro_batch
        gradient = self._taken(op, state.gradients.pop((chunk, micro_batch), None))  # none on the last: the loss's
        scale = state.loss_scale if chunk == chunks.last and state.loss_scale is not None else 1.0
        input_gradient = backward(micro_batch, gradient, scale, chunk)
        if not chunks.is_first(chunk):  # the model's first virtual stage has no input gradient to send
            self._hand_on(op, ops.SEND_GRAD, input_gradient, state)

    def _backward_weight(self, op: ops.LoweredOp, _: _Step) -> None:
        self.worker.backward_weight(op.micro_batch, op.chunk)

    def _hand_on(self, op: ops.LoweredOp, kind: str, tensor: Any, state: _Step) -> None:
        """What a compute op made for the next (SEND_ACT) or previous (SEND_GRAD) virtual stage: kept to
        send, or, where that stage is this worker's own other chunk (the lowering has no message
        there: zbv's turn on the last worker), handed straight to its input."""
        worker, config = self.worker, self.worker.config
        peer, peer_chunk = ops.neighbour(worker.stage_index, op.chunk, kind, worker.num_stages,
                                         config.virtual_stages, config.placement)
        if peer == worker.stage_index:
            (state.activations if kind == ops.SEND_ACT else state.gradients)[peer_chunk, op.micro_batch] = tensor
        else:
            (state.outputs if kind == ops.SEND_ACT else state.input_gradients)[op.chunk, op.micro_batch] = tensor

    def _send_gradient(self, op: ops.LoweredOp, state: _Step) -> None:
        self.channel.send_gradient(state.input_gradients.pop((op.chunk, op.micro_batch)), self.key_of(op), op.peer)

    def _exchange(self, op: ops.LoweredOp, state: _Step) -> None:
        # sends and the receives behind them, posted together: one by one, NCCL's rendezvous would deadlock them
        start = time.time()
        outgoing = {ops.SEND_ACT: state.outputs, ops.SEND_GRAD: state.input_gradients}
        incoming = {ops.RECV_ACT: state.activations, ops.RECV_GRAD: state.gradients}
        sends = [(part, outgoing[part.kind].pop((part.chunk, part.micro_batch)))
                 for part in op.parts if part.kind in ops.SENDS]
        receives = [part for part in op.parts if part.kind in ops.RECEIVES]
        received = self.channel.exchange(sends, receives, self.key_of, op.header_first)
        for part, tensor in zip(receives, received):
            incoming[part.kind][part.chunk, part.micro_batch] = tensor
        # a receive left to the op that uses it is timed there (_taken): here only those waited for
        self._timed_receive([part for part, tensor in zip(receives, received)
                             if not isinstance(tensor, DeferredReceive)], start)

    def _reduce(self, _: ops.LoweredOp, state: _Step) -> None:
        worker, channel, config = self.worker, self.channel, self.worker.config
        unused = state.unused()
        if unused:
            raise RuntimeError(f"stage {worker.stage_index}: the step's ops left (chunk, micro-batch) {unused} "
                               "made or received and never used")
        # the replicas' gradients are summed (the loss weights are global) while the last sends finish
        start = time.time()
        reduction = channel.replicas.start_gradient_reduction(*worker.gradients_to_reduce())
        channel.finish_sends()
        channel.replicas.finish_gradient_reduction(reduction)
        if reduction is not None:
            worker.add_event(OpEvent(worker.stage_index, "reduce", None, start, time.time(), worker.replica,
                                     tp_rank=worker.spec.tp_rank))
        scale = 1.0 if state.loss_scale is None else state.loss_scale
        count = config.num_virtual_stages  # the decision is over virtual stages (one a worker without chunks)
        slots = [0.0] * _statistics_length(config)  # every one's squared norm, overflow flag and loss share
        for chunk, own in enumerate(worker.chunk_grad_stats(1.0 / scale, config.clip_grad_value)):
            me = ops.virtual_stage(worker.stage_index, chunk, worker.num_stages, config.placement)
            if worker.ownership.counts_in_norm():  # each owner's part, or one replica's whole (all hold the same)
                slots[me] = own.squared_norm
            slots[count + me], slots[2 * count + me] = float(own.found_inf), own.loss or 0.0
        reduced = channel.all_reduce_sum(slots)
        state.stats = [StageGradStats(reduced[s], reduced[count + s] > 0, reduced[2 * count + s] if s == count - 1
                                      else None) for s in range(count)]

    def _commit(self, _: ops.LoweredOp, state: _Step) -> None:
        state.report = self.worker.commit(state.loss_scale is not None, *state.stats,
                                          share_parameters=self.channel.replicas.gather_parameters)
        # the driver's overhead is a step's wall time minus the longest of these
        state.report.stats.task_seconds = time.time() - state.started
        state.report.stats.sent_bytes = self.channel.sent_bytes - state.sent_before


def _statistics_length(config: PipelineConfig) -> int:
    """How many numbers each worker adds in a step's statistics all-reduce: every virtual stage's
    squared gradient norm, overflow flag and loss share (zero where not its own)."""
    return 3 * config.num_virtual_stages


def first_receive(stage_ops: list[ops.LoweredOp]) -> int:
    """The index of the first of a worker's lowered ``stage_ops`` that waits for a peer (a receive,
    alone or in an exchange: stage 0's first gradient, the others' first activation); 0 with none
    (a lone stage never waits)."""
    receives = (index for index, op in enumerate(stage_ops)
                if any(part.kind in ops.RECEIVES for part in op.unbatched()))
    return next(receives, 0)


def message_keys(stage: int, num_stages: int, num_chunks: int,
                 placement: str) -> Callable[[ops.LoweredOp], int]:
    """The message key (:func:`raypipe.core.ops.message_key`) of each SEND/RECV op of worker
    ``stage``: the one its peer computes for the other end of the message."""
    def key_of(op: ops.LoweredOp) -> int:
        boundary = ops.boundary_of(stage, op.chunk, op.kind, num_stages, placement)
        return ops.message_key(op.micro_batch, boundary, num_stages * num_chunks)

    return key_of
