"""The step decision's reduction of gradient statistics over gloo: a ring all-reduce, a gather to
rank 0 and a broadcast, and ``P2PChannel.all_reduce_sum`` itself (each rank's numbers sent to
rank 0, which adds them in rank order and sends the sum back), its receives posted when the
reduction is called or, as the step runner posts them, early in the step
(``P2PChannel.expect_statistics``).

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
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from alternate import free_port

from raypipe.comm.p2p import P2PChannel
from raypipe.core.topology import Topology

NUMBERS = 12  # 3 numbers a virtual stage, 4 virtual stages


def ring_all_reduce(_: P2PChannel, values: list[float]) -> list[float]:
    """What ``all_reduce_sum`` ran first: gloo's all-reduce (a ring) over the same group."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def gather_and_broadcast(_: P2PChannel, values: list[float]) -> list[float]:
    """What ``all_reduce_sum`` ran next: gloo's gather to rank 0, the sum in rank order, gloo's broadcast."""
    tensor = torch.tensor(values, dtype=torch.float64)
    first = dist.get_rank() == 0
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())] if first else None
    dist.gather(tensor, parts, group_dst=0)
    if first:
        tensor = parts[0]
        for part in parts[1:]:
            tensor += part
    dist.broadcast(tensor, group_src=0)
    return tensor.tolist()


# name -> (the reduction, whether its receives are posted early in the step, before the late rank's wait)
CONTENDERS = {"gloo ring all_reduce": (ring_all_reduce, False),
              "gather + broadcast": (gather_and_broadcast, False),
              "P2PChannel.all_reduce_sum, receives posted at the call": (P2PChannel.all_reduce_sum, False),
              "P2PChannel.all_reduce_sum, receives posted ahead (raypipe's step)": (P2PChannel.all_reduce_sum, True)}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    channel = P2PChannel(Topology(num_stages=world), 0, rank, torch.device("cpu"))
    channel.join("127.0.0.1", port, timeout_s=60)
    late = 0  # stage 0 after its last backward: rank 0 of raypipe's control group, where the gather ends
    seconds = {name: [] for name in CONTENDERS}
    for round_index in range(args.warmup + args.rounds):
        for name, (reduce, ahead) in CONTENDERS.items():
            dist.barrier()
            if ahead:  # as the step runner does at the step's start
                channel.expect_statistics(NUMBERS)
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
        port = free_port()
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
