"""P2PChannel over gloo between two real processes: activations of changing
shapes and dtypes arrive exactly, gradients come back, and from the second step
on a payload of unchanged shape lands in a receive posted before it was needed."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from raypipe.comm.p2p import P2PChannel
from raypipe.core.topology import Topology

# per step, the activations of micro-batches 0..2 (shape, dtype): step 2 repeats
# step 1 (all predicted), step 3 changes micro-batch 1's shape and micro-batch 2's
# dtype (stale predictions), step 4 goes back
STEPS = [
    [((2, 3), torch.float32), ((4, 5), torch.float32), ((1,), torch.int64)],
    [((2, 3), torch.float32), ((4, 5), torch.float32), ((1,), torch.int64)],
    [((2, 3), torch.float32), ((4, 7, 2), torch.float32), ((1,), torch.bfloat16)],
    [((2, 3), torch.float32), ((4, 5), torch.float32), ((1,), torch.int64)],
]


def activation(step: int, micro_batch: int) -> torch.Tensor:
    shape, dtype = STEPS[step][micro_batch]
    values = torch.arange(torch.Size(shape).numel(), dtype=torch.float64) + 100 * step + 10 * micro_batch
    return values.reshape(shape).to(dtype)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_stage(rank: int, port: int, posted_ahead: mp.Queue) -> None:
    torch.set_num_threads(1)
    channel = P2PChannel(Topology(num_stages=2), 0, rank, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60)
    try:
        for step in range(len(STEPS)):
            micro_batches = range(len(STEPS[step]))
            if rank == 0:
                for micro_batch in micro_batches:
                    channel.send_activation(activation(step, micro_batch), micro_batch)
                for micro_batch in reversed(micro_batches):
                    gradient = channel.recv_gradient(micro_batch)
                    torch.testing.assert_close(gradient, -activation(step, micro_batch), rtol=0, atol=0)
            else:
                channel.expect_activations(list(micro_batches))
                posted = {mb: buffer for mb, (_, buffer) in channel._payloads.items()}
                for micro_batch in micro_batches:
                    received = channel.recv_activation(micro_batch)
                    torch.testing.assert_close(received, activation(step, micro_batch), rtol=0, atol=0)
                    if received is posted.get(micro_batch):
                        posted_ahead.put((step, micro_batch))
                for micro_batch in reversed(micro_batches):
                    channel.send_gradient(-activation(step, micro_batch), micro_batch)
            channel.finish_sends()
            assert channel.all_reduce_sum([float(rank), 1.0]) == [1.0, 2.0]
    finally:
        channel.leave()


def test_activations_of_any_shape_arrive_and_unchanged_shapes_are_received_ahead():
    context = mp.get_context("spawn")
    posted_ahead = context.Queue()
    mp.start_processes(run_stage, args=(free_port(), posted_ahead), nprocs=2, start_method="spawn")
    landed = set()
    while not posted_ahead.empty():
        landed.add(posted_ahead.get())
    # step 0 has no prediction; step 2 predicted micro-batches 1 and 2 wrongly
    assert landed == {(1, 0), (1, 1), (1, 2), (2, 0), (3, 0)}


def run_replicated_stage(rank: int, port: int) -> None:
    """Two replicas of a two-stage pipeline (ranks 0, 1 and 2, 3): each replica's
    stages talk to each other only, each stage's gradients sum over its replicas."""
    torch.set_num_threads(1)
    topology = Topology(num_stages=2, num_replicas=2)
    replica, stage = topology.coordinates(rank)
    channel = P2PChannel(topology, replica, stage, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60)
    try:
        if stage == 0:
            channel.send_activation(torch.full((3,), float(rank)), 0)
        else:
            channel.expect_activations([0])
            torch.testing.assert_close(channel.recv_activation(0), torch.full((3,), float(rank - 1)))
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
    finally:
        channel.leave()


def test_replicas_keep_to_their_pipeline_and_sum_gradients_per_stage():
    mp.start_processes(run_replicated_stage, args=(free_port(),), nprocs=4, start_method="spawn")


def run_exchanging_stage(rank: int, port: int, emulate_nccl: bool = False) -> None:
    """Stage ``rank`` of a two-stage 1F1B, run op by op from its lowering: the
    exchanges (a send and the receive behind it) deliver exactly, over gloo's posted
    receives, then over NCCL's path (every operation in a batch, matched in order).
    ``emulate_nccl``: every step under NCCL's emulation (raypipe.comm.nccl_emulation)."""
    from raypipe.comm.matching import InOrder
    from raypipe.core import ops
    from raypipe.core.lowering import lower
    from raypipe.core.schedule import one_f_one_b_schedule

    torch.set_num_threads(1)
    channel = P2PChannel(Topology(num_stages=2), 0, rank, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60, emulate_nccl=emulate_nccl)
    stage_ops = lower(one_f_one_b_schedule(2, 3))[rank]
    assert sum(op.kind == ops.EXCHANGE for op in stage_ops) == 2
    try:
        for step in range(2 * len(STEPS)):  # shapes change from step to step: predictions go stale
            if step == len(STEPS) and not emulate_nccl:  # every message of gloo's steps is in: switch (NCCL predicts no shape)
                channel._matching = InOrder()
                channel._sent.clear()
                channel._received.clear()
            shapes = step % len(STEPS)
            received = {}
            if rank == 1:
                channel.expect_activations([op.micro_batch for op in ops.unbatch(stage_ops) if op.kind == ops.RECV_ACT])
            for op in stage_ops:
                if op.kind == ops.EXCHANGE:
                    sends = [(part, (1 if rank == 0 else -1) * activation(shapes, part.micro_batch))
                             for part in op.parts if part.kind in ops.SENDS]
                    receives = [part for part in op.parts if part.kind in ops.RECEIVES]
                    received.update(zip(receives, channel.exchange(sends, receives)))
                elif op.kind == ops.SEND_ACT:
                    channel.send_activation(activation(shapes, op.micro_batch), op.micro_batch)
                elif op.kind == ops.SEND_GRAD:
                    channel.send_gradient(-activation(shapes, op.micro_batch), op.micro_batch)
                elif op.kind == ops.RECV_ACT:
                    received[op] = channel.recv_activation(op.micro_batch)
                elif op.kind == ops.RECV_GRAD:
                    received[op] = channel.recv_gradient(op.micro_batch)
            for op, tensor in received.items():
                sign = 1 if op.kind == ops.RECV_ACT else -1
                torch.testing.assert_close(tensor, sign * activation(shapes, op.micro_batch), rtol=0, atol=0)
            assert len(received) == 3
            channel.finish_sends()
    finally:
        channel.leave()


def test_an_exchange_delivers_its_send_and_its_receive_on_gloo_and_on_nccls_path():
    mp.start_processes(run_exchanging_stage, args=(free_port(),), nprocs=2, start_method="spawn")


def tree_activation(step: int, micro_batch: int) -> dict:
    """A packed-sequence boundary: hidden states with positions, document ids and a mask beside
    them, a None and a constant; micro-batch 1 changes its sequence length at step 1."""
    length = 5 + (micro_batch == 1) * step
    hidden = torch.arange(2 * length * 3, dtype=torch.float32).reshape(2, length, 3) + 100 * step + 10 * micro_batch
    positions = torch.arange(length, dtype=torch.int64).repeat(2, 1) + micro_batch
    return {"hidden": hidden, "extras": (positions, {"mask": positions % 2 == 0, "aux": None}),
            "scale": 0.5, "bf16": hidden[:, :, 0].to(torch.bfloat16)}


def run_tree_stage(rank: int, port: int, emulate_nccl: bool) -> None:
    torch.set_num_threads(1)
    channel = P2PChannel(Topology(num_stages=2), 0, rank, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60, emulate_nccl=emulate_nccl)
    try:
        for step in range(2):
            micro_batches = range(3)
            if rank == 0:
                for micro_batch in micro_batches:
                    channel.send_activation(tree_activation(step, micro_batch), micro_batch)
                for micro_batch in reversed(micro_batches):
                    gradient = channel.recv_gradient(micro_batch)
                    sent = tree_activation(step, micro_batch)
                    # gradients of the floating-point leaves; None for the others (they go forward only)
                    torch.testing.assert_close(gradient["hidden"], -sent["hidden"], rtol=0, atol=0)
                    torch.testing.assert_close(gradient["bf16"], 2 * sent["bf16"], rtol=0, atol=0)
                    assert gradient["extras"][0] is None and gradient["extras"][1] == {"mask": None, "aux": None}
                    assert gradient["scale"] is None
            else:
                channel.expect_activations(list(micro_batches))
                for micro_batch in micro_batches:
                    received, sent = channel.recv_activation(micro_batch), tree_activation(step, micro_batch)
                    assert received.keys() == sent.keys() and received["scale"] == 0.5
                    torch.testing.assert_close(received["hidden"], sent["hidden"], rtol=0, atol=0)
                    torch.testing.assert_close(received["bf16"], sent["bf16"], rtol=0, atol=0)
                    torch.testing.assert_close(received["extras"][0], sent["extras"][0], rtol=0, atol=0)
                    assert torch.equal(received["extras"][1]["mask"], sent["extras"][1]["mask"])
                    assert received["extras"][1]["aux"] is None
                for micro_batch in reversed(micro_batches):
                    sent = tree_activation(step, micro_batch)
                    channel.send_gradient({"hidden": -sent["hidden"], "bf16": 2 * sent["bf16"],
                                           "extras": (None, {"mask": None, "aux": None}), "scale": None}, micro_batch)
            channel.finish_sends()
    finally:
        channel.leave()


@pytest.mark.parametrize("emulate_nccl", [False, True], ids=["gloo", "nccl-emulation"])
def test_a_tree_of_tensors_crosses_the_boundary_and_its_float_leaves_get_gradients(emulate_nccl):
    mp.start_processes(run_tree_stage, args=(free_port(), emulate_nccl), nprocs=2, start_method="spawn")


def test_a_leaf_that_cannot_cross_names_the_stage_and_its_path():
    from raypipe.comm.tree_messages import TreeLeafError, layout_of

    with pytest.raises(TreeLeafError, match=r"^stage 1 output\[1\]\['bad'\] is an object of type object: "):
        layout_of((torch.ones(2), {"bad": object()}), 1, torch.device("cpu"))
    with pytest.raises(TreeLeafError, match=r"^stage 2 output\[0\] is a torch.complex64 tensor"):
        layout_of([torch.ones(2, dtype=torch.complex64)], 2, torch.device("cpu"))
