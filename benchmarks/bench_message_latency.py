"""A message's latency between two stages on gloo: plain ``torch.distributed`` isend/irecv
against raypipe's ``P2PChannel`` (an activation forward, its gradient back), with the
activation's signature learned (the default: no header) and with a header every time
(a key marked dynamic, as ``boundary_shapes="headers"`` sends).

A 4 x 8 float32 tensor, as ``bench_timed_schedules.py``'s boundaries: the round trip is all
latency, what a pipeline hop pays on top of the compute. Two processes (``--where processes``,
spawned, no Ray) or two Ray actors (``--where ray``, each a stage worker's kind of process),
one ``P2PChannel`` each, joined once; the three contenders alternate round by round, each
round ``--messages`` round trips after ``--warmup``. Per contender: the median [min-max] over
the rounds of each round's median round trip, in ms, and its ratio to plain gloo's in the
same round.

    python benchmarks/bench_message_latency.py --rounds 7 --where processes ray
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from alternate import command_line, free_port, print_table, spread

from raypipe.comm.p2p import P2PChannel
from raypipe.core import ops
from raypipe.core.topology import Topology

PLAIN, LEARNED, HEADERS = "torch.distributed isend/irecv", "P2PChannel, learned signature", "P2PChannel, a header each"
CONTENDERS = (PLAIN, LEARNED, HEADERS)
_PLAIN_TAG = 1 << 20  # far from the channel's own tags


def _round_trips(channel: P2PChannel, contender: str, rank: int, count: int) -> list[float]:
    """``count`` round trips of ``contender`` from stage 0 to stage 1 and back; each one's seconds."""
    peer = 1 - rank
    tensor, received = torch.randn(4, 8), torch.empty(4, 8)
    key = ops.message_key(0 if contender == LEARNED else 1, 1, 2)  # micro-batch 1's key keeps headers
    seconds = []
    for index in range(count):
        if contender != PLAIN and rank == 1:
            channel.expect_activations([(key, 0)])  # as a step posts its activations' receives at its start
        start = time.perf_counter()
        if contender == PLAIN:
            tag = _PLAIN_TAG + index
            if rank == 0:
                dist.isend(tensor, peer, tag=tag).wait()
                dist.irecv(received, peer, tag=tag).wait()
            else:
                dist.irecv(received, peer, tag=tag).wait()
                dist.isend(tensor, peer, tag=tag).wait()
        elif rank == 0:
            channel.send_activation(tensor, key, 1)
            channel.recv_gradient(key, 1)
        else:
            channel.send_gradient(channel.recv_activation(key, 0), key, 0)
        seconds.append(time.perf_counter() - start)
        if contender != PLAIN:
            channel.finish_sends()  # as a step ends
    return seconds


def stage(rank: int, port: int, args: argparse.Namespace) -> dict[str, list[float]] | None:
    """One stage's side of every round; stage 0 returns each contender's per-round median round trip (s)."""
    torch.set_num_threads(1)
    channel = P2PChannel(Topology(num_stages=2), 0, rank, torch.device("cpu"), boundary_shapes="learned")
    channel.join("127.0.0.1", port, timeout_s=60)
    channel.mark_dynamic([ops.message_key(1, 1, 2)])  # both ends, before any message: the HEADERS contender's key
    medians: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    try:
        for round_index in range(args.rounds):
            order = CONTENDERS if round_index % 2 == 0 else tuple(reversed(CONTENDERS))
            for contender in order:
                dist.barrier()
                seconds = _round_trips(channel, contender, rank, args.warmup + args.messages)[args.warmup:]
                medians[contender].append(statistics.median(seconds))
    finally:
        channel.leave()
    return medians if rank == 0 else None


def _in_process(rank: int, port: int, args: argparse.Namespace, results) -> None:
    medians = stage(rank, port, args)
    if medians is not None:
        results.put(medians)


def run_in_processes(args: argparse.Namespace) -> dict[str, list[float]]:
    context = mp.get_context("spawn")
    results, port = context.Queue(), free_port()
    processes = [context.Process(target=_in_process, args=(rank, port, args, results)) for rank in range(2)]
    for process in processes:
        process.start()
    medians = results.get()
    for process in processes:
        process.join()
    return medians


def run_in_ray_actors(args: argparse.Namespace) -> dict[str, list[float]]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        actor = ray.remote(num_cpus=1)(_Stage)
        stages, port = [actor.remote() for _ in range(2)], free_port()
        return ray.get([each.run.remote(__file__, rank, port, args) for rank, each in enumerate(stages)])[0]
    finally:
        ray.shutdown()


class _Stage:
    """A Ray actor running :func:`stage`, which it imports from this file (Ray would pickle
    this script's functions by value)."""

    def run(self, path: str, rank: int, port: int, args: argparse.Namespace) -> dict[str, list[float]] | None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_message_latency", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.stage(rank, port, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds, the contenders alternating (default 7)")
    parser.add_argument("--messages", type=int, default=400, help="timed round trips a round (default 400)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed round trips first, each round (default 50)")
    parser.add_argument("--where", nargs="+", choices=("processes", "ray"), default=["processes", "ray"],
                        help="two spawned processes, two Ray actors, or both (default both)")
    args = parser.parse_args()
    print(command_line())
    rows = []
    for where in args.where:
        medians = run_in_processes(args) if where == "processes" else run_in_ray_actors(args)
        for name in CONTENDERS:
            ratios = [mine / plain for mine, plain in zip(medians[name], medians[PLAIN])]
            rows.append([where, name, spread([seconds * 1e3 for seconds in medians[name]]), spread(ratios, 2)])
    print_table(["where", "contender", "round trip, ms", "/ plain gloo's in the same round"], rows)


if __name__ == "__main__":
    main()
