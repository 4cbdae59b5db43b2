"""P2PChannel over gloo between real processes: activations of changing
shapes and dtypes arrive exactly, gradients come back, and from the second step
on a payload of unchanged shape lands in a receive posted before it was needed;
the lowered ops of interleaved (looped) and ZBV (V-shaped) schedules, whose
messages go to peers other than the next and previous stage and carry one
micro-batch across several chunk boundaries between the same two workers,
deliver each message under its key (raypipe.core.ops.message_key); on gloo an exchange leaves each
receive to the op that uses it, under NCCL's rules it waits for all. The ranks are forked
processes reused from test to test (tests/comm/shared_ranks.py), each run joining its groups afresh."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from raypipe.comm.p2p import P2PChannel
from raypipe.comm.step_messages import DeferredReceive
from raypipe.core import ops
from raypipe.core.topology import Topology
from tests.comm.shared_ranks import shared_ranks
from tests.ports import free_port

# per step, the activations of micro-batches 0..2 (shape, dtype): step 2 repeats
# step 1 (all predicted), step 3 changes micro-batch 1's shape and micro-batch 2's
# dtype (stale predictions), step 4 goes back
STEPS = [
    [((2, 3), torch.float32), ((4, 5), torch.float32), ((1,), torch.int64)],
    [((2, 3), torch.float32), ((4, 5), torch.float32), ((1,), torch.int64)],
    [((2, 3), torch.float32), ((4, 7, 2), torch.float32), ((1,), torch.bfloat16)],
    [((2, 3), torch.float32), ((4, 5), torch.float32), ((1,), torch.int64)],
]


# a test's two transports: gloo as it is, and under NCCL's emulation (raypipe.comm.nccl_emulation)
on_gloo_and_under_the_emulation = pytest.mark.parametrize("emulate_nccl", [False, True], ids=["gloo", "nccl-emulation"])


@pytest.fixture(scope="module")
def ranks():
    """Forked ranks (tests/comm/shared_ranks.py's, shared with the other modules that use them)."""
    return shared_ranks()


def run_ops(channel: P2PChannel, stage_ops: list[ops.LoweredOp], key_of: Callable[[ops.LoweredOp], int],
            tensor: Callable[[ops.LoweredOp], torch.Tensor]) -> dict:
    """``stage_ops`` (a worker's lowered messages) on ``channel``, each send of ``tensor(op)``, then
    the sends finished; what each receive got."""
    received = {}
    for op in stage_ops:
        parts = op.unbatched()
        sends = [(part, tensor(part)) for part in parts if part.kind in ops.SENDS]
        receives = [part for part in parts if part.kind in ops.RECEIVES]
        if op.kind == ops.EXCHANGE:
            received.update(zip(receives, map(waited, channel.exchange(sends, receives, key_of, op.header_first))))
        elif op.kind == ops.SEND_ACT:
            channel.send_activation(sends[0][1], key_of(op), op.peer)
        elif op.kind == ops.SEND_GRAD:
            channel.send_gradient(sends[0][1], key_of(op), op.peer)
        elif op.kind == ops.RECV_ACT:
            received[op] = channel.recv_activation(key_of(op), op.peer)
        elif op.kind == ops.RECV_GRAD:
            received[op] = channel.recv_gradient(key_of(op), op.peer)
    channel.finish_sends()
    return received


def activation(step: int, micro_batch: int) -> torch.Tensor:
    shape, dtype = STEPS[step][micro_batch]
    values = torch.arange(torch.Size(shape).numel(), dtype=torch.float64) + 100 * step + 10 * micro_batch
    return values.reshape(shape).to(dtype)


def key(micro_batch: int) -> int:
    """The message key of ``micro_batch``'s activation from stage 0 to stage 1 of a two-stage
    pipeline of one chunk per worker (and of its gradient)."""
    return ops.message_key(micro_batch, 1, 2)


def waited(received: object) -> object:
    """What an exchange's receive got: the value (NCCL's path waits in the exchange), or on gloo what
    its :class:`~raypipe.comm.step_messages.DeferredReceive` gets once waited for."""
    return received.result() if isinstance(received, DeferredReceive) else received


def keys_of(stage: int, num_stages: int, num_chunks: int = 1,
            placement: str = ops.LOOPED) -> Callable[[ops.LoweredOp], int]:
    """Each SEND/RECV op of worker ``stage``'s message key, as the per-step worker makes it."""
    def key_of(op: ops.LoweredOp) -> int:
        boundary = ops.boundary_of(stage, op.chunk, op.kind, num_stages, placement)
        return ops.message_key(op.micro_batch, boundary, num_stages * num_chunks)

    return key_of


def run_stage(rank: int, port: int) -> list[tuple[int, int]]:
    """Stage ``rank`` of STEPS; the (step, micro-batch) of each activation that landed in the receive
    posted ahead for it."""
    posted_ahead = []
    channel = P2PChannel(Topology(num_stages=2), 0, rank, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60)
    try:
        for step in range(len(STEPS)):
            micro_batches = range(len(STEPS[step]))
            if rank == 0:
                for micro_batch in micro_batches:
                    channel.send_activation(activation(step, micro_batch), key(micro_batch), 1)
                for micro_batch in reversed(micro_batches):
                    gradient = channel.recv_gradient(key(micro_batch), 1)
                    torch.testing.assert_close(gradient, -activation(step, micro_batch), rtol=0, atol=0)
            else:
                channel.expect_activations([(key(micro_batch), 0) for micro_batch in micro_batches])
                posted = {message: parts[0] for message, (_, parts) in channel._messages.payloads.items()}
                for micro_batch in micro_batches:
                    received = channel.recv_activation(key(micro_batch), 0)
                    torch.testing.assert_close(received, activation(step, micro_batch), rtol=0, atol=0)
                    if received is posted.get(key(micro_batch)):
                        posted_ahead.append((step, micro_batch))
                for micro_batch in reversed(micro_batches):
                    channel.send_gradient(-activation(step, micro_batch), key(micro_batch), 0)
            channel.finish_sends()
            assert channel.all_reduce_sum([float(rank), 1.0]) == [1.0, 2.0]
    finally:
        channel.leave()
    return posted_ahead


def test_activations_of_any_shape_arrive_and_unchanged_shapes_are_received_ahead(ranks):
    landed = {landing for posted_ahead in ranks.run(run_stage, free_port(), nprocs=2) for landing in posted_ahead}
    # step 0 has no prediction; step 2 predicted micro-batches 1 and 2 wrongly
    assert landed == {(1, 0), (1, 1), (1, 2), (2, 0), (3, 0)}


def run_replicated_stage(rank: int, port: int) -> None:
    """Two replicas of a two-stage pipeline (ranks 0, 1 and 2, 3): each replica's
    stages talk to each other only, each stage's gradients sum over its replicas."""
    topology = Topology(num_stages=2, num_replicas=2)
    replica, stage, _ = topology.coordinates(rank)
    channel = P2PChannel(topology, replica, stage, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60)
    try:
        if stage == 0:
            channel.send_activation(torch.full((3,), float(rank)), key(0), 1)
        else:
            channel.expect_activations([(key(0), 0)])
            torch.testing.assert_close(channel.recv_activation(key(0), 0), torch.full((3,), float(rank - 1)))
        channel.finish_sends()
        # two dtypes and more than one bucket's worth of elements
        gradients = [torch.full((5, 2), 1.0 + rank), torch.arange(4, dtype=torch.float64) * (rank + 1),
                     torch.ones(7_000_000) * rank]
        channel.replicas.finish_gradient_reduction(channel.replicas.start_gradient_reduction(gradients))
        others = [r for r in topology.stage_ranks(stage)]
        torch.testing.assert_close(gradients[0], torch.full((5, 2), sum(1.0 + r for r in others)))
        torch.testing.assert_close(gradients[1], torch.arange(4, dtype=torch.float64) * sum(r + 1 for r in others))
        assert torch.all(gradients[2] == sum(others))
        assert channel.all_reduce_sum([1.0, float(rank)]) == [4.0, 6.0]
        # added in rank order on every worker (the in-process harness's order): another order gives 0.0 or 2.0
        addends = [1e16, 1.0, -1e16, 1.0]
        assert channel.all_reduce_sum([addends[rank]]) == [sum(addends)] == [1.0]
    finally:
        channel.leave()


def test_replicas_keep_to_their_pipeline_and_sum_gradients_per_stage(ranks):
    ranks.run(run_replicated_stage, free_port(), nprocs=4)


def run_statistics_posted_ahead(rank: int, port: int, emulate_nccl: bool) -> list:
    """Four stages' step statistics, their receives posted early in the step (as the step runner
    posts them), stage 0 arriving last (after its last backward); then one stage leaving before it
    sends its numbers, so stage 0 fails instead of waiting on the receive posted for them, and
    leaves in turn, which fails the others. What each rank's reductions returned, or how they
    failed and after how long. The garbage collector is off: a failed wait's leftovers must not
    keep the group's connections open after its worker left it, however late it runs."""
    import gc
    import time
    import traceback

    from raypipe.errors import StepAborted

    gc.disable()
    channel = P2PChannel(Topology(num_stages=4), 0, rank, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60, emulate_nccl=emulate_nccl)
    addends = [1e16, 1.0, -1e16, 1.0]  # added in rank order: another order gives 0.0 or 2.0
    outcomes: list = []
    try:
        for late_s in (0.3, 0.0):
            channel.expect_statistics(2)
            if rank == 0:
                time.sleep(late_s)
            outcomes.append(channel.all_reduce_sum([addends[rank], float(rank)]))
            outcomes.append(channel._messages.pending)
        channel.expect_statistics(2)
        if rank == 3:
            return outcomes  # leaves (finally) as a failed step leaves: its numbers never come
        start = time.monotonic()
        try:
            channel.all_reduce_sum([0.0, 0.0])
            outcomes.append("returned")
        except StepAborted as error:
            outcomes.append(str(error).splitlines()[0])
            traceback.clear_frames(error.__traceback__)  # as the step runner does before it leaves
        outcomes.append(time.monotonic() - start)
    finally:
        channel.leave()
        gc.enable()
    return outcomes


@on_gloo_and_under_the_emulation
def test_the_step_statistics_received_as_the_step_began_are_summed_in_rank_order_and_a_lost_sender_fails_the_step(
        ranks, emulate_nccl):
    """The statistics all-reduce with its receives posted early in the step (P2PChannel.expect_statistics):
    every rank gets the rank-order sum, the same bits, and nothing stays pending; a rank that left
    before sending its numbers fails the first rank's reduction, and its leaving every other's, at
    once (not after the group's 60-s timeout), on gloo and under NCCL's emulation, where a wait
    runs on a thread of the channel's (polled_wait.WaitedOnThread)."""
    outcomes = ranks.run(run_statistics_posted_ahead, free_port(), emulate_nccl, nprocs=4)
    for rank, outcome in enumerate(outcomes):
        assert outcome[:4] == [[1.0, 6.0], False, [1.0, 6.0], False], (rank, outcome)
    assert len(outcomes[3]) == 4
    assert "stage 3 left the step before this reduction completed" in outcomes[0][4], outcomes
    assert all("stage 0 left the step before this reduction completed" in outcome[4] for outcome in outcomes[1:3])
    assert all(outcome[5] < 30 for outcome in outcomes[:3]), outcomes


def run_exchanging_stage(rank: int, port: int, emulate_nccl: bool = False) -> None:
    """Stage ``rank`` of a two-stage 1F1B, run op by op from its lowering: the
    exchanges (a send and the receive behind it) deliver exactly, over gloo's posted
    receives, then over NCCL's path (every operation in a batch, matched in order).
    ``emulate_nccl``: every step under NCCL's emulation (raypipe.comm.nccl_emulation)."""
    from raypipe.comm.matching import InOrder
    from raypipe.core.lowering import lower
    from raypipe.core.schedule import one_f_one_b_schedule

    torch.set_num_threads(1)
    channel = P2PChannel(Topology(num_stages=2), 0, rank, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60, emulate_nccl=emulate_nccl)
    stage_ops = lower(one_f_one_b_schedule(2, 3))[rank]
    assert sum(op.kind == ops.EXCHANGE for op in stage_ops) == 2
    key_of = keys_of(rank, 2)
    try:
        for step in range(2 * len(STEPS)):  # shapes change from step to step: predictions go stale
            if step == len(STEPS) and not emulate_nccl:  # every message of gloo's steps is in: switch (NCCL predicts no shape)
                channel._matching = InOrder()
                channel._messages.sent.clear()
                channel._messages.received.clear()
            shapes = step % len(STEPS)
            received = {}
            if rank == 1:
                channel.expect_activations([(key_of(op), op.peer) for op in ops.unbatch(stage_ops)
                                            if op.kind == ops.RECV_ACT])
            for op in stage_ops:
                if op.kind == ops.EXCHANGE:
                    sends = [(part, (1 if rank == 0 else -1) * activation(shapes, part.micro_batch))
                             for part in op.parts if part.kind in ops.SENDS]
                    receives = [part for part in op.parts if part.kind in ops.RECEIVES]
                    received.update(zip(receives, map(waited, channel.exchange(sends, receives, key_of))))
                elif op.kind == ops.SEND_ACT:
                    channel.send_activation(activation(shapes, op.micro_batch), key_of(op), op.peer)
                elif op.kind == ops.SEND_GRAD:
                    channel.send_gradient(-activation(shapes, op.micro_batch), key_of(op), op.peer)
                elif op.kind == ops.RECV_ACT:
                    received[op] = channel.recv_activation(key_of(op), op.peer)
                elif op.kind == ops.RECV_GRAD:
                    received[op] = channel.recv_gradient(key_of(op), op.peer)
            for op, tensor in received.items():
                sign = 1 if op.kind == ops.RECV_ACT else -1
                torch.testing.assert_close(tensor, sign * activation(shapes, op.micro_batch), rtol=0, atol=0)
            assert len(received) == 3
            channel.finish_sends()
    finally:
        channel.leave()


def test_an_exchange_delivers_its_send_and_its_receive_on_gloo_and_on_nccls_path(ranks):
    ranks.run(run_exchanging_stage, free_port(), nprocs=2)


def test_one_f_one_b_exchanges_deliver_under_the_emulation(ranks):
    """The same steps under NCCL's emulation (raypipe.comm.nccl_emulation, whose own rules are
    tests/comm/test_nccl_emulation.py's)."""
    ranks.run(run_exchanging_stage, free_port(), True, nprocs=2)


def run_deferring_stage(rank: int, port: int, emulate_nccl: bool) -> list[str]:
    """Two workers of two chunks each (interleaved, p = 2): worker 0's exchange receives the activation
    of its chunk 1 and the gradient of its chunk 0, both from worker 1, which sends the gradient only
    once worker 0 has used the activation and told it so. On gloo the exchange waits for neither, and
    the forward that uses the activation waits for it alone; under NCCL's rules (and their emulation)
    the exchange waits for both, as NCCL's batch does, so the gradient goes first there."""
    torch.set_num_threads(1)
    channel = P2PChannel(Topology(num_stages=2), 0, rank, torch.device("cpu"), num_chunks=2)
    channel.join("127.0.0.1", port, timeout_s=30, emulate_nccl=emulate_nccl)
    key_of = keys_of(rank, 2, 2)
    first, activation, gradient, word = torch.ones(2), torch.arange(4.0), -torch.arange(2.0), torch.zeros(1)
    try:
        if rank == 0:
            channel.send_activation(first, key_of(ops.LoweredOp(ops.SEND_ACT, 0, 1)), 1)
            received = channel.exchange([], [ops.LoweredOp(ops.RECV_ACT, 0, 1, chunk=1),
                                             ops.LoweredOp(ops.RECV_GRAD, 0, 1)], key_of)
            kinds = [type(each).__name__ for each in received]
            torch.testing.assert_close(waited(received[0]), activation, rtol=0, atol=0)
            channel.send_activation(word, key_of(ops.LoweredOp(ops.SEND_ACT, 1, 1)), 1)  # "used it"
            torch.testing.assert_close(waited(received[1]), gradient, rtol=0, atol=0)
        else:
            torch.testing.assert_close(channel.recv_activation(key_of(ops.LoweredOp(ops.RECV_ACT, 0, 0)), 0), first)
            channel.send_activation(activation, key_of(ops.LoweredOp(ops.SEND_ACT, 0, 0)), 0)
            if emulate_nccl:  # the exchange waits for both: the word comes only after the gradient
                channel.send_gradient(gradient, key_of(ops.LoweredOp(ops.SEND_GRAD, 0, 0)), 0)
            torch.testing.assert_close(channel.recv_activation(key_of(ops.LoweredOp(ops.RECV_ACT, 1, 0)), 0), word)
            if not emulate_nccl:
                channel.send_gradient(gradient, key_of(ops.LoweredOp(ops.SEND_GRAD, 0, 0)), 0)
            kinds = []
        channel.finish_sends()
        return kinds
    finally:
        channel.leave()


@on_gloo_and_under_the_emulation
def test_on_gloo_an_exchange_leaves_each_receive_to_the_op_that_uses_it(ranks, emulate_nccl):
    exchanged, _ = ranks.run(run_deferring_stage, free_port(), emulate_nccl, nprocs=2)
    assert exchanged == (["Tensor"] * 2 if emulate_nccl else [DeferredReceive.__name__] * 2)


def tree_activation(step: int, micro_batch: int) -> dict:
    """A packed-sequence boundary: hidden states with positions, document ids and a mask beside
    them, a None and a constant; micro-batch 1 changes its sequence length at step 1."""
    length = 5 + (micro_batch == 1) * step
    hidden = torch.arange(2 * length * 3, dtype=torch.float32).reshape(2, length, 3) + 100 * step + 10 * micro_batch
    positions = torch.arange(length, dtype=torch.int64).repeat(2, 1) + micro_batch
    return {"hidden": hidden, "extras": (positions, {"mask": positions % 2 == 0, "aux": None}),
            "scale": 0.5, "bf16": hidden[:, :, 0].to(torch.bfloat16)}


def receive_tree(channel: P2PChannel, micro_batch: int) -> dict:
    """Micro-batch ``micro_batch``'s tree from stage 0: the last one in an exchange that awaits its header
    first (on NCCL's path its payload goes in the exchange's batch, its layout read beforehand)."""
    if micro_batch < 2:
        return channel.recv_activation(key(micro_batch), 0)
    receive = ops.LoweredOp(ops.RECV_ACT, micro_batch, 0)
    return waited(channel.exchange([], [receive], lambda op: key(op.micro_batch), header_first=[receive])[0])


def run_tree_stage(rank: int, port: int, emulate_nccl: bool) -> None:
    channel = P2PChannel(Topology(num_stages=2), 0, rank, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60, emulate_nccl=emulate_nccl)
    try:
        for step in range(2):
            micro_batches = range(3)
            if rank == 0:
                for micro_batch in micro_batches:
                    channel.send_activation(tree_activation(step, micro_batch), key(micro_batch), 1)
                for micro_batch in reversed(micro_batches):
                    gradient = channel.recv_gradient(key(micro_batch), 1)
                    sent = tree_activation(step, micro_batch)
                    # gradients of the floating-point leaves; None for the others (they go forward only)
                    torch.testing.assert_close(gradient["hidden"], -sent["hidden"], rtol=0, atol=0)
                    torch.testing.assert_close(gradient["bf16"], 2 * sent["bf16"], rtol=0, atol=0)
                    assert gradient["extras"][0] is None and gradient["extras"][1] == {"mask": None, "aux": None}
                    assert gradient["scale"] is None
            else:
                channel.expect_activations([(key(micro_batch), 0) for micro_batch in micro_batches])
                for micro_batch in micro_batches:
                    received, sent = receive_tree(channel, micro_batch), tree_activation(step, micro_batch)
                    assert received.keys() == sent.keys() and received["scale"] == 0.5
                    torch.testing.assert_close(received["hidden"], sent["hidden"], rtol=0, atol=0)
                    torch.testing.assert_close(received["bf16"], sent["bf16"], rtol=0, atol=0)
                    torch.testing.assert_close(received["extras"][0], sent["extras"][0], rtol=0, atol=0)
                    assert torch.equal(received["extras"][1]["mask"], sent["extras"][1]["mask"])
                    assert received["extras"][1]["aux"] is None
                for micro_batch in reversed(micro_batches):
                    sent = tree_activation(step, micro_batch)
                    channel.send_gradient({"hidden": -sent["hidden"], "bf16": 2 * sent["bf16"],
                                           "extras": (None, {"mask": None, "aux": None}), "scale": None},
                                          key(micro_batch), 0)
            channel.finish_sends()
    finally:
        channel.leave()


@on_gloo_and_under_the_emulation
def test_a_tree_of_tensors_crosses_the_boundary_and_its_float_leaves_get_gradients(ranks, emulate_nccl):
    ranks.run(run_tree_stage, free_port(), emulate_nccl, nprocs=2)


def test_a_leaf_that_cannot_cross_names_the_stage_and_its_path():
    from raypipe.comm.tree_messages import TreeLeafError, structure_of

    with pytest.raises(TreeLeafError, match=r"^stage 1 output\[1\]\['bad'\] is an object of type object: "):
        structure_of((torch.ones(2), {"bad": object()}), 1, torch.device("cpu"))
    with pytest.raises(TreeLeafError, match=r"^stage 2 output\[0\] is a torch.complex64 tensor"):
        structure_of([torch.ones(2, dtype=torch.complex64)], 2, torch.device("cpu"))


# Interleaved (looped) and ZBV (V-shaped) schedules at p = 3, v = 2, run op by op from their lowering:
# looped, worker 2 sends activations back to worker 0 (no neighbour) and one micro-batch crosses
# boundaries 1 and 4 between workers 0 and 1; V-shaped, worker 0 sends activations to worker 1
# and receives them from it (virtual stages 0 and 5 are both on worker 0)
CHUNKED = [("interleaved_1f1b", ops.LOOPED), ("zbv", ops.V_SHAPED)]
CHUNKED_P, CHUNKED_M, CHUNKED_V = 3, 3, 2  # micro-batches 0..2: one of them odd
CHUNKED_STEPS = 4  # step 1 repeats step 0's shapes (all predicted), step 2 changes some, step 3 goes back


def chunked_activation(step: int, micro_batch: int, boundary: int) -> torch.Tensor:
    """The activation of ``micro_batch`` across ``boundary``: values that name both, a shape of the
    boundary's own, and at step 2 another shape for odd micro-batches and another dtype for micro-batch 2."""
    shape = (2, 1 + boundary) + ((3,) if step == 2 and micro_batch % 2 else ())
    dtype = torch.bfloat16 if step == 2 and micro_batch == 2 else torch.float32
    values = torch.arange(torch.Size(shape).numel(), dtype=torch.float64) + 1000 * step + 100 * micro_batch
    return (values + 10 * boundary).reshape(shape).to(dtype)


def run_chunked_stage(rank: int, port: int, emulated_port: int) -> None:
    """Worker ``rank``'s lowered ops of each of CHUNKED, CHUNKED_STEPS steps each, sending for every
    (micro-batch, boundary) its own tensor (and the negated one back as its gradient), and checking
    that each receive got the tensor its sender sent for it. On gloo, then on the in-order path
    (NCCL's: tags ignored, a pair's messages matched in issue order, the payloads the lowering
    awaits headers for received in the exchange's batch), then in a group joined afresh under NCCL's
    emulation (rendezvous sends, one stream per rank: with every payload received after its batch, the
    ring of workers waited forever there). On gloo an activation whose shape did not change since last
    step lands in the receive posted ahead for its key."""
    from raypipe.comm.matching import InOrder
    from raypipe.core.lowering import lower
    from raypipe.core.schedule import PLACEMENT, make_schedule

    channel = P2PChannel(Topology(num_stages=CHUNKED_P), 0, rank, torch.device("cpu"), num_chunks=CHUNKED_V)
    channel.join("127.0.0.1", port, timeout_s=60)
    try:
        for phase in ("gloo", "in order", "emulated"):
            if phase == "in order":  # every message of gloo's steps is in: switch (NCCL predicts no shape)
                channel._matching = InOrder()
                channel._messages.sent.clear()
                channel._messages.received.clear()
            if phase == "emulated":
                channel.leave()
                channel.join("127.0.0.1", emulated_port, timeout_s=60, emulate_nccl=True)
            for name, placement in CHUNKED:
                assert PLACEMENT[name] == placement
                # another schedule gives keys other messages: forget the predictions, as joining afresh does
                channel._messages.sent.clear()
                channel._messages.received.clear()
                stage_ops = lower(make_schedule(name, CHUNKED_P, CHUNKED_M, CHUNKED_V), placement)[rank]
                key_of = keys_of(rank, CHUNKED_P, CHUNKED_V, placement)

                def tensor(op: ops.LoweredOp, step: int) -> torch.Tensor:
                    """What ``op`` sends or should receive: the activation across its boundary, or its gradient."""
                    boundary = ops.boundary_of(rank, op.chunk, op.kind, CHUNKED_P, placement)
                    sent = chunked_activation(step, op.micro_batch, boundary)
                    return sent if op.kind in (ops.SEND_ACT, ops.RECV_ACT) else -sent

                for step in range(CHUNKED_STEPS):
                    expected = [(key_of(op), op.peer) for op in ops.unbatch(stage_ops) if op.kind == ops.RECV_ACT]
                    channel.expect_activations(expected)
                    posted = {message: parts[0] for message, (_, parts) in channel._messages.payloads.items()}
                    received = run_ops(channel, stage_ops, key_of, lambda op: tensor(op, step))
                    assert len(received) == sum(part.kind in ops.RECEIVES for part in ops.unbatch(stage_ops)) > 0
                    for op, got in received.items():
                        want = tensor(op, step)
                        assert got.dtype == want.dtype, (name, phase, step, op)
                        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} {phase} {step} {op!r}")
                    landed = {op.micro_batch for op in received
                              if op.kind == ops.RECV_ACT and received[op] is posted.get(key_of(op))}
                    # at step 2 micro-batch 1's shape and micro-batch 2's dtype change, at step 3 they change back
                    changed = {1, 2} if step in (2, 3) else set()
                    receiving = {op.micro_batch for op in ops.unbatch(stage_ops) if op.kind == ops.RECV_ACT}
                    if phase == "gloo":  # predicted per key: step 0 has no prediction
                        assert landed == (set() if step == 0 else receiving - changed), (name, step, landed)
                    else:
                        assert landed == set()
    finally:
        channel.leave()


def test_chunked_lowerings_message_peers_beyond_the_neighbours_under_distinct_keys():
    """What the chunked runs below rely on, from the lowering alone."""
    from raypipe.core.lowering import lower
    from raypipe.core.schedule import make_schedule

    looped, v_shaped = (lower(make_schedule(name, CHUNKED_P, CHUNKED_M, CHUNKED_V), placement)
                        for name, placement in CHUNKED)
    last = CHUNKED_P - 1
    assert any(op.kind == ops.SEND_ACT and op.peer == 0 for op in ops.unbatch(looped[last]))
    # one micro-batch crosses two boundaries from worker 0 to worker 1, under two keys
    crossing = [op for op in ops.unbatch(looped[0]) if op.kind == ops.SEND_ACT and op.micro_batch == 0]
    assert [op.peer for op in crossing] == [1, 1]
    assert len({keys_of(0, CHUNKED_P, CHUNKED_V)(op) for op in crossing}) == 2
    # worker 0 is both ends of the V: it sends activations to worker 1 and receives them from it
    first = ops.unbatch(v_shaped[0])
    assert {op.peer for op in first if op.kind in (ops.SEND_ACT, ops.RECV_ACT)} == {1}
    assert {op.kind for op in first if op.kind in (ops.SEND_ACT, ops.RECV_ACT)} == {ops.SEND_ACT, ops.RECV_ACT}
    # both await some headers first: the in-order runs below receive those payloads in the exchange's batch
    assert all(any(op.header_first for ops_of_worker in lowered for op in ops_of_worker)
               for lowered in (looped, v_shaped))


def test_interleaved_and_zbv_lowerings_deliver_every_message_to_its_peer_under_its_key(ranks):
    ranks.run(run_chunked_stage, free_port(), free_port(), nprocs=CHUNKED_P)


def test_a_peer_must_be_another_stage_of_the_pipeline():
    channel = P2PChannel(Topology(num_stages=3), 0, 1, torch.device("cpu"))
    for peer in (1, 3, -1, None):
        with pytest.raises(ValueError, match="stage 1 cannot message"):
            channel.exchange([(ops.LoweredOp(ops.SEND_ACT, 0, 2), torch.ones(1))],
                             [ops.LoweredOp(ops.RECV_GRAD, 0, peer)], keys_of(1, 3))
    with pytest.raises(ValueError, match=r"stage 1 cannot exchange F0 among its sends"):
        channel.exchange([(ops.LoweredOp(ops.F, 0), torch.ones(1))], [], keys_of(1, 3))
    with pytest.raises(ValueError, match="stage 1 cannot message a peer 1"):
        channel.send_activation(torch.ones(1), 0, 1)
    assert not channel._messages.sends and not channel._messages.gradients  # nothing started
