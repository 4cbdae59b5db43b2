"""NCCL's emulation on gloo (raypipe.comm.nccl_emulation), between real processes:
it keeps NCCL's rendezvous rule (two ranks that each send before receiving wait
forever, which gloo alone lets through), and a survivor of a SIGKILLed peer is
never released by the transport, only by an abort from another thread, within
seconds. That 1F1B's lowered exchanges deliver under it is tests/comm/test_p2p.py's
(test_one_f_one_b_exchanges_deliver_under_the_emulation, on that module's ranks)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raypipe.comm.nccl_emulation import EmulatedStream
from raypipe.comm.p2p import P2PChannel
from raypipe.core.topology import Topology
from raypipe.errors import StepAborted
from tests.comm.test_p2p import key
from tests.forked import CONTEXT
from tests.ports import free_port

MESSAGE = 1000  # elements; the emulation treats every message as beyond NCCL's buffering


def run_crossed_sends(rank: int, port: int, results: mp.Queue) -> None:
    """Each rank sends to the other and then receives (1F1B's old order at p=2):
    under the rendezvous rule neither send completes. Then the same, each as one
    batch: both complete."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    stream, peer = EmulatedStream(dist.distributed_c10d._get_default_group()), 1 - rank
    sent, received = torch.full((MESSAGE,), float(rank)), torch.empty(MESSAGE)
    send = stream.start([(dist.isend, sent, peer, 0)])[0]
    receive = stream.start([(dist.irecv, received, peer, 0)])[0]
    time.sleep(2.0)
    results.put(("crossed", rank, send.is_completed(), receive.is_completed()))
    stream.stop()
    # a fresh stream (the old one's thread still waits in gloo for a receive that never comes)
    paired, received = EmulatedStream(dist.new_group(backend="gloo")), torch.empty(MESSAGE)
    work = paired.start([(dist.isend, sent, peer, 0), (dist.irecv, received, peer, 0)])[0]
    deadline = time.monotonic() + 10
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    results.put(("paired", rank, work.is_completed(), bool(torch.all(received == peer))))
    paired.stop()
    results.close()
    results.join_thread()  # delivered before the exit below
    os._exit(0)  # the first stream's gloo wait never ends on its own


def test_crossed_sends_wait_forever_and_paired_ones_complete():
    results = CONTEXT.Queue()
    mp.start_processes(run_crossed_sends, args=(free_port(), results), nprocs=2,
                       start_method=CONTEXT.get_start_method(), join=True)
    seen = sorted(results.get(timeout=5) for _ in range(4))
    assert seen == [("crossed", 0, False, False), ("crossed", 1, False, False),
                    ("paired", 0, True, True), ("paired", 1, True, True)]


def run_pair(rank: int, port: int, killed: mp.Event, results: mp.Queue) -> None:
    """Stage 0 sends an activation and waits for its gradient; stage 1 takes the
    activation and is SIGKILLed instead of answering. Stage 0's health thread
    aborts once told the peer is dead."""
    torch.set_num_threads(1)
    channel = P2PChannel(Topology(num_stages=2), 0, rank, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60, emulate_nccl=True)
    if rank == 1:
        channel.expect_activations([(key(0), 0)])
        channel.recv_activation(key(0), 0)
        os.kill(os.getpid(), signal.SIGKILL)

    def abort_when_killed() -> None:
        killed.wait()
        time.sleep(2.0)  # the transport alone does not release the step meanwhile
        results.put(("blocked before the abort", not released.is_set()))
        channel.abort()

    released = threading.Event()
    threading.Thread(target=abort_when_killed, daemon=True).start()
    channel.send_activation(torch.ones(MESSAGE), key(0), 1)
    try:
        channel.recv_gradient(key(0), 1)
        results.put(("released by", "a gradient"))
    except StepAborted as error:
        released.set()
        results.put(("released by", str(error)))
    results.put(("left at", time.monotonic()))
    channel.leave()


@pytest.mark.cluster
def test_a_survivor_of_a_sigkilled_peer_is_released_only_by_abort_within_10s():
    killed, results = CONTEXT.Event(), CONTEXT.Queue()
    processes = [CONTEXT.Process(target=run_pair, args=(rank, port, killed, results))
                 for port in [free_port()] for rank in (0, 1)]
    for process in processes:
        process.start()
    processes[1].join(60)
    assert processes[1].exitcode == -signal.SIGKILL
    killed_at = time.monotonic()
    killed.set()
    seen = dict(results.get(timeout=30) for _ in range(3))
    processes[0].join(30)
    assert seen["blocked before the abort"] is True
    assert "aborted" in seen["released by"]
    assert seen["left at"] - killed_at < 10
    assert processes[0].exitcode == 0
