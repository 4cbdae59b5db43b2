"""raypipe vs torch.distributed.pipelining (PiPPy) on the same 2-stage GPipe step, CPU.

The model is an ``nn.Sequential`` of blocks (Linear width->hidden, GELU, Linear
hidden->width), cut into 2 equal stages; a global batch in m micro-batches; MSE
loss; the same optimizer on both sides; one thread per stage. Two presets:

* ``--preset a`` (default): 8 blocks 512->2048->512, batch 512, m=8 (64 rows per
  micro-batch); a raypipe step is ~0.5 s on one core per stage.
* ``--preset b``: 8 blocks 256->1024->256, batch 512, m=8: a quarter of the FLOPs
  (a raypipe step of ~100-200 ms here), so fixed per-step and per-op costs weigh ~4x more.

Contenders, all alive for the whole run and taking turns round by round (round r:
N steps of each raypipe variant, then N steps of each PiPPy variant), so load
from other users of the shared CPU hits all alike:

* raypipe ``PipelineTrainer`` on a local Ray instance (2 logical CPUs per trainer),
  one per ``--transports`` entry (default: ``p2p``, the default executor, and
  ``object_store``, the per-op executor), each without and with
  ``clip_grad_norm`` (``--clip``);
  raypipe takes its default snapshot of every worker's state each step
  (``--snapshot-every 0``: none, like PiPPy);
* PiPPy ``PipelineStage`` + ``ScheduleGPipe`` on gloo, 2 processes started with
  ``torch.multiprocessing``; its "clip" variant clips by the global norm the way
  raypipe does (each rank's gradient norm, one all-reduce of the squares,
  ``clip_grads_with_norm_``), which PiPPy itself leaves to the user.

The figure for each raypipe variant is the median over rounds of
median(raypipe steps in the round) / median(PiPPy steps in the round), PiPPy
with the same clip setting, with the min-max spread over rounds. A PiPPy step
is timed on rank 0 between two barriers and includes ``optimizer.step()``; a
raypipe step is ``trainer.step()`` wall time, which includes the commit (global
gradient norm, clipping, optimizer step) on every stage. For p2p variants the
driver overhead, step time minus the longest worker task
(``StepResult.stages[i].task_seconds``), is printed too.

    python benchmarks/bench_vs_pippy.py --rounds 8 --steps 3
    python benchmarks/bench_vs_pippy.py --preset b --rounds 8 --steps 3
"""
from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp
from torch import nn

from alternate import (add_round_arguments, command_line, free_port, print_round_ms, print_table, round_medians,
                       round_ratios, run_rounds, spread)

NUM_STAGES = 2
# preset -> model and batch; target is the largest acceptable median raypipe/PiPPy ratio
PRESETS = {
    "a": {"blocks": 8, "width": 512, "hidden": 2048, "batch_size": 512, "micro_batches": 8, "target": 1.00},
    "b": {"blocks": 8, "width": 256, "hidden": 1024, "batch_size": 512, "micro_batches": 8, "target": 1.03},
}
CLIP_MODES = {"off": None, "on": 1.0}  # name -> max norm (raypipe's clip_grad_norm)


def build_model(args: argparse.Namespace, seed: int = 0) -> nn.Sequential:
    """The benchmark model; the same weights for a given seed, in every process."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.hidden), nn.GELU(),
                                         nn.Linear(args.hidden, args.width)) for _ in range(args.blocks)])


def make_batch(args: argparse.Namespace, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(args.batch_size, args.width, generator=generator),
            torch.randn(args.batch_size, args.width, generator=generator))


def make_optimizer(name: str, lr: float = 1e-3):
    """The optimizer factory both sides use: ``factory(params) -> torch.optim.Optimizer``."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"--optimizer {name!r}: expected sgd or adamw")


def stage_blocks(model: nn.Sequential, stage: int) -> nn.Sequential:
    per_stage = len(model) // NUM_STAGES
    return nn.Sequential(*list(model)[stage * per_stage:(stage + 1) * per_stage])


# -- PiPPy side: two gloo processes that run N steps on command --------------------
def pippy_worker(rank: int, port: int, args: argparse.Namespace, commands: list, results) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=NUM_STAGES)
    try:
        module = stage_blocks(build_model(args), rank)
        parameters = list(module.parameters())
        optimizer = make_optimizer(args.optimizer)(parameters)
        inputs, targets = make_batch(args)
        # Shapes are inferred on the first (warm-up) step.
        stage = PipelineStage(module, rank, NUM_STAGES, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=args.micro_batches, loss_fn=nn.functional.mse_loss)
        last = rank == NUM_STAGES - 1
        while (command := commands[rank].get()) is not None:
            count, max_norm = command

            def step(losses: list[torch.Tensor]) -> None:
                if rank == 0:
                    schedule.step(inputs)
                else:
                    schedule.step(target=targets, losses=losses)
                if max_norm is not None:  # global-norm clipping, as raypipe does it
                    squared = get_total_norm([p.grad for p in parameters]).float().pow(2)
                    dist.all_reduce(squared)
                    clip_grads_with_norm_(parameters, max_norm, squared.sqrt())

            results.put((rank, *timed_steps(count, step, optimizer, last)))
    finally:
        dist.destroy_process_group()


def timed_steps(count: int, step: Callable[[list[torch.Tensor]], None], optimizer: torch.optim.Optimizer,
                last: bool) -> tuple[list[float], list[float]]:
    """``count`` PiPPy steps on this rank, each timed between two barriers of every rank:
    ``step(losses)`` (the schedule's step, appending the last stage's micro-batch losses to
    ``losses``), then the optimizer's. Returns the step times and, on the rank that holds the
    last stage (``last``), each step's mean loss (else none)."""
    import torch.distributed as dist

    times, losses = [], []
    for _ in range(count):
        step_losses: list[torch.Tensor] = []
        dist.barrier()
        start = time.perf_counter()
        step(step_losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - start)
        if last:
            losses.append(float(torch.stack(step_losses).detach().mean()))
    return times, losses


class PippyRunner:
    """PiPPy's ranks, idle between rounds (blocked on their command queues).

    ``worker(rank, port, args, commands, results)`` runs in each of ``num_ranks``
    spawned processes: it takes ``(steps, option)`` commands from ``commands[rank]``
    until ``None``, and answers each with ``(rank, step times, losses)`` on ``results``
    (losses empty on ranks without the last stage). ``option`` is the worker's own:
    here the max norm to clip to, a schedule's name in bench_timed_schedules.py."""

    def __init__(self, args: argparse.Namespace, worker=None, num_ranks: int = NUM_STAGES) -> None:
        context = mp.get_context("spawn")
        self._num_ranks = num_ranks
        self._commands = [context.Queue() for _ in range(num_ranks)]
        self._results = context.Queue()
        self._procs = mp.start_processes(worker or pippy_worker,
                                         args=(free_port(), args, self._commands, self._results),
                                         nprocs=num_ranks, join=False, start_method="spawn")

    def run(self, steps: int, option=None) -> tuple[list[float], list[float]]:
        """Step times (rank 0) and losses (the rank that computed them) of ``steps`` steps."""
        for commands in self._commands:
            commands.put((steps, option))
        by_rank = {}
        while len(by_rank) < self._num_ranks:
            try:
                rank, times, losses = self._results.get(timeout=1.0)
                by_rank[rank] = (times, losses)
            except queue.Empty:
                self._procs.join(timeout=0)  # re-raises a rank's exception with its traceback
        return by_rank[0][0], next((by_rank[rank][1] for rank in sorted(by_rank) if by_rank[rank][1]), [])

    def close(self) -> None:
        for commands in self._commands:
            commands.put(None)
        self._procs.join()


# -- raypipe side ---------------------------------------------------------------
def start_ray(args: argparse.Namespace, trainers: int, stages: int = NUM_STAGES) -> None:
    """A private local Ray instance (never another session's) with one logical CPU per
    stage actor of every trainer; ``args.inline_bytes`` sets its inline-object limit."""
    import ray

    # Objects up to max_direct_call_object_size (Ray's default: 100 KiB) travel inline in
    # task replies; larger ones go through the plasma object store (~1 ms per put+get here).
    system_config = {"max_direct_call_object_size": args.inline_bytes} if args.inline_bytes else {}
    # one logical CPU per stage actor of every trainer; only one trainer computes at a time
    ray.init(address="local", num_cpus=stages * trainers, include_dashboard=False, logging_level="WARNING",
             _system_config=system_config)


class RaypipeRunner:
    def __init__(self, args: argparse.Namespace, transport: str, max_norm: float | None) -> None:
        import raypipe

        config = raypipe.PipelineConfig(num_stages=NUM_STAGES, num_micro_batches=args.micro_batches,
                                        balance=[args.blocks // NUM_STAGES] * NUM_STAGES, transport=transport,
                                        clip_grad_norm=max_norm, snapshot_every=args.snapshot_every)
        self.trainer = raypipe.PipelineTrainer(build_model(args), nn.MSELoss(), optimizer=make_optimizer(args.optimizer),
                                               config=config)
        self.inputs, self.targets = make_batch(args)
        self.results: list = []  # every StepResult, warm-up included

    def run(self, steps: int) -> tuple[list[float], list[float]]:
        times, losses = [], []
        for _ in range(steps):
            start = time.perf_counter()
            result = self.trainer.step(self.inputs, self.targets)
            times.append(time.perf_counter() - start)
            losses.append(result.loss)
            self.results.append(result)
        return times, losses

    def close(self) -> None:
        self.trainer.shutdown()


def driver_overhead(results: list) -> list[float]:
    """Per p2p step: step time minus the longest worker task (seconds)."""
    return [r.step_time - max(s.task_seconds for s in r.stages) for r in results]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=8, steps=3, warmup=3)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="a", help="model and batch (default a)")
    for name in ("blocks", "width", "hidden", "batch_size", "micro_batches"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="override the preset's")
    parser.add_argument("--target", type=float, default=None, help="target ratio (default: the preset's)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--transports", nargs="+", choices=("p2p", "object_store", "gloo"),
                        default=["p2p", "object_store"], help="raypipe transports (default p2p object_store)")
    parser.add_argument("--clip", nargs="+", choices=sorted(CLIP_MODES), default=["off", "on"],
                        help="clip_grad_norm off (None) and/or on (1.0), on both sides (default: off on)")
    parser.add_argument("--snapshot-every", type=int, default=None,
                        help="raypipe's snapshot_every (default: PipelineConfig's, a snapshot of every worker's "
                             "state every step; 0: none, as PiPPy, which keeps no state to heal from)")
    parser.add_argument("--inline-bytes", type=int, default=None,
                        help="Ray's max_direct_call_object_size for the local Ray instance "
                             "(default: Ray's own, 100 KiB); e.g. 1048576 inlines 128 KiB activations")
    args = parser.parse_args()
    if args.snapshot_every is None:
        from raypipe import PipelineConfig

        args.snapshot_every = PipelineConfig.snapshot_every
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.blocks % NUM_STAGES:
        parser.error(f"--blocks must be divisible by {NUM_STAGES}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"preset {args.preset}: {args.blocks} blocks {args.width}->{args.hidden}->{args.width}, "
          f"{NUM_STAGES} stages, m={args.micro_batches}, batch {args.batch_size}, {args.optimizer}; raypipe "
          f"transports {args.transports}, clip {args.clip}, snapshot_every={args.snapshot_every}, "
          f"max_direct_call_object_size {args.inline_bytes or 'Ray default'}", flush=True)
    variants = [(transport, clip) for transport in args.transports for clip in args.clip]
    pippy = PippyRunner(args)
    start_ray(args, len(variants))
    raypipe_runners: dict = {}
    try:
        raypipe_runners = {variant: RaypipeRunner(args, variant[0], CLIP_MODES[variant[1]]) for variant in variants}
        contenders = {("raypipe",) + variant: (lambda count, r=runner: r.run(count)[0])
                      for variant, runner in raypipe_runners.items()}
        contenders |= {("pippy", clip): (lambda count, c=clip: pippy.run(count, CLIP_MODES[c])[0]) for clip in args.clip}
        # Same weights, same data: the first step's loss must agree (the two compute the same thing).
        first_raypipe = next(iter(raypipe_runners.values())).run(1)[1][0]
        first_pippy = pippy.run(1)[1][0]
        print(f"first-step loss: raypipe {first_raypipe:.6f}  pippy {first_pippy:.6f}", flush=True)

        times = run_rounds(contenders, args.rounds, args.steps, args.warmup, print_round_ms(args.steps))
    finally:
        for runner in raypipe_runners.values():
            runner.close()
        import ray

        ray.shutdown()
        pippy.close()
    report(args, times, {variant: runner.results[-args.rounds * args.steps:]
                         for variant, runner in raypipe_runners.items()})


def report(args: argparse.Namespace, times: dict, results: dict) -> None:
    target = args.target if args.target is not None else PRESETS[args.preset]["target"]
    rows, met = [], {}
    for key, values in times.items():
        if key[0] != "raypipe":
            continue
        transport, clip = key[1:]
        ratios = round_ratios(values, times[("pippy", clip)], args.steps)
        met[key] = statistics.median(ratios) <= target
        overhead = ""
        if transport == "p2p":
            per_step = driver_overhead(results[(transport, clip)])
            share = [o / r.step_time for o, r in zip(per_step, results[(transport, clip)])]
            overhead = f"{1e3 * statistics.median(per_step):.1f} ms ({100 * statistics.median(share):.1f}%)"
        rows.append([f"raypipe {transport}", clip, spread(ratios),
                     f"{1e3 * statistics.median(round_medians(values, args.steps)):.0f}",
                     f"{1e3 * statistics.median(round_medians(times[('pippy', clip)], args.steps)):.0f}",
                     overhead, "met" if met[key] else "MISSED"])
    print()
    print_table(["raypipe", "clip_grad_norm", "raypipe/PiPPy (median [min-max] of per-round ratios)",
                 "raypipe ms", "PiPPy ms", "driver overhead (median, share)", f"<= {target:.2f}"], rows)
    print("(ms columns: median of per-round medians, for orientation only; the machine is shared)")
    print(command_line())


if __name__ == "__main__":
    main()
