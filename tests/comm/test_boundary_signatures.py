"""Learned boundary signatures (``boundary_shapes="learned"``) over gloo between real processes,
and under NCCL's emulation: the first step sends headers and both ends record each key's
signature; later steps send no header at all (counted on the control channel) and deliver
exactly, the lowered exchanges of 1F1B, interleaved and ZBV included; a changed shape fails
the sender before anything of it goes on the data channel, with BoundaryShapeChanged naming
what changed; keys marked dynamic keep headers; signatures are dropped on leaving and joining;
``boundary_shapes="headers"`` sends a header before every activation, as before. The ranks are
forked processes reused from test to test (tests/comm/shared_ranks.py), each run joining its
groups afresh: every transport's count is taken on a group of its own."""
from __future__ import annotations

import pytest
import torch

from raypipe.comm.boundary_signatures import HEADERS, LEARNED, BoundarySignature, LearnedSignatures
from raypipe.comm.headers import signature_of
from raypipe.comm.p2p import P2PChannel
from raypipe.core import ops
from raypipe.core.topology import Topology
from raypipe.errors import BoundaryShapeChanged, StageError, StepAborted
from tests.comm.shared_ranks import shared_ranks
from tests.comm.test_p2p import (CHUNKED, CHUNKED_M, CHUNKED_P, CHUNKED_V, keys_of, run_ops,
                                 tree_activation)
from tests.ports import free_port

# "headers" under NCCL's emulation is test_p2p's (the channel's default)
MODES = [(LEARNED, False), (LEARNED, True), (HEADERS, False)]
MODE_IDS = ["learned-gloo", "learned-nccl-emulation", "headers-gloo"]


@pytest.fixture(scope="module")
def ranks():
    """Forked ranks (tests/comm/shared_ranks.py's, shared with the other modules that use them)."""
    return shared_ranks()


def boundary(step: int, micro_batch: int, boundary_index: int) -> torch.Tensor:
    """The activation of ``micro_batch`` across ``boundary_index`` at ``step``: a shape of the boundary's own."""
    shape = (2, 1 + boundary_index, 3)
    values = torch.arange(torch.Size(shape).numel(), dtype=torch.float64) + 1000 * step + 100 * micro_batch
    return (values + 10 * boundary_index).reshape(shape).to(torch.float32)


def run_step(channel: P2PChannel, stage_ops: list[ops.LoweredOp], key_of, tensor) -> dict:
    """One step of ``stage_ops`` (a worker's lowering), each send of ``tensor(op)``; what each receive got."""
    channel.expect_activations([(key_of(op), op.peer) for op in ops.unbatch(stage_ops) if op.kind == ops.RECV_ACT])
    return run_ops(channel, stage_ops, key_of, tensor)


def run_lowered_stage(rank: int, ports: list[int], mode: str, emulate_nccl: bool) -> list[tuple]:
    """Worker ``rank`` of 1F1B (p = 3) and of each of CHUNKED (p = 3, v = 2), three steps each, then the
    group left and joined afresh and two steps more: every receive gets exactly what its sender sent;
    returns each step's control messages (headers sent and received), the bytes it sent and the bytes
    of its activations and gradients, and the threads its polled control waits were made on so far."""
    from raypipe.core.lowering import lower
    from raypipe.core.schedule import make_schedule

    counts = []
    channel = P2PChannel(Topology(num_stages=CHUNKED_P), 0, rank, torch.device("cpu"), num_chunks=CHUNKED_V,
                         boundary_shapes=mode)
    ports = iter(ports)
    try:
        for name, placement, chunks in [("1f1b", ops.LOOPED, 1)] + [(n, p, CHUNKED_V) for n, p in CHUNKED]:
            stage_ops = lower(make_schedule(name, CHUNKED_P, CHUNKED_M, chunks), placement)[rank]
            key_of = keys_of(rank, CHUNKED_P, chunks, placement)
            for phase in range(2):  # joined, then left and joined afresh: signatures start again
                port = next(ports)
                channel.join("127.0.0.1", port, timeout_s=60, emulate_nccl=emulate_nccl)
                for step in range(3 - phase):
                    def tensor(op: ops.LoweredOp) -> torch.Tensor:
                        sent = boundary(step, op.micro_batch, ops.boundary_of(rank, op.chunk, op.kind, CHUNKED_P,
                                                                              placement))
                        return sent if op.kind in (ops.SEND_ACT, ops.RECV_ACT) else -sent

                    before, sent = channel.control_messages, channel.sent_bytes
                    received = run_step(channel, stage_ops, key_of, tensor)
                    for op, got in received.items():
                        torch.testing.assert_close(got, tensor(op), rtol=0, atol=0, msg=f"{name} {step} {op!r}")
                    activations = sum(op.kind in (ops.SEND_ACT, ops.RECV_ACT) for op in ops.unbatch(stage_ops))
                    payloads = sum(tensor(op).numel() * 4 for op in ops.unbatch(stage_ops) if op.kind in ops.SENDS)
                    counts.append((name, phase, step, rank, channel.control_messages - before, activations,
                                   channel.sent_bytes - sent, payloads, channel._waits.pool.started))
                channel.leave()
    finally:
        channel.leave()
    return counts


@pytest.mark.parametrize("mode,emulate_nccl", MODES, ids=MODE_IDS)
def test_a_steady_state_step_sends_no_header_once_signatures_are_learned(ranks, mode, emulate_nccl):
    ports = [free_port() for _ in range(6)]
    seen = [count for counts in ranks.run(run_lowered_stage, ports, mode, emulate_nccl, nprocs=CHUNKED_P)
            for count in counts]
    assert len(seen) == 3 * CHUNKED_P * (3 + 2)
    for name, phase, step, rank, control, activations, sent, payloads, _ in seen:
        if mode == LEARNED and step > 0:  # the steady state: the payloads alone
            assert control == 0, (name, phase, step, rank)
        else:  # a header sent or received per activation (a tensor's: one message each)
            assert control == activations > 0, (name, phase, step, rank, control, activations)
        assert sent == payloads, (name, phase, step, rank)  # no filler message: no prediction was stale
    # under NCCL's rules each control operation (a header sent or received) is waited for on a thread of the
    # channel's pool, made once and reused, not one thread each; on gloo, in gloo's own wait
    operations = sum(control for *_, control, _, _, _, _ in seen)
    threads = max(made for *_, made in seen)
    assert (0 < threads <= 3 < operations) if emulate_nccl else threads == 0, (threads, operations)


def run_changing_stage(rank: int, ports: tuple[int, int], keys) -> list[tuple]:
    """Two stages, three micro-batches of a tree (the LLaMA-like boundary of test_p2p): step 0 learns,
    step 1 reuses, step 2 sends micro-batch 1 at another length: the sender fails before sending it,
    the receiver (blocked on it) is released, both leave; joined afresh with the key marked dynamic
    (the failing sender's keys reach the receiver through ``keys``, as the driver passes them),
    steps 3 and 4 deliver every shape, with a header on that key only at step 4. Returns what each
    step did."""
    results = []
    channel = P2PChannel(Topology(num_stages=2), 0, rank, torch.device("cpu"), boundary_shapes=LEARNED)
    key_of = keys_of(rank, 2)
    kind = ops.SEND_ACT if rank == 0 else ops.RECV_ACT

    def key(micro_batch: int) -> int:
        return key_of(ops.LoweredOp(kind, micro_batch, 1 - rank))

    def sent(step: int, micro_batch: int) -> dict:  # micro-batch 1 is one longer from step 2 on
        return tree_activation(int(step >= 2), micro_batch)

    dynamic: list[int] = []
    channel.join("127.0.0.1", ports[0], timeout_s=60)
    try:
        for step in range(5):
            if step == 3:  # the driver's repair: every worker leaves, all join afresh, the keys go with the call
                channel.leave()
                channel.join("127.0.0.1", ports[1], timeout_s=60)
                channel.mark_dynamic(dynamic)
            before, started = channel.control_messages, channel.data_operations_started
            try:
                if rank == 0:
                    for micro_batch in range(3):
                        channel.send_activation(sent(step, micro_batch), key(micro_batch), 1)
                    for micro_batch in reversed(range(3)):
                        gradient = channel.recv_gradient(key(micro_batch), 1)
                        torch.testing.assert_close(gradient["hidden"], -sent(step, micro_batch)["hidden"], rtol=0,
                                                   atol=0)
                else:
                    channel.expect_activations([(key(micro_batch), 0) for micro_batch in range(3)])
                    for micro_batch in range(3):
                        got, want = channel.recv_activation(key(micro_batch), 0), sent(step, micro_batch)
                        torch.testing.assert_close(got["hidden"], want["hidden"], rtol=0, atol=0)
                        assert torch.equal(got["extras"][1]["mask"], want["extras"][1]["mask"])
                    for micro_batch in reversed(range(3)):
                        channel.send_gradient({"hidden": -sent(step, micro_batch)["hidden"]}, key(micro_batch), 0)
                channel.finish_sends()
            except BoundaryShapeChanged as error:
                results.append(("changed", rank, step, str(error), error.keys,
                                channel.data_operations_started - started))
                keys.put(list(error.keys))
                dynamic = list(error.keys)
                channel.leave()  # as a failing worker does: its peer, blocked on the payload, is released
                continue
            except StepAborted as error:
                results.append(("released", rank, step, type(error).__name__, (), 0))
                channel.leave()
                dynamic = keys.get()
                continue
            results.append(("done", rank, step, "", (), channel.control_messages - before))
    finally:
        channel.leave()
    return results


def test_a_changed_shape_fails_before_it_is_sent_and_its_key_keeps_headers_after(ranks):
    seen = {}
    for results in ranks.run(run_changing_stage, (free_port(), free_port()), nprocs=2, shared_queue=True):
        for kind, rank, step, text, error_keys, count in results:
            seen[rank, step] = (kind, text, error_keys, count)
    changed_key = ops.message_key(1, 1, 2)
    kind, text, error_keys, started = seen[0, 2]
    assert kind == "changed" and error_keys == (changed_key,)
    assert text.splitlines()[0] == ("stage 0's output to stage 1, micro-batch 1, changed from a tree of "
                                    "(float32[2, 5, 3], int64[2, 5], bool[2, 5], None, 0.5, bfloat16[2, 5]) to a "
                                    "tree of (float32[2, 6, 3], int64[2, 6], bool[2, 6], None, 0.5, bfloat16[2, 6])")
    assert started == 1  # micro-batch 0's payload; nothing of micro-batch 1
    assert seen[1, 2] == ("released", "StepAborted", (), 0)
    for rank in (0, 1):
        assert seen[rank, 0] == ("done", "", (), 3)  # learned: a header each (the layout inside it)
        assert seen[rank, 1] == ("done", "", (), 0)  # reused: no header
        assert seen[rank, 3] == ("done", "", (), 3)  # joined afresh: learned again
        assert seen[rank, 4] == ("done", "", (), 1)  # the dynamic key only


def test_a_changed_signature_raises_before_anything_starts_and_names_what_changed():
    """In one process: a learned signature, then an activation of another shape, dtype or tree."""
    channel = P2PChannel(Topology(num_stages=4), 0, 2, torch.device("cpu"), num_chunks=1, boundary_shapes=LEARNED)
    key = ops.message_key(5, 3, 4)
    channel._learned.sent[key] = BoundarySignature((signature_of(torch.zeros(4, 16, 64)),))
    with pytest.raises(BoundaryShapeChanged) as raised:
        channel.send_activation(torch.zeros(4, 12, 64), key, 3)
    assert str(raised.value).splitlines()[0] == ("stage 2's output to stage 3, micro-batch 5, changed from "
                                                 "float32[4, 16, 64] to float32[4, 12, 64]")
    assert raised.value.keys == (key,) and isinstance(raised.value, StageError)
    assert not isinstance(raised.value, StepAborted)  # the cause, which the driver reports
    with pytest.raises(BoundaryShapeChanged, match=r"changed from float32\[4, 16, 64\] to bfloat16\[4, 16, 64\]"):
        channel.send_activation(torch.zeros(4, 16, 64, dtype=torch.bfloat16), key, 3)
    with pytest.raises(BoundaryShapeChanged, match=r"to a tree of \(float32\[4, 16, 64\], None\)"):
        channel.send_activation((torch.zeros(4, 16, 64), None), key, 3)
    assert not channel._messages.sends and not channel._messages.gradients and channel.data_operations_started == 0
    assert channel.control_messages == 0
    channel.mark_dynamic([key])  # headers from now on: nothing recorded for the key, none learned
    assert channel.learned_signature(key) is None and channel._learned.to_send(key) is None


def test_signatures_are_learned_per_key_dropped_when_forgotten_and_dynamic_keys_kept():
    learned = LearnedSignatures(LEARNED)
    tensor = BoundarySignature((signature_of(torch.zeros(2, 3)),))
    learned.sent[1] = learned.received[2] = tensor
    assert learned.to_send(1) == tensor and learned.to_receive(2) == tensor and learned.to_send(2) is None
    learned.mark_dynamic([1])
    assert learned.to_send(1) is None and not learned.learns(1) and learned.learns(2)
    learned.forget()
    assert learned.to_receive(2) is None and learned.dynamic == {1}
    assert not LearnedSignatures(HEADERS).learns(2)
    with pytest.raises(ValueError, match=r"^boundary_shapes='static': expected one of learned, headers"):
        LearnedSignatures("static")
