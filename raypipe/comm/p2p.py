"""Point-to-point sends between the stages of a pipeline over ``torch.distributed``
(gloo on CPU, NCCL on GPU): the per-step executor's transport.

Every message goes to, or comes from, a peer stage that the caller names (a lowered
op's ``peer``, :mod:`raypipe.core.lowering`), not just the next or previous stage:
with several model chunks per worker the looped placement sends from the last worker
back to the first, and one pair of workers may carry activations both ways. A
message is named by a key that the caller gives (:func:`raypipe.core.ops.message_key`:
the micro-batch and the boundary between virtual stages it crosses), the same on both
ends, so one micro-batch's activations across different chunk boundaries between the
same two workers stay apart; an activation and the gradient sent back for it share
their key. Peer stages become ranks through :meth:`~raypipe.core.topology.Topology.rank`
(tensor-parallel rank i of a stage talks to tensor-parallel rank i of its neighbours).

An activation travels as a fixed-size header (its dtype and shape,
:mod:`raypipe.comm.headers`) and a payload, so micro-batches of any shape flow without
a fixed-shape agreement; a tree of tensors travels as a payload of a few parts (each
large leaf as it is, with no copy, the small ones packed into one) with its structure
inside the header (:mod:`raypipe.comm.tree_messages`). A gradient has the shape and
dtype of the payload sent under the same key (a tree's: its floating-point leaves'
parts), so it needs no header. A payload's parts are one message to everything that
orders messages: they are sent, posted and waited for together, in one batch on NCCL,
always in the same order on both ends, so the lowering and its dry-run count a payload
as one message whatever its parts (:mod:`raypipe.core.simulator`). With
``boundary_shapes="learned"`` the header goes only the first time a key crosses: both
ends record its signature, later steps send the payload alone into a receive posted on
the recorded buffer (in the exchange's batch under NCCL's rules), and an activation
whose signature changed is refused before any of it is sent
(:mod:`raypipe.comm.boundary_signatures`, :class:`~raypipe.errors.BoundaryShapeChanged`).

Gloo hands a message over only once its receive is posted, so with gloo every
receive is posted as early as the schedule allows
(:class:`~raypipe.comm.matching.ByTag`): a stage's activation headers at the
start of its step, each payload too when its shape is predicted (the shape the
message of this key had last step, which both sides remember the same way), and a
gradient's receive as soon as its activation is sent (the step's statistics reduction's
receives go on the control channel, gloo on every transport, before the worker first
waits for a peer: :meth:`P2PChannel.expect_statistics`). A payload whose shape
changed goes under another tag, and the stale prediction is consumed by a filler
of the predicted size, so no posted receive is ever left unmatched (a key whose
signature is learned sends no header and no filler: its shape never changes). NCCL matches
point-to-point messages in stream order and ignores tags
(:class:`~raypipe.comm.matching.InOrder`): there each payload and gradient is
received when it is reached (headers are posted ahead all the same, on the
control channel below), and the messages between two ranks match in the order
they are issued, whatever their keys: the lowering issues them alike on both
ends. An exchange receives an activation's payload after its batch, or, where the
lowering says so (a ring of chunked workers, each sending on before it receives),
in the batch, its header awaited first (:meth:`P2PChannel.exchange`).

A send completes only once its receive is posted, so a stage that sends to a
peer and then receives from it, while the peer does the same the other way,
must post both at once: :meth:`P2PChannel.exchange` runs the lowering's
EXCHANGE ops (:mod:`raypipe.core.lowering`). On NCCL it posts them in one
``dist.batch_isend_irecv``, and every other point-to-point op goes through a
batch too (of one): torch gives a batch the group's communicator, but a lone
send or receive a two-rank one of its own when the group was made lazily, and
messages on two communicators are not ordered against each other.

The worker's place in the group (joining and leaving it, its control channel of CPU
tensors on gloo beside NCCL, the replicas' subgroup, and :meth:`P2PChannel.abort`, which
releases a blocked step) is :mod:`raypipe.comm.membership`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist

from raypipe.comm import tree_messages
from raypipe.comm.boundary_signatures import HEADERS, BoundarySignature, LearnedSignatures, changed
from raypipe.comm.headers import (HEADER_LENGTH, TREE, MessageSignature, decode, empty_buffers, encode,
                                  inline_structure, message_signature, structure_inline, tree_signature)
from raypipe.comm.matching import (GRADIENT, HEADER, LAYOUT, PREDICTED, STATISTICS, UNPREDICTED, ByTag, InOrder,
                                   Operation)
from raypipe.comm.membership import GroupMembership
from raypipe.comm.tree_messages import TreeStructure
from raypipe.comm.polled_wait import WaitedOnThread, work_of_parts
from raypipe.comm.step_messages import DeferredReceive, StepMessages
from raypipe.core.ops import RECEIVES, RECV_ACT, SEND_ACT, SENDS, LoweredOp, micro_batch_of_key
from raypipe.core.topology import Topology
from raypipe.errors import BoundaryShapeChanged


class P2PChannel:
    """One worker's links to the other stages of its pipeline in the run's process
    group, and to the other replicas of its stage.

    ``num_chunks``: the model chunks each worker holds, so ``topology.num_stages *
    num_chunks`` virtual stages; only to name a failed message's micro-batch from its
    key (:func:`raypipe.core.ops.micro_batch_of_key`). ``boundary_shapes``: ``"learned"``
    (each key's header goes the first time it crosses, its payload alone after:
    :mod:`raypipe.comm.boundary_signatures`) or ``"headers"`` (a header before every
    activation); the worker passes :attr:`raypipe.config.PipelineConfig.boundary_shapes`."""

    def __init__(self, topology: Topology, replica: int, stage: int, device: torch.device,
                 num_chunks: int = 1, boundary_shapes: str = HEADERS, tp_rank: int = 0) -> None:
        self.topology, self.replica, self.stage, self.device = topology, replica, stage, device
        self.tp_rank = tp_rank
        self.rank = topology.rank(replica, stage, tp_rank)
        self.num_virtual_stages = topology.num_stages * num_chunks
        self._learned = LearnedSignatures(boundary_shapes)
        self._group = GroupMembership(topology, replica, stage, device, tp_rank)
        self._waits, self.replicas = self._group.waits, self._group.replicas
        self._messages = StepMessages()
        # what was issued so far, for the tests and the docs: headers (and structures) sent and received on the
        # control channel, and operations started on the data channel (receives posted ahead on gloo aside)
        self.control_messages = self.data_operations_started = 0
        self.sent_bytes = 0  # payload bytes put on the data channel (a stale prediction's filler included)
        self._batch: list[Operation] | None = None  # while an exchange collects its sends

    @property
    def backend(self) -> str:
        return self._group.backend

    @property
    def tensor_mesh(self) -> Any:
        """The stage's tensor-parallel mesh (a 1-D ``DeviceMesh``) while the group is joined; None with t = 1."""
        return self._group.tensor_mesh

    @property
    def control(self) -> Any:
        """The group of headers and the step's all-reduce (gloo, CPU tensors); None: the group itself."""
        return self._group.control

    @property
    def _matching(self) -> ByTag | InOrder:
        return self._group.matching

    @_matching.setter
    def _matching(self, matching: ByTag | InOrder) -> None:
        self._group.matching = matching

    def join(self, address: str, port: int, timeout_s: float, emulate_nccl: bool = False,
             store: dist.TCPStore | None = None, abandoned: Callable[[], bool] = lambda: False) -> None:
        """Join the group at ``address:port``, its control channel, and this stage's
        replica subgroup. ``emulate_nccl``: on gloo, under NCCL's rules
        (:mod:`raypipe.comm.nccl_emulation`); ``store``: the group's store where this rank
        holds it open; ``abandoned``: polled until every rank has come, ends the join once true
        (:meth:`raypipe.comm.membership.GroupMembership.join`). Learned signatures start afresh."""
        self._learned.forget()
        self._group.join(address, port, timeout_s, emulate_nccl, store, abandoned)

    def leave(self) -> None:
        """Drop pending operations and leave the group, closing its connections;
        forget the predicted shapes and the learned signatures (every member leaves
        before a group re-forms). On NCCL, with operations pending or after an abort,
        the communicators are aborted: a destroy would wait for the pending work."""
        self._learned.forget()
        self._group.leave(self._messages)

    @property
    def boundary_shapes(self) -> str:
        """``"learned"`` or ``"headers"`` (see the class)."""
        return self._learned.mode

    def mark_dynamic(self, keys: Collection[int]) -> None:
        """Send (and expect) headers on the message ``keys`` for the rest of the run, whatever
        ``boundary_shapes``: keys whose activation changed signature
        (:attr:`raypipe.errors.BoundaryShapeChanged.keys`). Both ends of a key must mark it
        before the same step (the driver passes the keys to every worker with the step's call,
        and each calls this before its first operation); kept across leaving and joining."""
        if self._messages.pending:
            raise RuntimeError(f"stage {self.stage} cannot mark message keys dynamic in the middle of a step")
        self._learned.mark_dynamic(keys)

    def learned_signature(self, key: int) -> BoundarySignature | None:
        """The signature recorded for ``key`` (as sent, else as received); None: none is."""
        return self._learned.sent.get(key) or self._learned.received.get(key)

    def abort(self) -> None:
        """Release a step blocked on this channel; callable from any thread (the
        worker's health thread, while the step runs). Sets the abort flag, which every
        polled wait checks, and on NCCL aborts every communicator of the group (never
        a destroy: it would wait for the blocked work). The step raises
        :class:`~raypipe.errors.StepAborted` and leaves; the group must be joined
        afresh. On gloo without the emulation a wait blocks in gloo, which releases
        it when a peer leaves; the flag then stops the step at its next operation."""
        self._group.abort()

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called since the group was last joined."""
        return self._group.aborted

    def expect_activations(self, expected: list[tuple[int, int]]) -> None:
        """Post the receives of this step's activations, each a (key, peer stage) pair
        (headers, and payloads of predicted shape or learned signature), before they are
        needed. Under NCCL's rules a learned payload is posted when reached (messages
        match in issue order), without a header."""
        for key, peer in expected:
            peer_rank = self._peer_rank(peer)
            learned = self._learned.to_receive(key)
            if learned is not None:
                if self._matching.predicts:
                    self._messages.payloads[key] = self._posted(learned.payload, peer_rank, PREDICTED, key)
                continue
            header = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=self._control_device)
            self._messages.headers[key] = self._control_op(dist.irecv, header, peer_rank, key), header
            predicted = self._messages.received.get(key)
            if predicted is not None:
                self._messages.payloads[key] = self._posted(predicted, peer_rank, PREDICTED, key)

    def _posted(self, signature: MessageSignature, peer_rank: int, kind: int,
                key: int) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """The receives of a message of ``signature``'s parts, posted ahead where messages match by tag
        (gloo), into new buffers: their Work (None under NCCL's rules: received when reached) and buffers."""
        buffers = empty_buffers(signature, self.device)
        works = [self._matching.post(buffer, peer_rank, kind, key) for buffer in buffers]
        return (work_of_parts(works) if self._matching.predicts else None), buffers

    def send_activation(self, tensor: Any, key: int, peer: int) -> None:
        """Start sending an activation (header, then payload; the payload alone once its
        key's signature is learned) to stage ``peer`` under ``key``, and post the receive of
        its gradient (which comes back under the same key). A tree of tensors (not a single
        tensor) goes as a few parts, its large leaves as they are, its structure in the header
        (:mod:`raypipe.comm.tree_messages`). An activation whose signature differs from the one
        learned for ``key`` is not sent: :class:`~raypipe.errors.BoundaryShapeChanged`."""
        peer_rank = self._peer_rank(peer)
        parts, structure = tree_messages.outgoing(tensor, self.stage, self.device)
        outgoing = BoundarySignature(message_signature(parts), structure)
        learned = self._learned.to_send(key)
        if learned is not None:
            if learned != outgoing:
                raise self._shape_changed(key, peer, learned, outgoing)
            self._send(parts, peer_rank, PREDICTED, key)
        else:
            self._send_with_header(parts, outgoing, peer_rank, key)
        if structure is not None:
            self._messages.sent_structures[key] = structure
        gradient = outgoing.payload if structure is None else tree_messages.part_signatures(
            tree_messages.gradient_structure(structure))
        self._messages.gradients[key] = self._posted(gradient, peer_rank, GRADIENT, key)

    def _send_with_header(self, parts: tuple[torch.Tensor, ...], outgoing: BoundarySignature, peer_rank: int,
                          key: int) -> None:
        """Send the header of ``outgoing`` (with a tree's structure, or followed by it where it is too large),
        then its ``parts``; on gloo under the tag of its prediction (a stale prediction's receives
        consumed by fillers). With learned shapes, the signature is recorded."""
        predicted, signature, structure = self._messages.sent.get(key), outgoing.payload, outgoing.structure
        described = b"" if structure is None else structure.to_bytes()
        inline = structure_inline(len(described))
        header = encode(signature[0] if structure is None else tree_signature(structure.nbytes, len(described)),
                        self._control_device, described if inline else b"")
        self._messages.sends.append((self._control_op(dist.isend, header, peer_rank, key), header))
        if not inline:  # on the control channel, right after its header
            follows = torch.frombuffer(bytearray(described), dtype=torch.uint8).to(self._control_device)
            self._messages.sends.append((self._control_op(dist.isend, follows, peer_rank, key, LAYOUT), follows))
        if predicted is not None and predicted != signature:  # consume the receives posted on the prediction
            self._send(empty_buffers(predicted, self.device), peer_rank, PREDICTED, key)
        self._send(parts, peer_rank, PREDICTED if predicted == signature else UNPREDICTED, key)
        if self._matching.predicts:
            self._messages.sent[key] = signature
        if self._learned.learns(key):
            self._learned.sent[key] = outgoing

    def _shape_changed(self, key: int, peer: int, learned: BoundarySignature,
                       outgoing: BoundarySignature) -> BoundaryShapeChanged:
        before, after = changed(learned, outgoing)
        return BoundaryShapeChanged(self.stage, peer, self._micro_batch(key), before, after, (key,),
                                    replica=self.replica if self.topology.num_replicas > 1 else None)

    def recv_activation(self, key: int, peer: int) -> Any:
        """The activation sent under ``key`` by stage ``peer``, whatever its shape and
        dtype: a tensor, or a tree of them as it was sent."""
        learned = self._learned.to_receive(key)
        if learned is not None:  # no header: in the receive posted ahead (gloo), or in one posted now
            posted = self._messages.payloads.pop(key, None)
            parts = self._receive(posted, learned.payload, self._peer_rank(peer), PREDICTED, key)
            return self._activation(parts, learned.structure, key)
        signature, structure = self._await_header(key, peer)
        parts = self._receive_payload(signature, self._peer_rank(peer), key)
        return self._activation(parts, structure, key)

    def _await_header(self, key: int, peer: int) -> tuple[MessageSignature, TreeStructure | None]:
        """The parts' signature of the activation sent under ``key`` by stage ``peer``, and the
        structure of a tree (None for a tensor), once its header (and structure) came in."""
        peer_rank = self._peer_rank(peer)
        if key not in self._messages.headers:
            self.expect_activations([(key, peer)])
        work, header = self._messages.headers.pop(key)
        self._waits.wait(work, peer_rank, self._micro_batch(key), "activation")
        code, shape = decode(header)
        structure, signature = None, ((code, shape),)
        if code == TREE:
            size = shape[1]
            structure = (TreeStructure.from_bytes(inline_structure(header, size)) if structure_inline(size)
                         else self._receive_structure(size, peer_rank, key))
            signature = tree_messages.part_signatures(structure)
        if self._matching.predicts:
            self._messages.received[key] = signature
        if self._learned.learns(key):
            self._learned.received[key] = BoundarySignature(signature, structure)
        return signature, structure

    def _activation(self, parts: tuple[torch.Tensor, ...], structure: TreeStructure | None, key: int) -> Any:
        """A received message's parts as what was sent: the tensor, or the tree ``structure`` describes."""
        if structure is None:
            return parts[0]
        self._messages.received_structures[key] = structure
        return tree_messages.tree_of(parts, structure, self.device)

    def _receive_payload(self, signature: MessageSignature, peer_rank: int, key: int) -> tuple[torch.Tensor, ...]:
        """The parts of ``signature``: in the receives posted ahead on their predicted shapes (gloo;
        consumed even when stale), or else in ones posted now."""
        posted = self._messages.payloads.pop(key, None)
        if posted is not None:
            predicted = self._receive(posted, None, peer_rank, PREDICTED, key)
            if message_signature(predicted) == signature:
                return predicted
        return self._receive(None, signature, peer_rank, UNPREDICTED, key)

    def _receive_structure(self, size: int, peer_rank: int, key: int) -> TreeStructure:
        """A tree's structure too large for its header, sent right after it on the control channel."""
        described = torch.empty(size, dtype=torch.uint8, device=self._control_device)
        work = self._control_op(dist.irecv, described, peer_rank, key, LAYOUT)
        self._waits.wait(work, peer_rank, self._micro_batch(key), "activation")
        return TreeStructure.from_bytes(described.cpu().numpy().tobytes())

    def recv_gradient(self, key: int, peer: int) -> Any:
        """The gradient, from stage ``peer``, of the activation sent to it under ``key``
        (for a tree: a tree of its structure, ``None`` where a leaf is not floating-point)."""
        peer_rank = self._peer_rank(peer)
        parts = self._receive(self._messages.gradients.pop(key), None, peer_rank, GRADIENT, key)
        structure = self._messages.sent_structures.pop(key, None)
        return parts[0] if structure is None else tree_messages.tree_of(
            parts, tree_messages.gradient_structure(structure), self.device)

    def send_gradient(self, gradient: Any, key: int, peer: int) -> None:
        """Start sending to stage ``peer`` the gradient of the activation it sent under
        ``key`` (for a received tree: a tree of its structure, ``None`` for a leaf with no
        gradient)."""
        peer_rank = self._peer_rank(peer)
        structure = self._messages.received_structures.pop(key, None)
        if structure is not None:  # its floating-point leaves' gradients (zeros where a leaf has none)
            self._send(tree_messages.gradient_parts(gradient, structure, self.device), peer_rank, GRADIENT, key)
            return
        if gradient is None:
            raise RuntimeError(f"stage {self.stage} has no gradient for its input of micro-batch "
                               f"{self._micro_batch(key)}: the stage does not use its input")
        self._send((gradient.detach().contiguous(),), peer_rank, GRADIENT, key)

    def exchange(self, sends: list[tuple[LoweredOp, Any]], receives: list[LoweredOp],
                 key_of: Callable[[LoweredOp], int], header_first: Collection[LoweredOp] = ()) -> list[Any]:
        """Run one EXCHANGE op (:func:`raypipe.core.ops.exchange`): start ``sends``
        (SEND_ACT or SEND_GRAD parts, each with its tensor) and post ``receives``
        (RECV_ACT or RECV_GRAD parts) together, then return what each receive got,
        in order. Each part goes to or comes from its ``peer`` stage, under the key
        ``key_of(part)`` (the caller's :func:`raypipe.core.ops.message_key` of it, the
        same its peer computes for the other end). ``header_first``: the RECV_ACT parts
        of ``receives`` whose payloads go in the batch (the op's
        :attr:`~raypipe.core.ops.LoweredOp.header_first`, chosen by the lowering); a part
        whose key's signature is learned goes in the batch too, with no header to await
        (the dry-run's ``boundary_shapes="learned"``: :func:`raypipe.core.simulator.postings`).

        On NCCL all of them go in one ``dist.batch_isend_irecv``, so neither this
        stage's sends nor its peer's wait behind a receive posted after them. The sends'
        headers go out first, over the control channel. An activation's payload can be
        posted only once its header (posted ahead on the control channel) gave its shape:
        for one in ``header_first`` the header is awaited before the batch and the payload
        goes in it; every other one is received after the batch, once its header is in,
        and so is a gradient that comes after it from the same peer (a pair's messages
        match in issue order, the order of ``receives``, as the dry-run checks:
        :func:`raypipe.core.simulator.postings`). On gloo every receive is posted ahead
        already and no send waits for its receive: the sends start, and each receive is returned as
        a :class:`~raypipe.comm.step_messages.DeferredReceive`, waited for by the op that uses it
        (under NCCL's rules, and their emulation, every receive is waited for here, as it came).
        """
        # checked before anything starts: an exchange is posted whole or not at all
        for parts, kinds, role in (([op for op, _ in sends], SENDS, "sends"), (receives, RECEIVES, "receives")):
            for part in parts:
                if part.kind not in kinds:
                    raise ValueError(f"stage {self.stage} cannot exchange {part!r} among its {role}: "
                                     f"expected one of {', '.join(kinds)}")
                self._peer_rank(part.peer, part)
        for part in header_first:
            if part.kind != RECV_ACT or part not in receives:
                raise ValueError(f"stage {self.stage} cannot await the header of {part!r} first: it is not one of "
                                 f"the exchange's activation receives")
        self._batch = []
        structures: dict[int, TreeStructure | None] = {}  # per key of a payload received in the batch: its structure
        try:
            for op, tensor in sends:  # the headers go out now, the payloads with the batch
                (self.send_activation if op.kind == SEND_ACT else self.send_gradient)(tensor, key_of(op), op.peer)
            operations, self._batch = self._batch, None
            posted = []  # the receives this batch posts: where each is kept, its key, its buffer, its operation
            received_after: set[int] = set()  # peers with an activation received after the batch
            for op in receives:
                key, peer_rank = key_of(op), self._peer_rank(op.peer)
                if op.kind == RECV_ACT:
                    learned = self._learned.to_receive(key)
                    if learned is None and key not in self._messages.headers:  # posted ahead on the control channel
                        self.expect_activations([(key, op.peer)])
                    if not self._group.in_order or op.peer in received_after or (
                            learned is None and op not in header_first):
                        received_after.add(op.peer)
                        continue
                    if learned is not None:  # its signature is known: no header to await
                        signature, structures[key], tag = learned.payload, learned.structure, PREDICTED
                    else:
                        (signature, structures[key]), tag = self._await_header(key, op.peer), UNPREDICTED
                    buffers, kept = empty_buffers(signature, self.device), self._messages.payloads
                else:
                    work, buffers = self._messages.gradients[key]
                    if work is not None or op.peer in received_after:  # gloo: posted ahead; NCCL: behind
                        continue
                    kept, tag = self._messages.gradients, GRADIENT
                first = len(operations)  # NCCL: posted now, with the sends, each part in order
                operations.extend((dist.irecv, buffer, peer_rank, self._matching.tag(tag, key)) for buffer in buffers)
                posted.append((kept, key, buffers, range(first, len(operations))))
            works = self._started(operations) if operations else []
            for work, (function, tensor, _, _) in zip(works, operations):
                if function is dist.isend:
                    self._messages.sends.append((work, tensor))
            for kept, key, buffers, indices in posted:
                kept[key] = work_of_parts([works[index] for index in indices]), buffers
        finally:
            self._batch = None
        received = []
        for op in receives:
            key = key_of(op)
            if key in structures:
                receive = functools.partial(self._received_in_batch, key, op.peer, structures[key])
            else:
                receive = functools.partial(self.recv_activation if op.kind == RECV_ACT else self.recv_gradient,
                                            key, op.peer)
            # under NCCL's rules a receive after the batch is posted in the exchange's place in the issue order
            received.append(receive() if self._group.in_order else DeferredReceive(receive))
        return received

    def _received_in_batch(self, key: int, peer: int, structure: TreeStructure | None) -> Any:
        """The activation whose payload an exchange received in its batch, its header awaited first."""
        work, parts = self._messages.payloads.pop(key)
        self._waits.wait(work, self._peer_rank(peer), self._micro_batch(key), "activation")
        return self._activation(parts, structure, key)

    def finish_sends(self) -> None:
        """Wait until every started send has completed (the buffers live until then)."""
        for work, _buffer in self._messages.sends:
            self._waits.wait(work, None, None, "send")
        self._messages.sends.clear()

    def expect_statistics(self, length: int) -> None:
        """Post this step's receives of :meth:`all_reduce_sum` of ``length`` numbers ahead: on the
        control group's first rank every other rank's numbers, on the others the sum. Gloo hands a
        message over only once its receive is posted, so each rank's numbers then travel as it
        sends them, while the first rank (stage 0, which ends a 1F1B or GPipe step last, after its
        last backward) still computes. Without this call :meth:`all_reduce_sum` posts them itself.
        The step runner calls it before the worker first waits for a peer: the first rank's posts
        (~10 µs each on gloo here) then fall in its bubble, not before its first forward."""
        if self._messages.statistics:
            raise RuntimeError(f"stage {self.stage} already expects this step's statistics")
        self._messages.statistics = self._posted_statistics(length)

    def _posted_statistics(self, length: int) -> list[tuple[Any, torch.Tensor]]:
        """The receives of :meth:`all_reduce_sum`, posted now (Work, buffer): every other rank's
        numbers, in rank order, on the first rank; the sum on the others."""
        rank, world = dist.get_rank(self.control), dist.get_world_size(self.control)
        peers = range(1, world) if rank == 0 else [0]
        buffers = [torch.empty(length, dtype=torch.float64, device=self._control_device) for _ in peers]
        return [(self._statistics_op(dist.irecv, buffer, peer), buffer) for peer, buffer in zip(peers, buffers)]

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over every worker, in float64, added in rank order by the
        control group's first rank and sent from it to every other, so every worker gets the same
        bits (those of the in-process harness's sum in rank order).

        Point-to-point messages to and from the first rank rather than ``all_reduce``: the statistics
        are a few numbers a virtual stage, so the reduction is all latency, and gloo's all-reduce is a
        ring that passes 2(n - 1) messages one after another once the last worker (stage 0, after its
        last backward) arrives. Here every rank's numbers are already at the first rank when it
        arrives, in receives posted early in the step (:meth:`expect_statistics`): from that arrival
        to every worker's return 1.1 ms against 2.1 for a gather and a broadcast and 3.8 for the ring
        at n = 4; 2.3, 4.1 and 18.3 at n = 8 (gloo on one 2-core machine;
        ``benchmarks/bench_step_decision.py``)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self._control_device)
        posted = self._messages.statistics or self._posted_statistics(len(values))
        if any(buffer.numel() != len(values) for _, buffer in posted):  # kept pending: leaving drops them
            raise RuntimeError(f"stage {self.stage} expected {posted[0][1].numel()} statistics this step, "
                               f"not {len(values)}")
        self._messages.statistics = []
        if dist.get_rank(self.control) != 0:
            (received, total), = posted
            sent = self._statistics_op(dist.isend, tensor, 0)  # the sum's receive is posted: its send never waits
            self._waits.wait(sent, 0, None, "reduction")
            self._waits.wait(received, 0, None, "reduction")
            return total.tolist()
        for peer, (received, part) in enumerate(posted, start=1):
            self._waits.wait(received, peer, None, "reduction")
            tensor += part
        sent = [self._statistics_op(dist.isend, tensor, peer) for peer in range(1, len(posted) + 1)]
        for peer, work in enumerate(sent, start=1):
            self._waits.wait(work, peer, None, "reduction")
        return tensor.tolist()

    def _statistics_op(self, function: Any, tensor: torch.Tensor, peer_rank: int) -> Any:
        """Start a send or receive of the statistics reduction on the control channel (its own tag);
        not counted in :attr:`control_messages`, which counts the activations' headers."""
        self._waits.refuse_after_abort("reduction")
        work = function(tensor, peer_rank, group=self.control, tag=ByTag.tag(STATISTICS, 0))
        return WaitedOnThread(work, self._waits.pool) if self._waits.polls else work

    @property
    def _control_device(self) -> torch.device:
        """Where the control channel's tensors live: the CPU when it is gloo beside NCCL."""
        return torch.device("cpu") if self.control is not None else self.device

    def _peer_rank(self, peer: int | None, op: LoweredOp | None = None) -> int:
        """The rank of stage ``peer`` of this replica at this worker's tp_rank; a ValueError (naming ``op``, if given)
        unless it is another stage of the pipeline."""
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.topology.num_stages \
                or peer == self.stage:
            what = f"{op!r}'s peer" if op is not None else "a peer"
            raise ValueError(f"stage {self.stage} cannot message {what} {peer!r}: a peer is another stage of "
                             f"the pipeline, one of 0..{self.topology.num_stages - 1} but {self.stage}")
        return self.topology.rank(self.replica, peer, self.tp_rank)

    def _micro_batch(self, key: int) -> int:
        """The micro-batch of a message's key, for error messages."""
        return micro_batch_of_key(key, self.num_virtual_stages)

    def _control_op(self, function: Any, tensor: torch.Tensor, peer_rank: int, key: int,
                    kind: int = HEADER) -> Any:
        """Start a header's (or a tree's structure's) send or receive on the control channel (matched by tag)."""
        self._waits.refuse_after_abort("activation")
        self.control_messages += 1
        work = function(tensor, peer_rank, group=self.control, tag=ByTag.tag(kind, key))
        # gloo's point-to-point Work never says it completed until waited for: waited on a thread when polled
        return WaitedOnThread(work, self._waits.pool) if self._waits.polls else work

    def _send(self, parts: tuple[torch.Tensor, ...], peer_rank: int, kind: int, key: int) -> None:
        """Start sending a message's ``parts`` (in order: its receives are posted in that order)."""
        self.sent_bytes += sum(part.numel() * part.element_size() for part in parts)
        operations = [(dist.isend, part, peer_rank, self._matching.tag(kind, key)) for part in parts]
        if self._batch is not None:  # an exchange's: started with its receives
            self._batch.extend(operations)
        elif operations:  # together: one NCCL batch
            self._messages.sends.extend(zip(self._started(operations), parts))

    def _started(self, operations: list[Operation]) -> list[Any]:
        """Start ``operations``; the Work of each (NCCL's batch has one Work for all)."""
        self._waits.refuse_after_abort("operation")
        self.data_operations_started += len(operations)
        works = self._matching.start(operations)
        return works if len(works) == len(operations) else [works[0]] * len(operations)

    def _receive(self, posted: tuple[Any, tuple[torch.Tensor, ...]] | None, signature: MessageSignature | None,
                 peer_rank: int, kind: int, key: int) -> tuple[torch.Tensor, ...]:
        """Wait for a message's posted receives, or post them (together: one NCCL batch) into new
        buffers of ``signature`` and wait; its parts."""
        work, buffers = posted if posted is not None else (None, empty_buffers(signature, self.device))
        if work is None:
            operations = [(dist.irecv, buffer, peer_rank, self._matching.tag(kind, key)) for buffer in buffers]
            work = work_of_parts(self._started(operations) if operations else [])
        self._waits.wait(work, peer_rank, self._micro_batch(key), "gradient" if kind == GRADIENT else "activation")
        return buffers
