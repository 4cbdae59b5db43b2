"""The worker side of the per-step executor: a stage runs its whole lowered op
list of one step in one Ray task, sending straight to its peers (each send and
receive names its peer stage; its message key comes from
:func:`raypipe.core.ops.message_key`). The loop itself is the step runner's
(:class:`~raypipe.stage.step_runner.StepRunner`, over a
:class:`~raypipe.comm.p2p.P2PChannel`); this actor adds what only Ray needs: joining,
leaving and aborting the group, and the gates that order a step after the driver's
calls.

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

import functools
import logging
import math
import time
from collections.abc import Callable

import ray
import torch

from raypipe.comm.call_socket import AnswersCalls
from raypipe.comm.p2p import P2PChannel
from raypipe.comm.rendezvous import Rendezvous, open_rendezvous
from raypipe.core import ops
from raypipe.core.result import OpEvent, StageReport
from raypipe.errors import RaypipeError
from raypipe.stage.concurrency_groups import HEALTH_GROUP
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.step_gate import StepGate
from raypipe.stage.step_runner import StepRunner, first_receive
from raypipe.stage.worker import StageWorker

logger = logging.getLogger("raypipe")


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
        self._abandoned_group = -1  # the newest group the driver gave up forming or running (abort_communication)

    def take_layout(self, spec: WorkerSpec) -> None:
        """The layout's ops and place in the group (joined by :meth:`join_group`, after
        leaving the old group)."""
        super().take_layout(spec)
        self._channel = P2PChannel(self.topology, spec.replica, spec.stage, self.device, spec.num_chunks,
                                   boundary_shapes=spec.config.boundary_shapes, tp_rank=spec.tp_rank)
        self._runner = StepRunner(self, self._channel)
        stage_ops = self._runner.ops
        # the first op that changes what a snapshot or checkpoint copies: the commit, or a forward
        # when the layers save buffers (a forward may update them, e.g. running statistics); a
        # buffer left out of the state dict (LLaMA's RoPE tables) is not copied, so it holds no step
        changes_state = ops.F if _saves_buffers(self.layers) else ops.OPTIMIZER_STEP
        self._gated_op = next(index for index, op in enumerate(stage_ops) if op.kind == changes_state)
        self._first_wait_op = first_wait(stage_ops, self._gated_op)

    def serve_calls(self, method: str, authkey: bytes, previous_end_s: float = 30.0, *,
                    on_end: Callable[[], None] = lambda: None) -> tuple[str, int]:
        """:meth:`AnswersCalls.serve_calls`; a snapshot waits for this connection's steps
        only while it is open (once it closes, no step comes to let it go)."""
        first_waits = self._first_waits = StepGate()

        def ended() -> None:
            first_waits.open(math.inf)
            on_end()

        return super().serve_calls(method, authkey, previous_end_s, on_end=ended)

    @ray.method(num_returns=2)
    def snapshot_at_first_wait(self, count: int) -> tuple[dict, bool]:
        """:meth:`snapshot`, taken once the step that follows gate call number ``count``
        first waits for a neighbour (or ends): the copy runs while this stage would
        idle in the pipeline's bubble, instead of beside its first forward. It is gate
        call ``count`` itself: the step's commit waits for it, and it opens the gate as
        soon as the state is copied (before the copy is shipped), so the driver sends no
        second call to open it (:mod:`raypipe.stage.step_gate`).

        Returns the snapshot and True: the driver reads the small second result to learn
        that the first is stored (the step may have committed before), without fetching
        it (:class:`~raypipe.executor.base.SnapshotTasks`)."""
        try:
            try:
                self._first_waits.wait(count, self.config.p2p_timeout_s)
            except RaypipeError:  # no step came: the state is still the one to snapshot
                logger.warning("raypipe: stage %d's next step did not start within %gs; snapshotting now",
                               self.stage_index, self.config.p2p_timeout_s)
            return self.snapshot(copied=functools.partial(self._step_gate.open, count)), True
        finally:  # a snapshot that failed lets the step go too: its error is this call's result
            self._step_gate.open(count)

    def rendezvous_address(self) -> tuple[str, int]:
        """Where the other stages meet this one (called on the group's rank 0): the group's store,
        opened here now and held until this worker joins it."""
        self._rendezvous: Rendezvous | None = open_rendezvous(self.config.p2p_timeout_s)
        return self._rendezvous.address, self._rendezvous.port

    def join_group(self, address: str, port: int, timeout_s: float, emulate_nccl: bool = False,
                   group: int = 0) -> None:
        """Join the group, the driver's ``group``-th (``emulate_nccl``: on gloo under
        NCCL's rules, as the driver was asked, :func:`raypipe.comm.nccl_emulation.requested`).

        With tensor parallelism the stage's layers are split over the new group's tensor-parallel
        mesh at every join (the first split, or the state moved onto the new mesh after the groups
        re-formed: :meth:`~raypipe.stage.worker.StageWorker.tensor_parallelize`).

        Until every rank has come, :meth:`abort_communication` for ``group`` (the driver found a
        peer lost meanwhile) ends the join at once (a :class:`~raypipe.errors.RaypipeError`), as
        it ends a step: the worker is free for the heal's next call, not held in the rendezvous
        until ``timeout_s``."""
        self._group_joined = None  # an abort for the group left must not reach the one joined next
        rendezvous, self._rendezvous = getattr(self, "_rendezvous", None), None
        held = rendezvous is not None and (rendezvous.address, rendezvous.port) == (address, port)
        self._channel.join(address, port, timeout_s, emulate_nccl, rendezvous.take_store() if held else None,
                           abandoned=lambda: self._abandoned_group >= group)
        if self._channel.tensor_mesh is not None:
            self.tensor_parallelize(self._channel.tensor_mesh)
        self._group_joined = group

    @ray.method(concurrency_group=HEALTH_GROUP)
    def abort_communication(self, group: int) -> None:
        """Release this worker's step if it waits on a peer, on the health thread (so
        it runs while the step blocks): a step of another worker failed. The step
        raises :class:`~raypipe.errors.StepAborted`; the group is joined afresh after.
        Only while in the driver's ``group``-th group: a call that comes after the
        next one was formed is for the group left. While the worker joins the ``group``-th, it
        ends the join (the abort may come before the join does: it is kept)."""
        self._abandoned_group = max(self._abandoned_group, group)
        channel = getattr(self, "_channel", None)
        if channel is not None and getattr(self, "_group_joined", None) == group:
            channel.abort()

    def leave_group(self) -> None:
        self._channel.leave()

    def run_step(self, step: int, inputs: list | None, targets: list | None, weights: list | None,
                 loss_scale: float | None = None, dynamic_keys: tuple[int, ...] = (),
                 gate: int | None = None) -> StageReport:
        """This stage's whole step (:class:`~raypipe.stage.step_runner.StepRunner` over the
        group): its ops, one all-reduce of every stage's gradient statistics, then the same
        decision as every other stage (step or skip). ``dynamic_keys``: the message keys
        that keep headers (every worker gets the run's whole set with each step: a key marked
        after a :class:`~raypipe.errors.BoundaryShapeChanged` reaches both of its ends before
        the retried step). ``gate``: the step's first op that
        changes saved state waits for the gate's calls (see :mod:`raypipe.stage.step_gate`)
        up to that number.

        On any failure this worker leaves the group first, releasing its
        neighbours (and failing their reduction, so no stage steps).
        """
        def pass_gates(index: int) -> None:
            if index == self._first_wait_op:
                self._first_waits.open(gate)
            if index == self._gated_op:
                self._pass_gate(gate)

        try:
            if dynamic_keys:
                self._channel.mark_dynamic(dynamic_keys)
            return self._runner.run(step, inputs, targets, weights, loss_scale,
                                    before_op=None if gate is None else pass_gates)
        finally:
            if gate is not None:  # a step that failed before its first wait lets its snapshot go too
                self._first_waits.open(gate)

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
            self.add_event(OpEvent(self.stage_index, "gate", None, start, time.time(), self.replica,
                                   tp_rank=self.spec.tp_rank))


def first_wait(stage_ops: list[ops.LoweredOp], gated_op: int) -> int:
    """The index of the op before which a stage first waits for a neighbour (its first
    receive, alone or in an exchange: :func:`~raypipe.stage.step_runner.first_receive`), and no
    later than ``gated_op`` (which waits for the snapshot)."""
    return min(first_receive(stage_ops), gated_op)


def _saves_buffers(layers: torch.nn.Module) -> bool:
    """Whether ``layers``' state dict holds any buffer (a persistent one)."""
    saved = layers.state_dict(keep_vars=True).keys()
    return any(name in saved for name, _ in layers.named_buffers())
