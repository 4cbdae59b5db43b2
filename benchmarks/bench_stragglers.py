"""A slow worker under each ``on_slow`` policy: step-time curves on timed layers.

Four trainers alive for the whole run, taking turns ``--chunk`` steps at a time (so load from other
users of the machine hits them alike): the same pipeline (timed layers, ``--layers-per-stage`` a
stage, ``--stages`` x ``--replicas``, ``--micro-batches``, ``slow_steps=--slow-steps``) unslowed; with
replica 0's last stage slowed ``--factor`` x from its step ``--slow-from``
(:func:`raypipe.testing.fault_injection.slow_down_worker`: its sleeps, not its arithmetic) and
``on_slow="report"``; the same with ``on_slow="replace"`` and a warm spare; and with
``on_slow="rebalance"`` and no spare. The slowdown stands for the place's cause (a throttled device):
a rebalance starts every worker again in its bundle, and the new worker in the slow place is slowed
again after its first step (a spare, which ``replace`` takes, is not).

Printed per policy: the median step time before the slowdown, while slow, and from 5 steps after it
was found (or swapped, or rebalanced) to the end; the step it was found at; the step before which it
was swapped or rebalanced; the share of the slowdown's cost the policy won back ((report - policy) /
(report - unslowed), over the last window); the largest relative difference of a loss from the
unslowed run's (0: bitwise; a rebalance changes the partition, so within 1e-5). ``--plot`` draws the
four step-time curves.

    python benchmarks/bench_stragglers.py --plot benchmarks/stragglers.png
"""
from __future__ import annotations

import argparse
import logging
import statistics

from alternate import command_line, print_table, run_rounds

POLICIES = ("unslowed", "report", "replace", "rebalance")
ACTED = ("raypipe: swapped slow", "raypipe: rebalanced away from slow")  # the log lines of replace and rebalance


class SwapLines(logging.Handler):
    """The steps before which the running contender swapped a slow worker or rebalanced away from it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.current: str | None = None
        self.step = 0
        self.swapped: dict[str, int] = {}
        self.lines: dict[str, str] = {}  # the line it logged

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(ACTED) and self.current is not None:
            self.swapped.setdefault(self.current, self.step)
            self.lines.setdefault(self.current, record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4, help="per replica (default 4)")
    parser.add_argument("--layers-per-stage", type=int, default=4, help="timed layers a stage (default 4)")
    parser.add_argument("--layer-ms", type=float, default=2.5, help="each layer's F, I and W sleep (default 2.5)")
    parser.add_argument("--steps", type=int, default=80, help="steps per policy (default 80)")
    parser.add_argument("--slow-from", type=int, default=20, help="the step the worker slows at (default 20)")
    parser.add_argument("--factor", type=float, default=2.0, help="how much slower (default 2)")
    parser.add_argument("--slow-steps", type=int, default=10, help="PipelineConfig.slow_steps (default 10)")
    parser.add_argument("--chunk", type=int, default=5, help="steps per turn (default 5)")
    parser.add_argument("--plot", default=None, help="a PNG of the step-time curves")
    args = parser.parse_args()

    import ray
    import torch
    from torch import nn

    import raypipe
    from raypipe.runtime.cluster import LOCAL_SYSTEM_CONFIG
    from raypipe.testing import timed_model
    from raypipe.testing.fault_injection import slow_down_worker

    print(command_line())
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", _system_config=LOCAL_SYSTEM_CONFIG,
             num_cpus=len(POLICIES) * args.stages * args.replicas + 1)
    swaps = SwapLines()
    logging.getLogger("raypipe").addHandler(swaps)
    generator = torch.Generator().manual_seed(1)
    batch_size = 4 * args.micro_batches * args.replicas
    batch = (torch.randn(batch_size, 8, generator=generator), torch.randn(batch_size, 8, generator=generator))
    seconds = args.layer_ms / 1e3
    trainers, step_times, losses, found = {}, {}, {}, {}
    for policy in POLICIES:
        torch.manual_seed(0)
        layers = timed_model(args.layers_per_stage * args.stages, seconds, seconds, seconds, width=8)
        config = raypipe.PipelineConfig(num_stages=args.stages, num_replicas=args.replicas,
                                        num_micro_batches=args.micro_batches, slow_steps=args.slow_steps,
                                        on_slow="report" if policy == "unslowed" else policy,
                                        spare_workers=1 if policy == "replace" else 0)
        trainers[policy] = raypipe.PipelineTrainer(layers, nn.functional.mse_loss,
                                                   lambda params: torch.optim.SGD(params, lr=0.01), config)
        step_times[policy], losses[policy] = [], []
    if trainers["replace"].spares is not None:
        trainers["replace"].spares.wait_until_up(300)

    def contender(policy: str):
        trainer = trainers[policy]

        def slow_place():  # replica 0's last stage
            return trainer.layout.actors[trainer.layout.topology.rank(0, args.stages - 1)]

        def run(steps: int) -> list[float]:
            swaps.current, times = policy, []
            for _ in range(steps):
                step = swaps.step = len(step_times[policy])
                if step == args.slow_from and policy != "unslowed":
                    slow_down_worker(slow_place(), args.factor)
                acted = policy in swaps.swapped
                result = trainer.step(*batch)
                if policy == "rebalance" and not acted and policy in swaps.swapped:
                    # rebalanced before this step (which ran unslowed): the place's cause slows its new worker
                    slow_down_worker(slow_place(), args.factor)
                if result.marks:
                    found.setdefault(policy, step)
                step_times[policy].append(result.step_time)
                losses[policy].append(result.loss)
                times.append(result.step_time)
            return times

        return run

    try:
        run_rounds({policy: contender(policy) for policy in POLICIES}, args.steps // args.chunk, args.chunk, 0)
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
        ray.shutdown()

    def median_ms(policy: str, start: int, end: int | None = None) -> float:
        return 1e3 * statistics.median(step_times[policy][start:end])

    after = max([found.get("report", args.slow_from), *(swaps.swapped.get(policy, args.slow_from)
                                                        for policy in ("replace", "rebalance"))]) + 5
    rows = []
    for policy in POLICIES:
        last = median_ms(policy, after)
        won = ((median_ms("report", after) - last) / (median_ms("report", after) - median_ms("unslowed", after))
               if policy != "unslowed" else None)
        rows.append([policy, f"{median_ms(policy, 5, args.slow_from):.1f}",
                     f"{median_ms(policy, args.slow_from, found.get(policy, args.slow_from) + 1):.1f}",
                     f"{last:.1f}", found.get(policy, "-"), swaps.swapped.get(policy, "-"),
                     "-" if won is None else f"{100 * won:.0f}%",
                     f"{max(abs(a - b) / abs(b) for a, b in zip(losses[policy], losses['unslowed'])):.1e}"])
    print_table(["policy", f"ms before step {args.slow_from}", "ms slow, to found", f"ms from step {after}",
                 "found at step", "acted before step", "cost won back", "loss vs unslowed (max rel.)"], rows)
    for policy, line in swaps.lines.items():
        print(f"{policy}, step {swaps.swapped[policy]} (its time includes the change): {line}")
    if args.plot:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(9, 4), dpi=120, layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        top = 2 * max(median_ms("report", args.slow_from), median_ms("report", after))  # a change's step runs off it
        for policy in POLICIES:
            line, = axes.plot([1e3 * value for value in step_times[policy]], label=policy, linewidth=1)
            for step, value in enumerate(step_times[policy]):
                if 1e3 * value > top:
                    axes.annotate(f"{value:.1f} s", (step, top), textcoords="offset points", xytext=(4, -12),
                                  color=line.get_color(), fontsize=8)
        axes.set_ylim(0, top)
        axes.axvline(args.slow_from, color="grey", linestyle=":", label=f"slowed {args.factor:g}x")
        axes.set_xlabel("step")
        axes.set_ylabel("step time (ms)")
        axes.set_title(f"one worker slowed, p={args.stages}, d={args.replicas}, m={args.micro_batches}, "
                       f"slow_steps={args.slow_steps}")
        axes.legend()
        figure.savefig(args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
