"""A slow worker under each ``on_slow`` policy: step-time curves on timed layers.

Three trainers alive for the whole run, taking turns ``--chunk`` steps at a time (so load from other
users of the machine hits them alike): the same pipeline (timed layers, ``--stages`` x ``--replicas``,
``--micro-batches``, ``slow_steps=--slow-steps``) unslowed; with replica 0's last stage slowed
``--factor`` x from its step ``--slow-from`` (:func:`raypipe.testing.fault_injection.slow_down_worker`:
its sleeps, not its arithmetic) and ``on_slow="report"``; and the same with ``on_slow="replace"`` and a
warm spare. (``on_slow="rebalance"`` is not built yet.)

Printed per policy: the median step time before the slowdown, while slow, and from 5 steps after it
was found (or swapped) to the end; the step it was found at; the share of the slowdown's cost the
policy won back ((report - policy) / (report - unslowed), over the last window); whether every loss
equals the unslowed run's, bitwise. ``--plot`` draws the three step-time curves.

    python benchmarks/bench_stragglers.py --plot benchmarks/stragglers.png
"""
from __future__ import annotations

import argparse
import logging
import statistics

from alternate import command_line, print_table, run_rounds

POLICIES = ("unslowed", "report", "replace")


class SwapLines(logging.Handler):
    """The steps at which the running contender logged a swap of a slow worker."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.current: str | None = None
        self.step = 0
        self.swapped: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("raypipe: swapped slow") and self.current is not None:
            self.swapped.setdefault(self.current, self.step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4, help="per replica (default 4)")
    parser.add_argument("--layer-ms", type=float, default=5.0, help="each layer's F, I and W sleep (default 5)")
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
             num_cpus=3 * args.stages * args.replicas + 1)
    swaps = SwapLines()
    logging.getLogger("raypipe").addHandler(swaps)
    generator = torch.Generator().manual_seed(1)
    batch_size = 4 * args.micro_batches * args.replicas
    batch = (torch.randn(batch_size, 8, generator=generator), torch.randn(batch_size, 8, generator=generator))
    seconds = args.layer_ms / 1e3
    trainers, step_times, losses, found = {}, {}, {}, {}
    for policy in POLICIES:
        torch.manual_seed(0)
        layers = timed_model(2 * args.stages, seconds, seconds, seconds, width=8)
        config = raypipe.PipelineConfig(num_stages=args.stages, num_replicas=args.replicas,
                                        num_micro_batches=args.micro_batches, slow_steps=args.slow_steps,
                                        on_slow="replace" if policy == "replace" else "report",
                                        spare_workers=1 if policy == "replace" else 0)
        trainers[policy] = raypipe.PipelineTrainer(layers, nn.functional.mse_loss,
                                                   lambda params: torch.optim.SGD(params, lr=0.01), config)
        step_times[policy], losses[policy] = [], []
    if trainers["replace"].spares is not None:
        trainers["replace"].spares.wait_until_up(300)

    def contender(policy: str):
        trainer = trainers[policy]

        def run(steps: int) -> list[float]:
            swaps.current, times = policy, []
            for _ in range(steps):
                step = swaps.step = len(step_times[policy])
                if step == args.slow_from and policy != "unslowed":
                    slow_down_worker(trainer.layout.actors[trainer.layout.topology.rank(0, args.stages - 1)],
                                     args.factor)
                result = trainer.step(*batch)
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

    after = max([found.get("report", args.slow_from), swaps.swapped.get("replace", args.slow_from)]) + 5
    rows = []
    for policy in POLICIES:
        last = median_ms(policy, after)
        won = ((median_ms("report", after) - last) / (median_ms("report", after) - median_ms("unslowed", after))
               if policy != "unslowed" else None)
        rows.append([policy, f"{median_ms(policy, 5, args.slow_from):.1f}",
                     f"{median_ms(policy, args.slow_from, found.get(policy, args.slow_from) + 1):.1f}",
                     f"{last:.1f}", found.get(policy, "-"), swaps.swapped.get(policy, "-"),
                     "-" if won is None else f"{100 * won:.0f}%",
                     "yes" if losses[policy] == losses["unslowed"] else "NO"])
    print_table(["policy", f"ms before step {args.slow_from}", "ms slow, to found", f"ms from step {after}",
                 "found at step", "swapped before step", "cost won back", "losses bitwise = unslowed"], rows)
    if args.plot:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figure = Figure(figsize=(9, 4), dpi=120, layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        for policy in POLICIES:
            axes.plot([1e3 * value for value in step_times[policy]], label=policy, linewidth=1)
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
