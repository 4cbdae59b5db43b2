"""The step decision's reduction of gradient statistics over gloo: a ring all-reduce against
``P2PChannel.all_reduce_sum`` itself (a gather to rank 0 and a broadcast).

Every worker adds a few float64 numbers a virtual stage (squared norm, overflow flag, loss
share), so the reduction is all latency. In a 1F1B step stage 0 ends last (its last
backward), while the others already wait in the reduction: what the step pays is the time
from that last arrival to every worker's return. Here ``n`` processes on gloo (no Ray), the
ranks a one-replica pipeline of ``n`` stages, each its own ``P2PChannel``, rank 0 arriving
``--late-ms`` after the others each round; per contender the median
[min-max] over the rounds of (the last worker's return - the late rank's start), in ms.
The contenders alternate round by round in one process group.

    python benchmarks/bench_step_decision.py --ranks 4 8 --rounds 60
"""
from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raypipe.comm.p2p import P2PChannel
from raypipe.core.topology import Topology

NUMBERS = 12  # 3 numbers a virtual stage, 4 virtual stages


def ring_all_reduce(_: P2PChannel, values: list[float]) -> list[float]:
    """What ``all_reduce_sum`` ran before: gloo's all-reduce (a ring) over the same group."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


CONTENDERS = {"gloo ring all_reduce": ring_all_reduce, "P2PChannel.all_reduce_sum (raypipe)": P2PChannel.all_reduce_sum}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    channel = P2PChannel(Topology(num_stages=world), 0, rank, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60)
    late = 0  # stage 0 after its last backward: rank 0 of raypipe's control group, where the gather ends
    seconds = {name: [] for name in CONTENDERS}
    for round_index in range(args.warmup + args.rounds):
        for name, reduce in CONTENDERS.items():
            dist.barrier()
            if rank == late:
                time.sleep(args.late_ms / 1e3)
            start = time.perf_counter()
            total = reduce(channel, [float(rank)] * NUMBERS)
            end = time.perf_counter()
            assert total[0] == world * (world - 1) / 2
            stamps = [torch.empty(2, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(stamps, torch.tensor([start, end], dtype=torch.float64))
            if rank == 0 and round_index >= args.warmup:  # one clock: the processes share the machine's
                seconds[name].append(max(stamp[1].item() for stamp in stamps) - stamps[late][0].item())
    if rank == 0:
        results.put(seconds)
    channel.leave()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8], help="process counts (default 4 8)")
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds (default 60)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first (default 10)")
    parser.add_argument("--late-ms", type=float, default=10.0, help="how late the last rank arrives (default 10)")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    print("| ranks | contender | last arrival to every return, ms: median [min-max] |")
    print("|---|---|---|")
    for world in args.ranks:
        results = context.Queue()
        port = _free_port()
        processes = [context.Process(target=_worker, args=(rank, world, port, args, results)) for rank in range(world)]
        for process in processes:
            process.start()
        seconds = results.get()
        for process in processes:
            process.join()
        for name, samples in seconds.items():
            ms = [s * 1e3 for s in samples]
            print(f"| {world} | {name} | {statistics.median(ms):.2f} [{min(ms):.2f}-{max(ms):.2f}] |")


if __name__ == "__main__":
    main()
