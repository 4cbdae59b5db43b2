"""The worker side of the per-step executor: a stage runs its whole lowered op
list of one step in one Ray task, sending straight to its peers (each send and
receive names its peer stage; its message key comes from
:func:`raypipe.core.ops.message_key`).

One task per stage per step instead of one per op, and no hop through the
object store: the per-op overhead that shows with small micro-batches goes.
A stage whose step fails leaves the group at once (closing its connections),
so on gloo a neighbour blocked on it fails immediately with
:class:`~raypipe.errors.StepAborted` and leaves in turn: the whole group stops
within milliseconds instead of waiting ``p2p_timeout_s``. NCCL (and its
emulation) releases no one that way: the driver calls every survivor's
:meth:`PerStepWorker.abort_communication`, which runs on the worker's health
thread while the step is blocked (:meth:`~raypipe.comm.p2p.P2PChannel.abort`).
"""
from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from raypipe.comm.call_socket import AnswersCalls
from raypipe.comm.p2p import P2PChannel
from raypipe.comm.rendezvous import rendezvous_address
from raypipe.core import lowering, ops
from raypipe.core.result import OpEvent, StageReport
from raypipe.core.schedule import PLACEMENT, make_schedule
from raypipe.core.step_decision import StageGradStats
from raypipe.errors import RaypipeError, StepAborted
from raypipe.stage.chunks import Key
from raypipe.stage.concurrency_groups import HEALTH_GROUP
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.step_gate import StepGate
from raypipe.stage.worker import StageWorker

logger = logging.getLogger("raypipe")

@dataclass
class _StepState:
    """What flows between the ops of one step on one stage."""

    step: int
    inputs: list
    targets: list
    weights: list
    loss_scale: float | None
    started: float = field(default_factory=time.time)
    stats: list[StageGradStats] = field(default_factory=list)  # every stage's, after the reduction
    report: StageReport | None = None
    # by (chunk, micro-batch): received, or handed on by this worker's own previous (next) chunk
    activations: dict[Key, torch.Tensor] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # to send
    gradients: dict[Key, torch.Tensor] = field(default_factory=dict)
    input_gradients: dict[Key, torch.Tensor | None] = field(default_factory=dict)  # to send


class PerStepWorker(StageWorker, AnswersCalls):
    """A StageWorker that runs a whole step's lowered ops with direct sends; its
    steps come as actor tasks or over the driver's connection (:meth:`run_step_returning_failure`)."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self._step_gate = StepGate()
        # how far the driver connection's steps have got to their first wait (see snapshot_at_first_wait);
        # with no connection no step comes, so nothing waits
        self._first_waits = StepGate()
        self._first_waits.open(math.inf)
        # each handler takes the op (its micro-batch and chunk; a send's or receive's peer too)
        self._handlers = {ops.RECV_ACT: self._recv_activation, ops.F: self._forward,
                          ops.SEND_ACT: self._send_activation, ops.RECV_GRAD: self._recv_gradient,
                          ops.B: self._backward, ops.SEND_GRAD: self._send_gradient, ops.EXCHANGE: self._exchange,
                          ops.I: self._backward_input, ops.W: self._backward_weight,
                          ops.REDUCE_GRAD: self._reduce, ops.OPTIMIZER_STEP: self._commit}

    def take_layout(self, spec: WorkerSpec) -> None:
        """The layout's ops and place in the group (joined by :meth:`join_group`, after
        leaving the old group)."""
        super().take_layout(spec)
        self._ops = lowered_stage_ops(spec)
        num_chunks = spec.num_chunks
        self._message_key = message_keys(spec.stage, spec.num_stages, num_chunks, PLACEMENT[spec.config.schedule])
        self._expected_activations = [(self._message_key(op), op.peer) for op in ops.unbatch(self._ops)
                                      if op.kind == ops.RECV_ACT]
        # the first op that changes what a snapshot or checkpoint copies: the commit, or a forward
        # when the layers save buffers (a forward may update them, e.g. running statistics); a
        # buffer left out of the state dict (LLaMA's RoPE tables) is not copied, so it holds no step
        changes_state = ops.F if _saves_buffers(self.layers) else ops.OPTIMIZER_STEP
        self._gated_op = next(index for index, op in enumerate(self._ops) if op.kind == changes_state)
        self._first_wait_op = first_wait(self._ops, self._gated_op)
        self._channel = P2PChannel(self.topology, spec.replica, spec.stage, self.device, num_chunks)

    def serve_calls(self, method: str, authkey: bytes, previous_end_s: float = 30.0, *,
                    on_end: Callable[[], None] = lambda: None) -> tuple[str, int]:
        """:meth:`AnswersCalls.serve_calls`; a snapshot waits for this connection's steps
        only while it is open (once it closes, no step comes to let it go)."""
        first_waits = self._first_waits = StepGate()

        def ended() -> None:
            first_waits.open(math.inf)
            on_end()

        return super().serve_calls(method, authkey, previous_end_s, on_end=ended)

    def snapshot_at_first_wait(self, count: int) -> dict:
        """:meth:`snapshot`, taken once the step that follows gate call number ``count``
        first waits for a neighbour (or ends): the copy runs while this stage would
        idle in the pipeline's bubble, instead of beside its first forward. The step's
        commit still waits for it (:mod:`raypipe.stage.step_gate`)."""
        try:
            self._first_waits.wait(count, self.config.p2p_timeout_s)
        except RaypipeError:  # no step came: the state is still the one to snapshot
            logger.warning("raypipe: stage %d's next step did not start within %gs; snapshotting now",
                           self.stage_index, self.config.p2p_timeout_s)
        return self.snapshot()

    def rendezvous_address(self) -> tuple[str, int]:
        """Where the other stages meet this one (called on stage 0)."""
        return rendezvous_address()

    def join_group(self, address: str, port: int, timeout_s: float, emulate_nccl: bool = False,
                   group: int = 0) -> None:
        """Join the group, the driver's ``group``-th (``emulate_nccl``: on gloo under
        NCCL's rules, as the driver was asked, :func:`raypipe.comm.nccl_emulation.requested`)."""
        self._group_joined = None  # an abort that comes while joining is for the group left
        self._channel.join(address, port, timeout_s, emulate_nccl)
        self._group_joined = group

    @ray.method(concurrency_group=HEALTH_GROUP)
    def abort_communication(self, group: int) -> None:
        """Release this worker's step if it waits on a peer, on the health thread (so
        it runs while the step blocks): a step of another worker failed. The step
        raises :class:`~raypipe.errors.StepAborted`; the group is joined afresh after.
        Only while in the driver's ``group``-th group: a call that comes after the
        next one was formed is for the group left."""
        channel = getattr(self, "_channel", None)
        if channel is not None and getattr(self, "_group_joined", None) == group:
            channel.abort()

    def leave_group(self) -> None:
        self._channel.leave()

    def run_step(self, step: int, inputs: list | None, targets: list | None, weights: list | None,
                 loss_scale: float | None = None, gate: int | None = None) -> StageReport:
        """This stage's whole step: its ops, one all-reduce of every stage's gradient
        statistics, then the same decision as every other stage (step or skip).
        ``gate``: the step's first op that changes saved state waits for the gate's
        calls (see :mod:`raypipe.stage.step_gate`) up to that number.

        On any failure this worker leaves the group first, releasing its
        neighbours (and failing their reduction, so no stage steps).
        """
        none = [None] * len(self.block)
        state = _StepState(step, inputs or none, targets or none, weights or none, loss_scale)
        try:
            self._channel.expect_activations(self._expected_activations)
            for index, op in enumerate(self._ops):
                if index == self._first_wait_op and gate is not None:
                    self._first_waits.open(gate)
                if index == self._gated_op and gate is not None:
                    self._pass_gate(gate)
                self._handlers[op.kind](op, state)
        except BaseException as error:
            aborted = self._channel.aborted
            self._leave_failed_step(error)
            if aborted and not isinstance(error, StepAborted):  # e.g. an operation on the group being aborted
                raise StepAborted(self.stage_index, "step", None, f"the step was aborted ({error})",
                                  replica=self.replica if self.topology.num_replicas > 1 else None) from None
            raise
        finally:
            if gate is not None:  # a step that failed before its first wait lets its snapshot go too
                self._first_waits.open(gate)
        return state.report

    def open_step_gate(self, count: int) -> None:
        """Let a direct call's step that follows call number ``count`` start (see
        :mod:`raypipe.stage.step_gate`)."""
        self._step_gate.open(count)

    def run_step_returning_failure(self, gated_arguments: tuple[int, tuple]) -> StageReport | Exception:
        """:meth:`run_step` for a direct call (``gated_arguments``: the number of
        the gate calls it must follow, and ``run_step``'s arguments). A failure is
        returned, not raised: the connection carries values, and each worker's own
        failure reaches the driver, which picks the cause (not a neighbour's
        :class:`~raypipe.errors.StepAborted`)."""
        after, arguments = gated_arguments
        try:
            return self.run_step(*arguments, gate=after)
        except Exception as error:  # noqa: BLE001 - every failure is the driver's to read
            return error

    def _pass_gate(self, count: int) -> None:
        """Wait for the calls this step must follow; a wait shows in the timeline as "gate"."""
        start = time.time()
        if self._step_gate.wait(count, self.config.p2p_timeout_s):
            self._events.append(OpEvent(self.stage_index, "gate", None, start, time.time(), self.replica))

    def _recv_activation(self, op: ops.LoweredOp, state: _StepState) -> None:
        start = time.time()
        state.activations[op.chunk, op.micro_batch] = self._channel.recv_activation(self._message_key(op), op.peer)
        self._events.append(OpEvent(self.stage_index, "recv", op.micro_batch, start, time.time(), self.replica,
                                    op.chunk))

    def _forward(self, op: ops.LoweredOp, state: _StepState) -> None:
        chunk, micro_batch = op.chunk, op.micro_batch
        hidden = (state.inputs[micro_batch] if self.chunks.is_first(chunk)
                  else state.activations.pop((chunk, micro_batch)))
        output = self.forward(micro_batch, hidden, state.targets[micro_batch], state.weights[micro_batch],
                              state.step, chunk, read_loss=False)  # the loss is read once, with the norm
        if chunk != self.chunks.last:
            self._hand_on(op, ops.SEND_ACT, output, state)

    def _send_activation(self, op: ops.LoweredOp, state: _StepState) -> None:
        self._channel.send_activation(state.outputs.pop((op.chunk, op.micro_batch)), self._message_key(op), op.peer)

    def _recv_gradient(self, op: ops.LoweredOp, state: _StepState) -> None:
        start = time.time()
        state.gradients[op.chunk, op.micro_batch] = self._channel.recv_gradient(self._message_key(op), op.peer)
        self._events.append(OpEvent(self.stage_index, "recv", op.micro_batch, start, time.time(), self.replica,
                                    op.chunk))

    def _backward(self, op: ops.LoweredOp, state: _StepState) -> None:
        self._backpropagate(op, state, self.backward)

    def _backward_input(self, op: ops.LoweredOp, state: _StepState) -> None:
        self._backpropagate(op, state, self.backward_input)

    def _backpropagate(self, op: ops.LoweredOp, state: _StepState, backward: Callable) -> None:
        """B or I of one micro-batch on one chunk: its input gradient goes to the previous virtual stage."""
        chunk, micro_batch = op.chunk, op.micro_batch
        gradient = state.gradients.pop((chunk, micro_batch), None)
        scale = state.loss_scale if chunk == self.chunks.last and state.loss_scale is not None else 1.0
        input_gradient = backward(micro_batch, gradient, scale, chunk)
        if not self.chunks.is_first(chunk):
            self._hand_on(op, ops.SEND_GRAD, input_gradient, state)

    def _backward_weight(self, op: ops.LoweredOp, _: _StepState) -> None:
        self.backward_weight(op.micro_batch, op.chunk)

    def _hand_on(self, op: ops.LoweredOp, kind: str, tensor: Any, state: _StepState) -> None:
        """What a compute op made for the next (SEND_ACT) or previous (SEND_GRAD) virtual stage: kept to
        send, or, where that stage is this worker's own other chunk (the lowering has no message
        there: zbv's turn on the last worker), handed straight to its input."""
        config = self.config
        peer, peer_chunk = ops.neighbour(self.stage_index, op.chunk, kind, self.num_stages, config.virtual_stages,
                                         config.placement)
        if peer == self.stage_index:
            (state.activations if kind == ops.SEND_ACT else state.gradients)[peer_chunk, op.micro_batch] = tensor
        else:
            (state.outputs if kind == ops.SEND_ACT else state.input_gradients)[op.chunk, op.micro_batch] = tensor

    def _send_gradient(self, op: ops.LoweredOp, state: _StepState) -> None:
        self._channel.send_gradient(state.input_gradients.pop((op.chunk, op.micro_batch)), self._message_key(op),
                                    op.peer)

    def _exchange(self, op: ops.LoweredOp, state: _StepState) -> None:
        # sends and the receives behind them, posted together: one by one, NCCL's rendezvous would deadlock them
        start = time.time()
        outgoing = {ops.SEND_ACT: state.outputs, ops.SEND_GRAD: state.input_gradients}
        incoming = {ops.RECV_ACT: state.activations, ops.RECV_GRAD: state.gradients}
        sends = [(part, outgoing[part.kind].pop((part.chunk, part.micro_batch)))
                 for part in op.parts if part.kind in ops.SENDS]
        receives = [part for part in op.parts if part.kind in ops.RECEIVES]
        received = self._channel.exchange(sends, receives, self._message_key, op.header_first)
        end = time.time()
        for part, tensor in zip(receives, received):
            incoming[part.kind][part.chunk, part.micro_batch] = tensor
            self._events.append(OpEvent(self.stage_index, "recv", part.micro_batch, start, end, self.replica,
                                        part.chunk))

    def _reduce(self, _: ops.LoweredOp, state: _StepState) -> None:
        # the replicas' gradients are summed (the loss weights are global) while the last sends finish
        start = time.time()
        reduction = self._channel.replicas.start_gradient_reduction(*self.gradients_to_reduce())
        self._channel.finish_sends()
        self._channel.replicas.finish_gradient_reduction(reduction)
        if reduction is not None:
            self._events.append(OpEvent(self.stage_index, "reduce", None, start, time.time(), self.replica))
        scale = 1.0 if state.loss_scale is None else state.loss_scale
        config = self.config
        count = config.num_virtual_stages  # the decision is over virtual stages (one a worker without chunks)
        slots = [0.0] * (3 * count)  # every one's squared norm, overflow flag and loss share, over all workers
        for chunk, own in enumerate(self.chunk_grad_stats(1.0 / scale, config.clip_grad_value)):
            me = ops.virtual_stage(self.stage_index, chunk, self.num_stages, config.placement)
            if self.ownership.counts_in_norm():  # each owner's part, or one replica's whole (all hold the same)
                slots[me] = own.squared_norm
            slots[count + me], slots[2 * count + me] = float(own.found_inf), own.loss or 0.0
        reduced = self._channel.all_reduce_sum(slots)
        state.stats = [StageGradStats(reduced[s], reduced[count + s] > 0, reduced[2 * count + s] if s == count - 1
                                      else None) for s in range(count)]

    def _share_updated_parameters(self) -> None:
        self._channel.replicas.gather_parameters(self._compute_weights, self.ownership.owners)

    def _commit(self, _: ops.LoweredOp, state: _StepState) -> None:
        state.report = self.commit(state.loss_scale is not None, *state.stats)
        # the driver's overhead is a step's wall time minus the longest of these
        state.report.stats.task_seconds = time.time() - state.started

    def _leave_failed_step(self, error: BaseException) -> None:
        """Leave the group now, so that neighbours blocked on this stage fail at once.

        Every pending operation holds the group's connections open: the channel's
        own, and any in the frames of the error's traceback (cleared: only the
        error's text travels).
        """
        for failure in (error, error.__cause__):
            if failure is not None and failure.__traceback__ is not None:
                traceback.clear_frames(failure.__traceback__)
        self._channel.leave()
        self.abort_step()


def lowered_stage_ops(spec: WorkerSpec) -> list[ops.LoweredOp]:
    """Worker ``spec.stage``'s lowered ops of a step. A split backward (I, W) places each
    receive after its peer's send, so the whole schedule is lowered (alike on every worker)."""
    stage_ops = spec.stage_ops()
    if spec.num_chunks == 1 and not any(op.kind in (ops.I, ops.W) for op in stage_ops):
        return lowering.lower_stage(spec.stage, stage_ops, spec.num_stages)
    schedule = make_schedule(spec.config.schedule, spec.num_stages, len(spec.block), spec.num_chunks)
    if tuple(schedule[spec.stage]) != tuple(stage_ops):
        raise ValueError(f"stage {spec.stage}: its ops are not those of schedule {spec.config.schedule!r}, "
                         "which the other workers lower")
    return lowering.lower(schedule, PLACEMENT[spec.config.schedule])[spec.stage]


def message_keys(stage: int, num_stages: int, num_chunks: int,
                 placement: str) -> Callable[[ops.LoweredOp], int]:
    """The message key (:func:`raypipe.core.ops.message_key`) of each SEND/RECV op of worker
    ``stage``: the one its peer computes for the other end of the message."""
    def key_of(op: ops.LoweredOp) -> int:
        boundary = ops.boundary_of(stage, op.chunk, op.kind, num_stages, placement)
        return ops.message_key(op.micro_batch, boundary, num_stages * num_chunks)

    return key_of


def first_wait(stage_ops: list[ops.LoweredOp], gated_op: int) -> int:
    """The index of the op before which a stage first waits for a neighbour (its first
    receive, alone or in an exchange: stage 0's first gradient, the others' first activation),
    and no later than ``gated_op`` (which waits for the snapshot); 0 with no receive (a lone
    stage never idles)."""
    receives = (index for index, op in enumerate(stage_ops)
                if any(part.kind in ops.RECEIVES for part in op.unbatched()))
    return min(next(receives, 0), gated_op)


def _saves_buffers(layers: torch.nn.Module) -> bool:
    """Whether ``layers``' state dict holds any buffer (a persistent one)."""
    saved = layers.state_dict(keep_vars=True).keys()
    return any(name in saved for name, _ in layers.named_buffers())
