"""Where a worker posts its receives when the backward is split (zb_h1, zbv): in each peer's
send order, near when the message is sent.

Under NCCL's rendezvous rule a send completes only once its receive is posted, and two ranks'
messages match in issue order whatever they are (NCCL ignores tags). With a split backward one
pair of workers carries activations and gradients both ways, so a receive placed right before
the op that needs it can come before an earlier message of the same peer, or leave that peer's
send waiting while this worker computes. :func:`receives_in_send_order` posts each receive where
a run of even-cost ops (:data:`EVEN_COST`) would have its message, and in its sender's order.
:mod:`raypipe.core.lowering` uses it; no Ray, no torch.
"""
from __future__ import annotations

from raypipe.core.ops import (RECEIVES, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, SENDS, B, F, I, LoweredOp, W,
                              neighbour)

# The times of a run of even-cost ops: one unit per F, I or W, two per B (whose work is I's and W's).
EVEN_COST = {F: 1.0, I: 1.0, W: 1.0, B: 2.0}
_RECEIVE_OF = {SEND_ACT: RECV_ACT, SEND_GRAD: RECV_GRAD}


def receives_in_send_order(lowered: list[list[LoweredOp]], num_stages: int, num_chunks: int,
                            placement: str) -> list[list[LoweredOp]]:
    """``lowered`` (messages alone, each receive right before its compute op) with each
    worker's receives from each peer moved so that they come in that peer's send order.

    A receive is posted where a run of even-cost ops (:func:`_even_cost_send_times`)
    would have its message: after the first compute op of the receiver that ends once
    the message is sent, and at the latest right before the compute op that needs it;
    then the k-th receive of a channel goes no later than the (k+1)-th. So a receive
    rarely waits, and the two ends of a pair rarely wait on each other's sends."""
    sent_at = _even_cost_send_times(lowered, num_stages, num_chunks, placement)
    # per channel (sender, receiver): each message as the receiver names it, in send order
    send_order: dict[tuple[int, int], list[LoweredOp]] = {}
    for sender, ops in enumerate(lowered):
        for op in ops:
            if op.kind in SENDS:
                other = neighbour(sender, op.chunk, op.kind, num_stages, num_chunks, placement)
                received_as = LoweredOp(_RECEIVE_OF[op.kind], op.micro_batch, sender, chunk=other[1])
                send_order.setdefault((sender, op.peer), []).append(received_as)
    result = []
    for receiver, ops in enumerate(lowered):
        computes = [op for op in ops if op.kind not in SENDS + RECEIVES]
        need: dict[LoweredOp, int] = {}  # a receive -> the index (among computes) of the op it precedes
        sends_after: list[list[LoweredOp]] = [[] for _ in computes]
        count = 0
        for op in ops:
            if op.kind in RECEIVES:
                need[op] = count
            elif op.kind in SENDS:
                sends_after[count - 1].append(op)
            else:
                count += 1
        if sent_at is not None:
            ends = sent_at[("ends", receiver)]
            for message, needed_by in need.items():
                sent = sent_at[_message_key(receiver, message, num_stages, num_chunks, placement)]
                need[message] = min(needed_by, next((i + 1 for i, end in enumerate(ends) if end >= sent), needed_by))
        posted_before: list[list[tuple[int, int, LoweredOp]]] = [[] for _ in computes]
        for (sender, target), messages in send_order.items():
            if target != receiver:
                continue
            latest = len(computes)
            for place, message in reversed(list(enumerate(messages))):
                # a receive the receiver never runs stays for the simulator to report
                latest = min(latest, need.get(message, latest))
                posted_before[min(latest, len(computes) - 1)].append((sender, place, message))
        stage_ops: list[LoweredOp] = []
        for index, compute in enumerate(computes):
            stage_ops += [message for _, _, message in sorted(posted_before[index])]
            stage_ops += [compute] + sends_after[index]
        result.append(stage_ops)
    return result


def _message_key(receiver: int, receive: LoweredOp, num_stages: int, num_chunks: int,
                 placement: str) -> tuple[int, int, str, int, int]:
    """A message as (sender, receiver, send kind, micro-batch, sender's chunk), from its receive."""
    sender_chunk = neighbour(receiver, receive.chunk, receive.kind, num_stages, num_chunks, placement)[1]
    send_kind = SEND_ACT if receive.kind == RECV_ACT else SEND_GRAD
    return receive.peer, receiver, send_kind, receive.micro_batch, sender_chunk


def _even_cost_send_times(lowered: list[list[LoweredOp]], num_stages: int, num_chunks: int,
                          placement: str) -> dict | None:
    """When each message is sent and each compute op ends, were compute ops of even cost
    run as soon as their inputs are there (messages take no time and never wait): a
    dict from :func:`_message_key`'s key to the send time, and from ``("ends", worker)``
    to its compute ops' end times, in order. None if the compute ops cannot all run."""
    times: dict = {}
    position, free = [0] * len(lowered), [0.0] * len(lowered)
    ends: list[list[float]] = [[] for _ in lowered]
    progressed = True
    while progressed:
        progressed = False
        for stage, ops in enumerate(lowered):
            while position[stage] < len(ops):
                op, start = ops[position[stage]], free[stage]
                if op.kind in RECEIVES:
                    key = _message_key(stage, op, num_stages, num_chunks, placement)
                    if key not in times:
                        break
                    free[stage] = max(start, times[key])
                elif op.kind in SENDS:
                    times[(stage, op.peer, op.kind, op.micro_batch, op.chunk)] = start
                else:
                    free[stage] = start + EVEN_COST[op.kind]
                    ends[stage].append(free[stage])
                position[stage] += 1
                progressed = True
    if any(place < len(ops) for place, ops in zip(position, lowered)):
        return None
    times.update({("ends", stage): stage_ends for stage, stage_ends in enumerate(ends)})
    return times
