"""raypipe vs torch.distributed.pipelining (PiPPy) on the same 2-stage GPipe step, CPU.

The model is an ``nn.Sequential`` of 8 blocks (Linear 512->2048, GELU, Linear
2048->512), cut into 2 stages of 4 blocks; a global batch of 512 in 8
micro-batches; MSE loss; the same optimizer on both sides; one thread per stage.

* raypipe: ``PipelineTrainer`` on a local Ray instance with 2 logical CPUs.
* PiPPy: ``PipelineStage`` + ``ScheduleGPipe`` on gloo, 2 processes started with
  ``torch.multiprocessing``.

Both sides live for the whole run and take turns (round r: N raypipe steps, then
N PiPPy steps, then the next round), so load from other users of the shared CPU
hits both alike. The figure is median(raypipe step) / median(PiPPy step).
A PiPPy step is timed on rank 0 between two barriers and includes
``optimizer.step()``; a raypipe step is ``trainer.step()`` wall time, which also
includes the optimizer step on every stage.

    python benchmarks/bench_vs_pippy.py --rounds 10 --steps 3
"""
from __future__ import annotations

import argparse
import os
import platform
import queue
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp
from torch import nn

from alternate import add_round_arguments

NUM_BLOCKS = 8
WIDTH, HIDDEN = 512, 2048
NUM_STAGES = 2


def build_model(seed: int = 0) -> nn.Sequential:
    """The benchmark model; the same weights for a given seed, in every process."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
                           for _ in range(NUM_BLOCKS)])


def make_batch(batch_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, WIDTH, generator=generator),
            torch.randn(batch_size, WIDTH, generator=generator))


def make_optimizer(name: str, lr: float = 1e-3):
    """The optimizer factory both sides use: ``factory(params) -> torch.optim.Optimizer``."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"--optimizer {name!r}: expected sgd or adamw")


def stage_blocks(model: nn.Sequential, stage: int) -> nn.Sequential:
    per_stage = NUM_BLOCKS // NUM_STAGES
    return nn.Sequential(*list(model)[stage * per_stage:(stage + 1) * per_stage])


# -- PiPPy side: two gloo processes that run N steps on command --------------------
def pippy_worker(rank: int, port: int, args: argparse.Namespace, commands: list, results) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=NUM_STAGES)
    try:
        module = stage_blocks(build_model(), rank)
        optimizer = make_optimizer(args.optimizer)(list(module.parameters()))
        inputs, targets = make_batch(args.batch_size)
        # Shapes are inferred on the first (warm-up) step.
        stage = PipelineStage(module, rank, NUM_STAGES, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=args.micro_batches, loss_fn=nn.functional.mse_loss)
        last = rank == NUM_STAGES - 1
        while (count := commands[rank].get()) is not None:
            times, losses = [], []
            for _ in range(count):
                step_losses: list[torch.Tensor] = []
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    schedule.step(inputs)
                else:
                    schedule.step(target=targets, losses=step_losses)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                dist.barrier()
                times.append(time.perf_counter() - start)
                if last:
                    losses.append(float(torch.stack(step_losses).detach().mean()))
            results.put((rank, times, losses))
    finally:
        dist.destroy_process_group()


class PippyRunner:
    """The two PiPPy ranks, idle between rounds (blocked on their command queues)."""

    def __init__(self, args: argparse.Namespace) -> None:
        context = mp.get_context("spawn")
        self._commands = [context.Queue() for _ in range(NUM_STAGES)]
        self._results = context.Queue()
        self._procs = mp.start_processes(pippy_worker, args=(_free_port(), args, self._commands, self._results),
                                         nprocs=NUM_STAGES, join=False, start_method="spawn")

    def run(self, steps: int) -> tuple[list[float], list[float]]:
        """Step times (rank 0) and losses (last rank) of ``steps`` steps."""
        for commands in self._commands:
            commands.put(steps)
        by_rank = {}
        while len(by_rank) < NUM_STAGES:
            try:
                rank, times, losses = self._results.get(timeout=1.0)
                by_rank[rank] = (times, losses)
            except queue.Empty:
                self._procs.join(timeout=0)  # re-raises a rank's exception with its traceback
        return by_rank[0][0], by_rank[NUM_STAGES - 1][1]

    def close(self) -> None:
        for commands in self._commands:
            commands.put(None)
        self._procs.join()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- raypipe side ---------------------------------------------------------------
class RaypipeRunner:
    def __init__(self, args: argparse.Namespace) -> None:
        import ray

        import raypipe

        # Objects up to max_direct_call_object_size (Ray's default: 100 KiB) travel inline in
        # task replies; larger ones go through the plasma object store (~1 ms per put+get here).
        system_config = {"max_direct_call_object_size": args.inline_bytes} if args.inline_bytes else {}
        ray.init(num_cpus=NUM_STAGES, include_dashboard=False, logging_level="WARNING", _system_config=system_config)
        config = raypipe.PipelineConfig(num_stages=NUM_STAGES, num_micro_batches=args.micro_batches,
                                        balance=[NUM_BLOCKS // NUM_STAGES] * NUM_STAGES, transport=args.transport)
        self.trainer = raypipe.PipelineTrainer(build_model(), nn.MSELoss(), optimizer=make_optimizer(args.optimizer),
                                               config=config)
        self.inputs, self.targets = make_batch(args.batch_size)

    def run(self, steps: int) -> tuple[list[float], list[float]]:
        times, losses = [], []
        for _ in range(steps):
            start = time.perf_counter()
            result = self.trainer.step(self.inputs, self.targets)
            times.append(time.perf_counter() - start)
            losses.append(result.loss)
        return times, losses

    def close(self) -> None:
        import ray

        self.trainer.shutdown()
        ray.shutdown()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=10, steps=3, warmup=3)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--transport", choices=("object_store", "gloo", "p2p"), default="object_store",
                        help="raypipe's stage-to-stage transport (default object_store)")
    parser.add_argument("--inline-bytes", type=int, default=None,
                        help="Ray's max_direct_call_object_size for the local Ray instance "
                             "(default: Ray's own, 100 KiB); e.g. 1048576 inlines 128 KiB activations")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"{NUM_BLOCKS} blocks {WIDTH}->{HIDDEN}->{WIDTH}, {NUM_STAGES} stages, m={args.micro_batches}, "
          f"batch {args.batch_size}, {args.optimizer}; raypipe transport {args.transport}, "
          f"max_direct_call_object_size {args.inline_bytes or 'Ray default'}")
    pippy = PippyRunner(args)
    raypipe_runner = RaypipeRunner(args)
    try:
        _, first_raypipe = raypipe_runner.run(args.warmup)
        _, first_pippy = pippy.run(args.warmup)
        # Same weights, same data: the first step's loss must agree (the two compute the same thing).
        print(f"first-step loss: raypipe {first_raypipe[0]:.6f}  pippy {first_pippy[0]:.6f}")
        ray_times, pippy_times, round_ratios = [], [], []
        for round_index in range(args.rounds):
            ray_round = raypipe_runner.run(args.steps)[0]
            pippy_round = pippy.run(args.steps)[0]
            ray_times += ray_round
            pippy_times += pippy_round
            round_ratios.append(statistics.median(ray_round) / statistics.median(pippy_round))
            print(f"round {round_index + 1:2d}: raypipe median {1e3 * statistics.median(ray_round):7.1f} ms  "
                  f"pippy median {1e3 * statistics.median(pippy_round):7.1f} ms  ratio {round_ratios[-1]:.3f}")
    finally:
        raypipe_runner.close()
        pippy.close()
    report(ray_times, pippy_times, round_ratios)


def report(ray_times: list[float], pippy_times: list[float], round_ratios: list[float]) -> None:
    ray_median, pippy_median = statistics.median(ray_times), statistics.median(pippy_times)
    ratio = ray_median / pippy_median
    print(f"raypipe step: median {1e3 * ray_median:.1f} ms, min {1e3 * min(ray_times):.1f} ms "
          f"over {len(ray_times)} steps")
    print(f"pippy   step: median {1e3 * pippy_median:.1f} ms, min {1e3 * min(pippy_times):.1f} ms "
          f"over {len(pippy_times)} steps")
    print(f"ratio raypipe/pippy of medians = {ratio:.3f}; of minima = {min(ray_times) / min(pippy_times):.3f}; "
          f"median of per-round ratios = {statistics.median(round_ratios):.3f}")
    print(f"target ratio <= 1.05: {'met' if ratio <= 1.05 else 'MISSED'}")


if __name__ == "__main__":
    main()
