"""The op language of a pipeline step. No Ray, no torch.

A compute schedule is made of :class:`Op` (F, B, I or W of one micro-batch on one
model chunk); lowering
(:mod:`raypipe.core.lowering`) turns it into :class:`LoweredOp` lists that also
say when tensors cross stage boundaries (SEND/RECV of activations and
gradients, alone or batched in an EXCHANGE) and where the step's collectives
run (REDUCE_GRAD, OPTIMIZER_STEP).

The backward of a micro-batch is either one B, or an I (the input gradient, which
the previous virtual stage waits for) and later a W (the weight gradient, which
nobody waits for, so a schedule may defer it into a bubble); I followed at once by
W is B. A worker may hold several model chunks (``v`` of them): its chunk ``c`` is
one virtual stage of the ``p * v`` the model is cut into, placed by a
:data:`PLACEMENTS` rule (:func:`virtual_stage`, :func:`worker_and_chunk`). A message
between workers is named by the micro-batch and the boundary between virtual stages
that it crosses (:func:`boundary_of`, :func:`message_key`), alike on both ends.

An activation travels as a header (its dtype and shape, over a control channel whose
receives are posted ahead, so it never waits) and then its payload, whose receive can
be posted only once the header is in. In an EXCHANGE each RECV_ACT part's payload is
either received after the batch of sends (the default) or, where the lowering says so
(:attr:`LoweredOp.header_first`), in the batch, its header awaited before the batch
is posted: printed ``RECV_ACT3c1<=2`` instead of ``RECV_ACT3c1<-2``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

F, B = "F", "B"
# the backward split: the input gradient (I) and the weight gradient (W) of a micro-batch
I, W = "I", "W"
COMPUTE = (F, B, I, W)
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"
# sends and receives posted together, completing once every one is matched (``dist.batch_isend_irecv``)
EXCHANGE = "EXCHANGE"
REDUCE_GRAD, OPTIMIZER_STEP = "REDUCE_GRAD", "OPTIMIZER_STEP"
COLLECTIVES = (REDUCE_GRAD, OPTIMIZER_STEP)  # run on every stage together

SENDS, RECEIVES = (SEND_ACT, SEND_GRAD), (RECV_ACT, RECV_GRAD)
# Activations flow to the next virtual stage, gradients back to the previous one.
PEER_OFFSET = {SEND_ACT: +1, RECV_ACT: -1, SEND_GRAD: -1, RECV_GRAD: +1}

# Where the p * v virtual stages live. LOOPED: chunk c of worker s is virtual stage c * p + s (Megatron's
# interleaving; with v = 1 it is the plain pipeline), so activations go s -> s + 1 and wrap from the last
# worker back to the first. V_SHAPED (v = 2): chunk 0 of worker s is virtual stage s and chunk 1 is
# 2p - 1 - s, so the model goes down the workers and back up and both ends are on worker 0.
LOOPED, V_SHAPED = "looped", "v_shaped"
PLACEMENTS = (LOOPED, V_SHAPED)

# How an activation's dtype and shape reach its receiver (PipelineConfig.boundary_shapes): LEARNED, in a
# header the first time its message key crosses, the payload alone after (raypipe.comm.boundary_signatures),
# so a steady-state exchange receives every payload in its batch; HEADERS, a header before every payload.
LEARNED, HEADERS = "learned", "headers"
BOUNDARY_SHAPES = (LEARNED, HEADERS)


def virtual_stage(worker: int, chunk: int, num_workers: int, placement: str = LOOPED) -> int:
    """The virtual stage that ``chunk`` of ``worker`` holds (see :data:`PLACEMENTS`)."""
    if placement == LOOPED:
        return chunk * num_workers + worker
    if placement == V_SHAPED:
        if chunk not in (0, 1):
            raise ValueError(f"the {V_SHAPED} placement has chunks 0 and 1, not {chunk}")
        return worker if chunk == 0 else 2 * num_workers - 1 - worker
    raise ValueError(f"unknown placement {placement!r}: expected one of {PLACEMENTS}")


def worker_and_chunk(stage: int, num_workers: int, placement: str = LOOPED) -> tuple[int, int]:
    """The (worker, chunk) that holds virtual stage ``stage`` (the inverse of :func:`virtual_stage`)."""
    if placement == LOOPED:
        return stage % num_workers, stage // num_workers
    if placement == V_SHAPED:
        if not 0 <= stage < 2 * num_workers:
            raise ValueError(f"the {V_SHAPED} placement on {num_workers} workers has virtual stages "
                             f"0..{2 * num_workers - 1}, not {stage}")
        return (stage, 0) if stage < num_workers else (2 * num_workers - 1 - stage, 1)
    raise ValueError(f"unknown placement {placement!r}: expected one of {PLACEMENTS}")


def neighbour(stage: int, chunk: int, kind: str, num_stages: int, num_chunks: int,
              placement: str = LOOPED) -> tuple[int, int] | None:
    """The (worker, chunk) that the message ``kind`` (SEND_ACT, RECV_ACT, SEND_GRAD or
    RECV_GRAD) of ``chunk`` on worker ``stage`` goes to or comes from, or None where the
    pipeline ends there (no previous or next virtual stage)."""
    other = virtual_stage(stage, chunk, num_stages, placement) + PEER_OFFSET[kind]
    if not 0 <= other < num_stages * num_chunks:
        return None
    return worker_and_chunk(other, num_stages, placement)


def boundary_of(stage: int, chunk: int, kind: str, num_stages: int, placement: str = LOOPED) -> int:
    """The boundary a SEND/RECV of ``kind`` by ``chunk`` of worker ``stage`` crosses: the
    virtual stage that receives the activation (an activation's sender and receiver name
    the same boundary, and so do the gradient sent back for it and its receive). A
    SEND_ACT or RECV_GRAD is of the activation this chunk sends on (its virtual stage
    + 1); a RECV_ACT or SEND_GRAD of the one it takes in (its own virtual stage)."""
    if kind not in PEER_OFFSET:
        raise ValueError(f"{kind!r} crosses no boundary: expected one of {tuple(PEER_OFFSET)}")
    leaves = kind in (SEND_ACT, RECV_GRAD)  # the activation leaves this chunk (else: it came in)
    return virtual_stage(stage, chunk, num_stages, placement) + (1 if leaves else 0)


def message_key(micro_batch: int, boundary: int, num_virtual_stages: int) -> int:
    """The key that names, on both ends, the activation of ``micro_batch`` crossing
    ``boundary`` (see :func:`boundary_of`: 1..num_virtual_stages - 1) and the gradient
    sent back for it: ``micro_batch * num_virtual_stages + boundary``.

    Unique in a step (a micro-batch crosses each boundary once) and the same on every
    worker, it tells apart one micro-batch's messages between the same two workers at
    different chunk boundaries (the looped placement's wrap from the last worker to
    the first, the V's both ends on worker 0). It stays small, since gloo tags are
    32-bit ints made from it (:mod:`raypipe.comm.matching`). With one chunk per worker
    (``num_virtual_stages`` = p) the activation from stage s - 1 to s has key
    ``micro_batch * p + s``. :func:`micro_batch_of_key` inverts it."""
    if not 0 < boundary < num_virtual_stages:
        raise ValueError(f"boundary {boundary} is outside 1..{num_virtual_stages - 1}: it names the virtual "
                         f"stage that receives an activation, of {num_virtual_stages}")
    if micro_batch < 0:
        raise ValueError(f"micro-batch {micro_batch} is negative")
    return micro_batch * num_virtual_stages + boundary


def micro_batch_of_key(key: int, num_virtual_stages: int) -> int:
    """The micro-batch of a :func:`message_key` (for error messages: they name micro-batches)."""
    return key // num_virtual_stages


def _chunk_suffix(chunk: int) -> str:
    # chunk 0 prints bare, so a schedule of one chunk per worker prints as it always did
    return f"c{chunk}" if chunk else ""


class Op(NamedTuple):
    """One op of one worker: ``kind`` is F, B, I or W, on micro-batch ``micro_batch`` of model chunk ``chunk``
    (printed ``F3``, or ``F3c1`` for chunk 1)."""

    kind: str
    micro_batch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}{_chunk_suffix(self.chunk)}"


class LoweredOp(NamedTuple):
    """One op of a lowered stage.

    ``micro_batch`` is None for the collectives (REDUCE_GRAD, OPTIMIZER_STEP)
    and for an EXCHANGE; ``peer`` is the other stage of a SEND/RECV and None
    otherwise. An EXCHANGE's ``parts`` are the SEND/RECV ops it posts together,
    in issue order (see :func:`exchange`); every other op has none. ``chunk`` is
    the model chunk of this worker whose compute op it is, or whose output a SEND
    sends or whose input a RECV receives (0 for the collectives and an EXCHANGE);
    it prints after the micro-batch when it is not 0 (``F3c1``, ``SEND_ACT3c1->0``).

    ``header_first`` (an EXCHANGE's only) holds the RECV_ACT parts whose headers are
    awaited before the batch is posted, so that their payloads are received in the
    batch, beside its sends; every other RECV_ACT part's payload is received after the
    batch completed. They print with ``<=`` (``SEND_ACT1->1+RECV_ACT0c1<=1``). The
    parts themselves stay plain ops, equal to the same message sent or received alone.
    """

    kind: str
    micro_batch: int | None = None
    peer: int | None = None
    parts: tuple[LoweredOp, ...] = ()
    chunk: int = 0
    header_first: tuple[LoweredOp, ...] = ()

    def __repr__(self) -> str:
        if self.kind == EXCHANGE:
            return "+".join(repr(part).replace("<-", "<=") if part in self.header_first else repr(part)
                            for part in self.parts)
        if self.micro_batch is None:
            return self.kind
        if self.peer is None:
            return f"{self.kind}{self.micro_batch}{_chunk_suffix(self.chunk)}"
        arrow = "->" if self.kind.startswith("SEND") else "<-"
        return f"{self.kind}{self.micro_batch}{_chunk_suffix(self.chunk)}{arrow}{self.peer}"

    def unbatched(self) -> tuple[LoweredOp, ...]:
        """The point-to-point and other ops this op stands for: an EXCHANGE's parts, any other op itself."""
        return self.parts if self.kind == EXCHANGE else (self,)


def exchange(*parts: LoweredOp, header_first: Iterable[LoweredOp] = ()) -> LoweredOp:
    """One EXCHANGE of the sends and receives ``parts`` (printed ``SEND_ACT1->1+RECV_GRAD0<-1``);
    ``header_first``: those of its RECV_ACT parts whose payloads are received in the batch
    (see :class:`LoweredOp`), kept in part order."""
    chosen = set(header_first)
    return LoweredOp(EXCHANGE, parts=tuple(parts), header_first=tuple(part for part in parts if part in chosen))


def with_header_first(op: LoweredOp, header_first: Iterable[LoweredOp]) -> LoweredOp:
    """The EXCHANGE ``op`` with ``header_first`` as the RECV_ACT parts whose payloads it receives in its batch."""
    return exchange(*op.parts, header_first=header_first)


def awaiting_header(op: LoweredOp, receive: LoweredOp) -> LoweredOp:
    """The EXCHANGE ``op`` receiving in its batch also the payload of ``receive`` (one of its RECV_ACT
    parts) and of every earlier RECV_ACT part from the same peer: a pair's messages are issued in
    part order, so a payload in the batch cannot follow one received after it."""
    earlier = op.parts[:op.parts.index(receive) + 1]
    return with_header_first(op, op.header_first + tuple(
        part for part in earlier if part.kind == RECV_ACT and part.peer == receive.peer))


def unbatch(stage_ops: Iterable[LoweredOp]) -> list[LoweredOp]:
    """``stage_ops`` with every EXCHANGE replaced by its parts."""
    return [part for op in stage_ops for part in op.unbatched()]
