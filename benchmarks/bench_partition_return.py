"""A re-partitioned run going back to its configured stages, on CPU: what the
swap holds up, beside a running pipeline and in place of it.

Each scenario of each round runs on a fresh ``ray.cluster_utils.Cluster``: a
head with no CPUs (the driver's node) and two 1-CPU nodes. One replica of two
stages of the wide MLP (4 x Linear(1024, 1024), AdamW: 24 MiB of weights and
optimizer state per stage) runs a step every ``--pause`` seconds. Stage 1's
node is removed (``allow_graceful=False``): no node has room for a replacement,
so the model is re-partitioned onto one stage. Then:

* **beside**: two nodes are added, as an autoscaler adds room for the whole
  configured pipeline. Its workers start while steps run on the one stage; at
  a step boundary they adopt its layers (snapshot, sent worker to worker) and
  take over.
* **in place**: one node is added, as a fixed-size cluster gets its lost node
  back. The configured pipeline fits only in its room plus the one stage's: at
  a step boundary the one stage is snapshotted and stopped, and the two stages
  are placed, started (process, imports, layers) and adopt the snapshot.

Printed per scenario and round: the median step on two stages before the loss,
on one stage, and on two stages after the return; the step that swapped; and
seconds from ``add_node`` to the first step on two stages. The scenarios take
turns (order reversed on even rounds).

    python benchmarks/bench_partition_return.py --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch
from ray.cluster_utils import Cluster
from torch import nn

import raypipe
from alternate import command_line, print_table, spread
# its model and optimizer; importing it sets the GCS health check its clusters and these use (dead after ~1.5 s)
from bench_elastic import adamw, wide_mlp

BATCH, WIDTH = 8, 1024
DEADLINE_S = 180
SCENARIOS = {"beside": 2, "in place": 1}  # nodes added after the re-partition
FIGURES = ("step, 2 stages (before)", "step, 1 stage", "step, 2 stages (after)", "the swap step",
           "add_node -> first step on 2 stages")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each scenario on a fresh cluster (default 3)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between steps (default 0.5)")
    parser.add_argument("--object-store-mib", type=int, default=512, help="each node's object store (default 512)")
    return parser.parse_args()


def run_scenario(nodes_added: int, args: argparse.Namespace) -> list[float]:
    """One trainer through the loss and the return on a fresh cluster; its FIGURES."""
    node = {"num_cpus": 1, "object_store_memory": args.object_store_mib * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(**node)
    ray.init(address=cluster.address, logging_level="ERROR")
    try:
        return train(cluster, nodes_added, node, args)
    finally:
        ray.shutdown()
        cluster.shutdown()


def train(cluster: Cluster, nodes_added: int, node: dict, args: argparse.Namespace) -> list[float]:
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, hang_timeout_s=5, replace_timeout_s=5,
                                    placement_timeout_s=60)
    times: dict[str, list[float]] = {"before": [], "one": [], "after": []}
    with raypipe.PipelineTrainer(wide_mlp(), nn.functional.mse_loss, adamw, config) as trainer:

        def step() -> tuple[float, int]:
            start = time.monotonic()
            stages = len(trainer.step(x, y).stages)
            return time.monotonic() - start, stages

        for _ in range(4):
            times["before"].append(step()[0])
        lost = next(worker for worker in cluster.worker_nodes if worker.node_id == trainer.workers[1].node_id)
        cluster.remove_node(lost, allow_graceful=False)
        while step()[1] != 1:  # the step that healed onto one stage
            pass
        for _ in range(4):
            times["one"].append(step()[0])
            time.sleep(args.pause)
        added = time.monotonic()
        for _ in range(nodes_added):
            cluster.add_node(**node)
        while (measured := step())[1] != 2:
            times["one"].append(measured[0])
            if time.monotonic() - added > DEADLINE_S:
                raise RuntimeError(f"no step on 2 stages {DEADLINE_S}s after {nodes_added} node(s) were added")
            time.sleep(args.pause)
        swap, returned = measured[0], time.monotonic() - added
        for _ in range(4):
            times["after"].append(step()[0])
            time.sleep(args.pause)
        assert [direction for _, direction, _ in trainer.resizes] == ["repartition", "restore"], trainer.resizes
    return [statistics.median(times["before"]), statistics.median(times["one"]), statistics.median(times["after"]),
            swap, returned]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    print(f"torch {torch.__version__}, ray {ray.__version__}; 2 stages, 1 replica of the wide MLP on a "
          f"ray.cluster_utils.Cluster of 2 x 1-CPU nodes, {args.object_store_mib} MiB object store each; "
          f"a step every {args.pause:g} s after the loss", flush=True)
    results: dict[str, list[list[float]]] = {scenario: [] for scenario in SCENARIOS}
    for index in range(args.rounds):
        order = list(SCENARIOS) if index % 2 == 0 else list(SCENARIOS)[::-1]
        for scenario in order:
            results[scenario].append(run_scenario(SCENARIOS[scenario], args))
        print(f"round {index + 1} done", flush=True)
    for scenario, rounds in results.items():
        rows = [[figure] + [f"{values[position]:.3f}" for values in rounds]
                + [spread([values[position] for values in rounds], 3)] for position, figure in enumerate(FIGURES)]
        ratios = [values[3] / values[2] for values in rounds]
        rows.append(["the swap step / a step on 2 stages after"] + [f"{ratio:.2f}" for ratio in ratios]
                    + [spread(ratios, 2)])
        print()
        print_table([f"{scenario} (s)"] + [f"round {index + 1}" for index in range(args.rounds)]
                    + ["median [min-max]"], rows)
    print(command_line())


if __name__ == "__main__":
    main()
