"""Driver overhead of the per-step executor (``transport="p2p"``), CPU.

Per step, the driver overhead is the step's wall time on the driver
(``StepResult.step_time``) minus the longest worker task of that step
(``max(stage.task_seconds for stage in StepResult.stages)``, each measured
inside the worker from the task's start to its commit decision). It is what the
driver adds around the workers: splitting the batch, submitting one task per
worker, Ray scheduling and argument transfer, returning the reports, building
the StepResult.

Trainers, alternating round by round on one local Ray instance, each model
once per ``--step-calls``: ``connections`` (the default: the step's arguments go over
a connection from the driver to each worker) and ``tasks`` (one actor task per
worker per step):

* ``small``: 4 x Linear(64, 64) (two per stage), 2 stages, m=4, batch 64: a step is
  almost all overhead, so the share is the largest it gets;
* ``pippy``: bench_vs_pippy.py's preset a (8 blocks 512->2048->512, 2 stages, m=8, batch 512);
* ``ray floor <trainer>``: no trainer, the least any driver pays with one Ray task
  per worker per step: two plain actors, each called once per step with what
  ``run_step`` gets for that trainer's batch (its micro-batches, shipped the same
  way), returning at once. Its "overhead" is that round trip's whole wall time,
  so ``overhead - floor`` is what ``tasks`` adds to Ray's task round trip
  (``connections`` needs no task per step, so it can go below it).

Printed per trainer: the median overhead in ms and its median share of the step
time, each with the min-max spread of the per-round medians. With the default
``snapshot_every=1`` every step also submits each worker's snapshot (for
``tasks``, with its gate call; for ``connections`` the snapshot is the gate call);
``--snapshot-every 0`` leaves them out.

    python benchmarks/bench_driver_overhead.py --rounds 8 --steps 5
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from types import SimpleNamespace

import ray
import torch
from torch import nn

import raypipe
from alternate import add_round_arguments, command_line, print_table, round_medians, run_alternating, spread
from bench_vs_pippy import PRESETS
from bench_vs_pippy import build_model as mlp
from raypipe.comm.task_tensors import as_task_argument
from raypipe.config import STEP_CALLS

NUM_STAGES = 2


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])


def setups(args: argparse.Namespace) -> dict[str, tuple[nn.Module, int, tuple]]:
    """name -> (model, micro-batches, (inputs, targets))."""
    generator = torch.Generator().manual_seed(1)
    preset = SimpleNamespace(**PRESETS["a"])
    return {
        "small": (small_model(), 4, (torch.randn(args.small_batch, 64, generator=generator),
                                     torch.randn(args.small_batch, 64, generator=generator))),
        "pippy": (mlp(preset), preset.micro_batches,
                  (torch.randn(preset.batch_size, preset.width, generator=generator),
                   torch.randn(preset.batch_size, preset.width, generator=generator))),
    }


class RayFloor:
    """Two empty actors called like the per-step executor calls its workers."""

    def __init__(self, micro_batches: int) -> None:
        self.actors = [_Empty.remote() for _ in range(NUM_STAGES)]
        self.micro_batches = micro_batches
        ray.get([actor.run_step.remote() for actor in self.actors])

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> SimpleNamespace:
        start = time.time()
        parts = [[as_task_argument(p) for p in torch.tensor_split(t, self.micro_batches)] for t in (inputs, targets)]
        weights = [1.0 / self.micro_batches] * self.micro_batches
        ray.get([self.actors[0].run_step.remote(0, parts[0], None, None, None),
                 self.actors[1].run_step.remote(0, None, parts[1], weights, None)])
        return SimpleNamespace(step_time=time.time() - start, stages=[SimpleNamespace(task_seconds=0.0)])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


@ray.remote(num_cpus=1)
class _Empty:
    def run_step(self, *args: object) -> None:
        return None


def overhead(result: raypipe.StepResult) -> float:
    return result.step_time - max(stage.task_seconds for stage in result.stages)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=8, steps=5, warmup=3)
    parser.add_argument("--small-batch", type=int, default=64, help="rows per step of the small model (default 64)")
    parser.add_argument("--only", choices=("small", "pippy"), default=None, help="one of the two trainers")
    parser.add_argument("--no-floor", action="store_true", help="without the bare Ray round trip")
    parser.add_argument("--step-calls", choices=STEP_CALLS, nargs="+", default=["connections", "tasks"],
                        help="a trainer per model for each of these step_calls (default: both)")
    parser.add_argument("--snapshot-every", type=int, default=raypipe.PipelineConfig.snapshot_every,
                        help="the trainers' snapshot_every (default: PipelineConfig's, "
                             f"{raypipe.PipelineConfig.snapshot_every}; 0: no snapshots)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    chosen = {name: setup for name, setup in setups(args).items() if args.only in (None, name)}
    ray.init(num_cpus=NUM_STAGES * 3 * len(chosen), include_dashboard=False, logging_level="WARNING")
    print(f"torch {torch.__version__}, ray {ray.__version__}; p2p executor, {NUM_STAGES} stages, SGD, no clipping, "
          f"snapshot_every={args.snapshot_every}; {args.rounds} rounds x {args.steps} steps", flush=True)
    trainers, batches = {}, {}
    for name, (model, m, batch) in chosen.items():
        for step_calls in args.step_calls:
            trainers[f"{name} {step_calls}"], batches[f"{name} {step_calls}"] = raypipe.PipelineTrainer(
                copy.deepcopy(model), nn.MSELoss(), optimizer=lambda params: torch.optim.SGD(params, lr=1e-3),
                config=raypipe.PipelineConfig(num_stages=NUM_STAGES, num_micro_batches=m, transport="p2p",
                                              step_calls=step_calls, snapshot_every=args.snapshot_every)), batch
    if not args.no_floor:
        for name, (_, micro_batches, batch) in chosen.items():
            trainers[f"ray floor {name}"], batches[f"ray floor {name}"] = RayFloor(micro_batches), batch
    results = run_alternating(trainers, batches, args,
                              on_round=lambda index, _: print(f"round {index + 1} done", flush=True))
    rows = []
    for name, res in results.items():
        per_round_ms = [1e3 * v for v in round_medians([overhead(r) for r in res], args.steps)]
        per_round_share = [100 * v for v in round_medians([overhead(r) / r.step_time for r in res], args.steps)]
        step_ms = 1e3 * statistics.median(round_medians([r.step_time for r in res], args.steps))
        rows.append([name, f"{1e3 * statistics.median(overhead(r) for r in res):.1f}", spread(per_round_ms, 1),
                     f"{100 * statistics.median(overhead(r) / r.step_time for r in res):.1f}%",
                     spread(per_round_share, 1), f"{step_ms:.0f}"])
    print()
    print_table(["trainer", "overhead ms (median of steps)", "per-round medians, ms [min-max]",
                 "share of step (median)", "per-round share %, [min-max]", "step ms (orientation)"], rows)
    print(command_line())


if __name__ == "__main__":
    main()
