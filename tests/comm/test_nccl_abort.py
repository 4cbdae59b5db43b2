"""On a real GPU: a P2PChannel on NCCL has its gloo control channel, a wait on a
transfer that never comes is released by an abort from another thread (no
host sync, no destroy that waits), and the channel joins a fresh group after.
One process, one GPU (a receive from itself that no send matches)."""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.comm.test_p2p import free_port


def run_abort_and_rejoin(rank: int, results: mp.Queue) -> None:
    import torch.distributed as dist

    from raypipe.comm.matching import GRADIENT
    from raypipe.comm.p2p import P2PChannel
    from raypipe.core.topology import Topology
    from raypipe.errors import StepAborted

    channel = P2PChannel(Topology(num_stages=1), 0, 0, torch.device("cuda", 0))
    channel.join("127.0.0.1", free_port(), timeout_s=60)
    results.put(("control on gloo", dist.get_backend(channel.control)))
    results.put(("sum", channel.all_reduce_sum([1.0, 2.0])))
    threading.Timer(1.0, channel.abort).start()
    start = time.monotonic()
    try:
        channel._receive(None, (0, (1 << 20,)), 0, GRADIENT, 0)  # no send: waits until aborted
        results.put(("released by", "a message"))
    except StepAborted as error:
        results.put(("released by", str(error)))
    results.put(("seconds", time.monotonic() - start))
    channel.leave()
    channel.join("127.0.0.1", free_port(), timeout_s=60)
    results.put(("sum after rejoining", channel.all_reduce_sum([3.0])))
    channel.leave()


@pytest.mark.gpu
def test_a_wait_on_nccl_is_released_by_abort_and_the_channel_joins_again():
    results = mp.get_context("spawn").Queue()
    mp.start_processes(run_abort_and_rejoin, args=(results,), nprocs=1, start_method="spawn")
    seen = dict(results.get(timeout=10) for _ in range(5))
    assert seen["control on gloo"] == "gloo"
    assert seen["sum"] == [1.0, 2.0]
    assert "aborted" in seen["released by"]
    assert seen["seconds"] < 10
    assert seen["sum after rejoining"] == [3.0]
