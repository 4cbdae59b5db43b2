"""Predicted goodput against the number of GPUs (8 ... 16,384), per recovery method: for each
N, the best configuration ``raypipe plan --cluster`` finds (its predicted step and its stages'
state), then :mod:`raypipe.planning.goodput`'s simulated run with failures per node at
``--node-mtbf-hours`` (default ~1011 h: arXiv 2410.21680's 7.9 h job MTTF at 1,024 GPUs).
No Ray, no GPU: a prediction, not a measurement. Prints a Markdown table; with matplotlib,
also a plot.

    python benchmarks/bench_goodput_scale.py --model llama3-8b --plot goodput_scale.png
    python benchmarks/bench_goodput_scale.py --model llama3-70b --cluster h200
"""
from __future__ import annotations

import argparse
import time

from alternate import command_line, print_table
from raypipe.models.llama import CONFIGS, get_config
from raypipe.planning.cluster_spec import load_cluster
from raypipe.planning.configuration_search import search_plans
from raypipe.planning.goodput import METHODS, PAPER_NODE_MTBF_HOURS, job_mttf_hours
from raypipe.planning.plan import METHOD_LABELS, candidate_goodput

GPU_COUNTS = tuple(2 ** k for k in range(3, 15))  # 8 ... 16,384


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", choices=sorted(CONFIGS))
    parser.add_argument("--cluster", default="h100", help="a preset (h100, h200) or a cluster JSON file")
    parser.add_argument("--node-mtbf-hours", type=float, default=PAPER_NODE_MTBF_HOURS)
    parser.add_argument("--gpus", type=int, nargs="+", default=list(GPU_COUNTS),
                        help="GPU counts (default 8 ... 16384)")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write a plot of goodput against N here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    print(command_line())
    config, cluster = get_config(args.model), load_cluster(args.cluster)
    rows, series = [], {method: [] for method in METHODS}
    for gpus in args.gpus:
        started = time.perf_counter()
        result = search_plans(config, cluster, gpus, top=1)
        if not result.best:
            rows.append([gpus, "does not fit", "", "", *[""] * len(METHODS)])
            continue
        best = result.best[0]
        goodput = candidate_goodput(config, best, cluster, args.node_mtbf_hours)
        shape = best.shape
        rows.append([f"{gpus:,}", f"{job_mttf_hours(gpus, args.node_mtbf_hours, cluster.gpus_per_node):.3g}",
                     f"d={shape.num_replicas} p={shape.num_stages} m={shape.num_micro_batches}",
                     f"{best.prediction.step_s:.3g}",
                     *[("n/a" if goodput[m]["goodput"] is None else f"{goodput[m]['goodput']:.2%}") for m in METHODS]])
        for method in METHODS:
            if goodput[method]["goodput"] is not None:
                series[method].append((gpus, goodput[method]["goodput"]))
        print(f"{gpus} GPUs done in {time.perf_counter() - started:.1f} s", flush=True)
    print()
    print(f"{args.model} on {args.cluster}, node MTBF {args.node_mtbf_hours:,.0f} h (simulated goodput; "
          "closed forms in `raypipe plan --json`)")
    print_table(["GPUs", "job MTTF h", "best configuration", "step s", *METHODS], rows)
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot")
            return
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for method, points in series.items():
            if points:
                axes.plot([n for n, _ in points], [100 * g for _, g in points], marker="o", label=METHOD_LABELS[method])
        axes.set_xscale("log", base=2)
        axes.set_xlabel("GPUs")
        axes.set_ylabel("goodput (%)")
        axes.set_title(f"{args.model} on {args.cluster}: predicted goodput, node MTBF {args.node_mtbf_hours:,.0f} h")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
        print(f"plot written to {args.plot}")
    print(command_line())


if __name__ == "__main__":
    main()
