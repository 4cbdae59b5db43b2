"""On a real GPU: a P2PChannel on NCCL has its gloo control channel, a wait on NCCL
work that has not completed is released by an abort from another thread (no host
sync, no destroy that waits), and the channel joins a fresh group after.

Two forms:

- one GPU: NCCL refuses a receive from oneself that no send in the same group call
  matches ("Trying to recv to self without a matching send", NCCL 2.28.9 on an H200,
  2026-12-04), so a world of one rank has no transfer that never comes. The pending
  work is instead an all-reduce queued behind a kernel that spins for ~10 s on the
  device (``torch.cuda._sleep``): the wait is released by the abort long before it;
- two GPUs (``gpus2``): stage 0 receives a gradient that stage 1 never sends.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.ports import free_ports

SPIN_SECONDS = 10.0  # how long the device is kept busy ahead of the pending all-reduce
ABORT_AFTER_S = 1.0


def _spin_cycles(seconds: float) -> int:
    """Clock cycles of ``torch.cuda._sleep`` that take about ``seconds`` at the device's
    highest SM clock (a lower clock only makes the spin longer)."""
    import subprocess

    try:
        mhz = float(subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits",
                                    "-i", "0"], capture_output=True, text=True, timeout=30).stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        mhz = 2000.0  # Hopper's ~1980 MHz: an unknown card's spin may be shorter or longer
    return int(seconds * mhz * 1e6)


def reported(run: Callable, processes: int, reports: int) -> dict[str, Any]:
    """What ``run`` (rank, queue, port, rejoin port) put on its queue, as (what, value) pairs, once
    ``processes`` of it (one a GPU) have ended."""
    results = mp.get_context("spawn").Queue()
    mp.start_processes(run, args=(results, *free_ports(2)), nprocs=processes, start_method="spawn")
    return dict(results.get(timeout=10) for _ in range(reports))


def run_abort_of_pending_work(rank: int, results: mp.Queue, port: int, rejoin_port: int) -> None:
    import torch.distributed as dist

    from raypipe.comm.p2p import P2PChannel
    from raypipe.core.topology import Topology
    from raypipe.errors import StepAborted

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    channel = P2PChannel(Topology(num_stages=1), 0, 0, device)
    channel.join("127.0.0.1", port, timeout_s=60)
    results.put(("control on gloo", dist.get_backend(channel.control)))
    results.put(("data on nccl", dist.get_backend()))
    results.put(("sum", channel.all_reduce_sum([1.0, 2.0])))
    values = torch.ones(1 << 20, device=device)
    torch.cuda._sleep(_spin_cycles(SPIN_SECONDS))  # the NCCL stream waits for this stream's kernels
    work = dist.all_reduce(values, async_op=True)
    results.put(("pending before the abort", not work.is_completed()))
    threading.Timer(ABORT_AFTER_S, channel.abort).start()
    start = time.monotonic()
    try:
        channel._waits.wait(work, None, 0, "gradient")
        results.put(("released by", "the all-reduce completing"))
    except StepAborted as error:
        results.put(("released by", str(error)))
    results.put(("seconds", time.monotonic() - start))
    torch.cuda.synchronize()  # the spin ends; nothing may hang or fault after the abort
    channel.leave()
    channel.join("127.0.0.1", rejoin_port, timeout_s=60)
    results.put(("sum after rejoining", channel.all_reduce_sum([3.0])))
    again = torch.full((1024,), 2.0, device=device)
    dist.all_reduce(again)
    results.put(("nccl all-reduce after rejoining", again[0].item()))
    channel.leave()


@pytest.mark.gpu
def test_a_wait_on_pending_nccl_work_is_released_by_abort_and_the_channel_joins_again():
    seen = reported(run_abort_of_pending_work, processes=1, reports=8)
    assert seen["control on gloo"] == "gloo" and seen["data on nccl"] == "nccl"
    assert seen["sum"] == [1.0, 2.0]
    assert seen["pending before the abort"], "the all-reduce completed before the abort: the test tested nothing"
    assert "aborted" in seen["released by"]
    assert seen["seconds"] < SPIN_SECONDS / 2, seen["seconds"]  # by the abort, not by the spin's end
    assert seen["sum after rejoining"] == [3.0]
    assert seen["nccl all-reduce after rejoining"] == 2.0


def run_never_sent_gradient(rank: int, results: mp.Queue, port: int, rejoin_port: int) -> None:
    import torch.distributed as dist

    from raypipe.comm.matching import GRADIENT
    from raypipe.comm.p2p import P2PChannel
    from raypipe.core.topology import Topology
    from raypipe.errors import StepAborted

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    channel = P2PChannel(Topology(num_stages=2), 0, rank, device)
    channel.join("127.0.0.1", port, timeout_s=60)
    if rank == 0:
        threading.Timer(ABORT_AFTER_S, channel.abort).start()
        start = time.monotonic()
        try:
            channel._receive(None, (0, (1 << 20,)), 1, GRADIENT, 0)  # stage 1 never sends it
            results.put(("released by", "a message"))
        except StepAborted as error:
            results.put(("released by", str(error)))
        results.put(("seconds", time.monotonic() - start))
    else:
        time.sleep(ABORT_AFTER_S + 2.0)  # after stage 0's release: its wait is ended by its own abort
        channel.abort()  # the controller aborts every member of a failed step's group
    channel.leave()
    channel.join("127.0.0.1", rejoin_port, timeout_s=60)
    total = channel.all_reduce_sum([float(rank + 1)])
    gradient = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(gradient)
    if rank == 0:
        results.put(("sum after rejoining", total))
        results.put(("nccl all-reduce after rejoining", gradient[0].item()))
    channel.leave()


@pytest.mark.gpu
@pytest.mark.gpus2
def test_a_receive_that_no_peer_sends_is_released_by_abort_and_both_stages_join_again():
    seen = reported(run_never_sent_gradient, processes=2, reports=4)
    assert "aborted" in seen["released by"]
    assert seen["seconds"] < 10
    assert seen["sum after rejoining"] == [3.0]
    assert seen["nccl all-reduce after rejoining"] == 3.0
