"""Pipeline schedules on timed layers: raypipe against torch.distributed.pipelining.

Every layer is a :class:`raypipe.testing.TimedLayer` whose forward, input-gradient
and weight-gradient each sleep a fixed time (default 4 ms) without using a core,
so p stage processes behave as p devices even on a 2-core machine, and a step's
time is its schedule's critical path plus each system's overhead. Default shape
(issue 42's baseline): p=4 stages, 2 layers per stage, m=8 micro-batches, one
process per stage. With F, B the forward and backward time of a stage, 1F1B's
ideal step is (m+p-1)(F+B) = 11 x 24 ms = 264 ms; no schedule beats m(F+B) = 192 ms
(every stage busy all step).

Contenders, all alive for the whole run and taking turns round by round (so load
from other users of the machine hits all alike):

* raypipe ``PipelineTrainer`` per ``--raypipe-schedules`` entry (default ``gpipe``
  and ``1f1b``), the default p2p transport, balance ``[layers_per_stage] * p``, on
  a private local Ray instance (``address="local"``) with one logical CPU per
  stage actor; its default snapshot of every worker's state each step
  (``--snapshot-every 0``: none, like PiPPy);
* torch.distributed.pipelining on gloo, p processes started with
  ``torch.multiprocessing``, per ``--pippy-schedules`` entry: ``ScheduleGPipe`` and
  ``Schedule1F1B`` with one stage of ``layers_per_stage`` layers per rank;
  ``ScheduleInterleavedZeroBubble`` with one stage per rank too (its ZB1P order with one
  stage a rank: zb_h1's counterpart, as issue 42 names it; with two a rank it would be an
  interleaved zero-bubble schedule raypipe does not run);
  ``ScheduleInterleaved1F1B`` (loop placement: rank r holds stages r and r+p) and
  ``ScheduleZBVZeroBubble`` (V placement: rank r holds stages r and 2p-1-r) with 2
  chunks of ``layers_per_stage / 2`` layers per rank. Its order is the paper's V, as
  raypipe's zbv is from 2m >= 3p - 1 on; with fewer micro-batches raypipe's zbv runs a
  shorter, list-scheduled order (``raypipe.core.list_scheduling``).

Same weights and data everywhere (the first step's loss is printed for each), MSE
loss, SGD. A raypipe step is ``trainer.step()`` wall time on the driver (the commit
included); a PiPPy step is timed on rank 0 between two barriers and includes
``optimizer.step()``. Figures: per contender, the median over rounds of the
round's median step time, with the min-max spread; for each raypipe schedule and
its PiPPy counterpart, the median of the per-round ratios.

    python benchmarks/bench_timed_schedules.py --rounds 5 --steps 3
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch
from torch import nn

from alternate import (add_round_arguments, command_line, print_round_ms, print_table, round_medians, round_ratios,
                       run_rounds, spread)
from bench_vs_pippy import PippyRunner, RaypipeRunner, driver_overhead, make_optimizer, start_ray, timed_steps
from raypipe.core.schedule import SCHEDULES, SINGLE_CHUNK_SCHEDULES

# PiPPy schedule -> chunks (stages) per rank and their placement ("loop": r, r+p; "v": r, 2p-1-r)
PIPPY_SCHEDULES = {
    "ScheduleGPipe": (1, "loop"),
    "Schedule1F1B": (1, "loop"),
    "ScheduleInterleaved1F1B": (2, "loop"),
    "ScheduleInterleavedZeroBubble": (1, "loop"),  # one stage per rank: zb_h1's counterpart
    "ScheduleZBVZeroBubble": (2, "v"),
}
# raypipe schedule -> its PiPPy counterpart, for the ratio column
COUNTERPARTS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                "zbv": "ScheduleZBVZeroBubble", "zb_h1": "ScheduleInterleavedZeroBubble"}


def build_model(args: argparse.Namespace, seed: int = 0) -> nn.Sequential:
    """p x layers_per_stage timed layers; the same weights for a given seed, in every process."""
    from raypipe.testing import timed_model

    torch.manual_seed(seed)
    return timed_model(args.stages * args.layers_per_stage, args.forward_ms / 1e3, args.input_grad_ms / 1e3,
                       args.weight_grad_ms / 1e3, args.width)


def make_batch(args: argparse.Namespace, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(args.batch_size, args.width, generator=generator),
            torch.randn(args.batch_size, args.width, generator=generator))


def stage_indices(name: str, rank: int, num_ranks: int) -> list[int]:
    """The pipeline stages rank ``rank`` holds under PiPPy schedule ``name``, in order."""
    chunks, placement = PIPPY_SCHEDULES[name]
    if chunks == 1:
        return [rank]
    return [rank, 2 * num_ranks - 1 - rank] if placement == "v" else [rank, rank + num_ranks]


# -- PiPPy side: p gloo processes, each holding every schedule's stages --------------
def timed_pippy_worker(rank: int, port: int, args: argparse.Namespace, commands: list, results) -> None:
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.stages)
    try:
        inputs, targets = make_batch(args)
        runs = {}  # schedule name -> (schedule, parameters, optimizer, holds first stage, holds last stage)
        for name in args.pippy_schedules:
            chunks = PIPPY_SCHEDULES[name][0]
            layers = list(build_model(args))  # a fresh copy per schedule: each takes its own optimizer steps
            per_chunk = args.layers_per_stage // chunks
            num_stages = args.stages * chunks
            indices = stage_indices(name, rank, args.stages)
            stages = [pipelining.PipelineStage(nn.Sequential(*layers[i * per_chunk:(i + 1) * per_chunk]), i,
                                               num_stages, torch.device("cpu")) for i in indices]
            parameters = [p for stage in stages for p in stage.submod.parameters()]
            cls = getattr(pipelining, name)
            # a multi-stage schedule takes a list of stages, one stage per rank included
            multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
            schedule = cls(stages if multi else stages[0], n_microbatches=args.micro_batches,
                           loss_fn=nn.functional.mse_loss)
            runs[name] = (schedule, parameters, make_optimizer("sgd")(parameters), 0 in indices,
                          num_stages - 1 in indices)
        while (command := commands[rank].get()) is not None:
            count, name = command
            schedule, parameters, optimizer, first, last = runs[name]

            def step(losses: list[torch.Tensor]) -> None:
                schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                              losses=losses if last else None)

            results.put((rank, *timed_steps(count, step, optimizer, last)))
    finally:
        dist.destroy_process_group()


# -- raypipe side ---------------------------------------------------------------
class TimedRaypipe(RaypipeRunner):
    """One PipelineTrainer on the timed model, running ``schedule`` (steps and shutdown as
    bench_vs_pippy's runner)."""

    def __init__(self, args: argparse.Namespace, schedule: str) -> None:
        # not super().__init__: the timed model takes another config (a schedule, no transport or clipping)
        import raypipe

        # the chunked schedules hold 2 chunks of half a stage's layers per worker (as PiPPy's 2-chunk schedules)
        chunks = 1 if schedule in SINGLE_CHUNK_SCHEDULES else 2
        config = raypipe.PipelineConfig(num_stages=args.stages, num_micro_batches=args.micro_batches,
                                        balance=[args.layers_per_stage // chunks] * (args.stages * chunks),
                                        schedule=schedule, virtual_stages=chunks, snapshot_every=args.snapshot_every)
        self.trainer = raypipe.PipelineTrainer(build_model(args), nn.MSELoss(), optimizer=make_optimizer("sgd"),
                                               config=config)
        self.inputs, self.targets = make_batch(args)
        self.results: list = []  # every StepResult, warm-up included


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=5, steps=3, warmup=2)
    parser.add_argument("--stages", "-p", type=int, default=4, help="pipeline stages = processes (default 4)")
    parser.add_argument("--micro-batches", "-m", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--layers-per-stage", type=int, default=2,
                        help="timed layers per stage; even, as the 2-chunk schedules halve it (default 2)")
    parser.add_argument("--forward-ms", type=float, default=4.0,
                        help="each layer's forward sleep (default 4; 0 for all three: nothing sleeps, so a step "
                             "takes the runtimes' own CPU)")
    parser.add_argument("--input-grad-ms", type=float, default=4.0, help="each layer's input-gradient sleep (default 4)")
    parser.add_argument("--weight-grad-ms", type=float, default=4.0,
                        help="each layer's weight-gradient sleep (default 4)")
    parser.add_argument("--width", type=int, default=8, help="features per layer (default 8)")
    parser.add_argument("--rows-per-micro-batch", type=int, default=4, help="(default 4)")
    parser.add_argument("--raypipe-schedules", nargs="*", default=["gpipe", "1f1b"], choices=SCHEDULES,
                        help="raypipe schedules (default: gpipe 1f1b); interleaved_1f1b and zbv hold 2 chunks of "
                             "half a stage's layers per worker")
    parser.add_argument("--pippy-schedules", nargs="*", choices=sorted(PIPPY_SCHEDULES), default=list(PIPPY_SCHEDULES),
                        help="torch.distributed.pipelining schedules (default: all five)")
    parser.add_argument("--snapshot-every", type=int, default=None,
                        help="raypipe's snapshot_every (default: PipelineConfig's, a snapshot of every worker's "
                             "state every step; 0: none, as PiPPy)")
    parser.set_defaults(inline_bytes=None)  # bench_vs_pippy.start_ray's knob: Ray's default here
    args = parser.parse_args()
    if args.stages < 2 or args.micro_batches < 1:
        parser.error("--stages must be >= 2 and --micro-batches >= 1")
    if args.layers_per_stage < 1 or (args.layers_per_stage % 2 and (any(
            PIPPY_SCHEDULES[name][0] == 2 for name in args.pippy_schedules) or any(
            name not in SINGLE_CHUNK_SCHEDULES for name in args.raypipe_schedules))):
        parser.error("--layers-per-stage must be >= 1, and even for the 2-chunk schedules")
    if args.snapshot_every is None:
        from raypipe import PipelineConfig

        args.snapshot_every = PipelineConfig.snapshot_every
    args.batch_size = args.micro_batches * args.rows_per_micro_batch
    return args


def ideal_ms(args: argparse.Namespace) -> tuple[float, float]:
    """1F1B's (and GPipe's) ideal step (m+p-1)(F+B) and the no-bubble floor m(F+B), in ms."""
    per_micro_batch = args.layers_per_stage * (args.forward_ms + args.input_grad_ms + args.weight_grad_ms)
    return (args.micro_batches + args.stages - 1) * per_micro_batch, args.micro_batches * per_micro_batch


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    one_f_one_b, floor = ideal_ms(args)
    print(command_line())
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; p={args.stages}, m={args.micro_batches}, "
          f"{args.layers_per_stage} timed layers per stage (F {args.forward_ms:g} / I {args.input_grad_ms:g} / "
          f"W {args.weight_grad_ms:g} ms each, width {args.width}), batch {args.batch_size}, sgd; raypipe p2p, "
          f"snapshot_every={args.snapshot_every}; 1F1B ideal (m+p-1)(F+B) = {one_f_one_b:.0f} ms, "
          f"no-bubble floor m(F+B) = {floor:.0f} ms", flush=True)
    pippy = PippyRunner(args, timed_pippy_worker, args.stages) if args.pippy_schedules else None
    start_ray(args, len(args.raypipe_schedules), args.stages)
    raypipe_runners: dict = {}
    try:
        raypipe_runners = {name: TimedRaypipe(args, name) for name in args.raypipe_schedules}
        contenders = {("raypipe", name): (lambda count, r=runner: r.run(count)[0])
                      for name, runner in raypipe_runners.items()}
        contenders |= {("pippy", name): (lambda count, n=name: pippy.run(count, n)[0])
                       for name in args.pippy_schedules}
        # Same weights, same data: every contender's first step has the same loss.
        first = {("raypipe", name): runner.run(1)[1][0] for name, runner in raypipe_runners.items()}
        first |= {("pippy", name): pippy.run(1, name)[1][0] for name in args.pippy_schedules}
        print("first-step loss: " + "  ".join(f"{'/'.join(key)} {loss:.6f}" for key, loss in first.items()),
              flush=True)

        times = run_rounds(contenders, args.rounds, args.steps, args.warmup, print_round_ms(args.steps))
    finally:
        for runner in raypipe_runners.values():
            runner.close()
        import ray

        ray.shutdown()
        if pippy is not None:
            pippy.close()
    report(args, times, {name: runner.results[-args.rounds * args.steps:] for name, runner in raypipe_runners.items()})


def simulated(args: argparse.Namespace, schedule: str) -> tuple[float, float | None]:
    """``simulate_timed`` on the schedule's lowered ops with the layers' sleeps as op times (no message
    time): the step's compute window in ms and its bubble (1 - busy/window, mean over stages), as
    :func:`raypipe.observability.step_report.measured_bubble` measures it; None for the bubble when
    the layers sleep 0 ms (a run that measures the runtimes' own cost per op has no window)."""
    from raypipe.core.lowering import lower
    from raypipe.core.ops import COMPUTE
    from raypipe.core.schedule import PLACEMENT, make_schedule
    from raypipe.core.timed_simulation import simulate_timed

    chunks = 1 if schedule in SINGLE_CHUNK_SCHEDULES else 2
    layers = args.layers_per_stage / chunks
    seconds = {"F": args.forward_ms, "B": args.input_grad_ms + args.weight_grad_ms, "I": args.input_grad_ms,
               "W": args.weight_grad_ms}
    run = simulate_timed(lower(make_schedule(schedule, args.stages, args.micro_batches, chunks), PLACEMENT[schedule]),
                         lambda stage, op: layers * seconds.get(op.kind, 0.0) / 1e3, placement=PLACEMENT[schedule])
    compute = [timed for timed in run.timeline if timed.op.kind in COMPUTE]
    window = max(timed.end for timed in compute) - min(timed.start for timed in compute)
    if window == 0:  # nothing sleeps: no window to be busy in
        return 0.0, None
    busy = [sum(t.end - t.start for t in compute if t.stage == stage) for stage in range(args.stages)]
    return 1e3 * window, statistics.mean(1 - b / window for b in busy)


def report(args: argparse.Namespace, times: dict, results: dict) -> None:
    one_f_one_b, floor = ideal_ms(args)
    bubbles = []
    for name, measured in results.items():
        window_ms, bubble = simulated(args, name)
        per_step = [statistics.mean(result.bubble_fraction) for result in measured]
        simulated_bubble = "—" if bubble is None else f"{100 * bubble:.1f}"
        bubbles.append([f"raypipe {name}", f"{window_ms:.0f}", simulated_bubble,
                        f"{100 * statistics.median(per_step):.1f} [{100 * min(per_step):.1f}-{100 * max(per_step):.1f}]"])
    rows = []
    for key, values in times.items():
        system, name = key
        per_round = [1e3 * t for t in round_medians(values, args.steps)]
        ratio, overhead = "", ""
        counterpart = ("pippy", COUNTERPARTS.get(name, ""))
        if system == "raypipe":
            if counterpart in times:
                ratio = f"{spread(round_ratios(values, times[counterpart], args.steps))} vs {counterpart[1]}"
            overhead = f"{1e3 * statistics.median(driver_overhead(results[name])):.1f}"
        # layers of 0 ms have no ideal step
        of_ideal = f"{statistics.median(per_round) / one_f_one_b:.3f}" if one_f_one_b else "—"
        rows.append([f"{system} {name}", spread(per_round, digits=0), of_ideal,
                     ratio, overhead])
    print()
    print_table(["contender", "step ms, median [min-max] of per-round medians",
                 f"/ 1F1B ideal {one_f_one_b:.0f} ms", "raypipe/PiPPy per-round ratio", "raypipe driver overhead ms"],
                rows)
    print(f"(1F1B ideal (m+p-1)(F+B) = {one_f_one_b:.0f} ms; no-bubble floor m(F+B) = {floor:.0f} ms; "
          f"driver overhead: step time minus the longest worker task, median)")
    print()
    print_table(["schedule", "simulated compute window ms", "simulated bubble %",
                 "measured bubble %, median [min-max] over steps"], bubbles)
    print("(bubble: 1 - busy / compute window (first F start to last backward end), mean over stages)")
    print(command_line())


if __name__ == "__main__":
    main()
