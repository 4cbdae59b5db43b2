"""P2PChannel over gloo between two real processes: activations of changing
shapes and dtypes arrive exactly, gradients come back, and from the second step
on a payload of unchanged shape lands in a receive posted before it was needed."""
from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from raypipe.comm.p2p import P2PChannel

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
    channel = P2PChannel(rank, 2, torch.device("cpu"))
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
