"""Elastic resize on CPU: seconds from a node lost to the first step at fewer
replicas, and from a node added to the first step at more replicas.

Each round starts a fresh ``ray.cluster_utils.Cluster``: a head with no CPUs
(the driver's node) and four 1-CPU nodes, so two replicas of two stages
(``num_replicas=(1, 2)``) fill every node; each node has a 512 MiB object store
(``--object-store-mib``). On it, one model after the other (order reversed on
odd rounds) runs the scenario of the elastic test:

* **shrink**: the node of replica 1's stage 1 is removed abruptly
  (``allow_graceful=False``) and steps run back to back; the replacement finds
  no room within ``replace_timeout_s``, so that replica is dropped. Timed from
  the removal to the first step that returned at 1 replica, split into
  detection (until raypipe logs the failure; the GCS marking the node dead is
  shown beside it), the wait for a replacement (``replace_timeout_s``: the
  policy's wait, not work) and the rest (dropping the replica, re-forming the
  group, a snapshot, redoing the step).
* **grow**: a 1-CPU node is added and steps run every ``--pause`` seconds
  while the placement group the run asked for is placed, the new replica's
  workers start, and a step boundary admits them. Timed from the node's
  registration with the GCS to the first step that returned at 2 replicas,
  split at: the placement group placed; the new worker processes started
  (``/proc``); their ``__init__`` task begun (Python, Ray, torch and raypipe
  imported); its arguments deserialized (the worker's spec, with the stage's
  layers); ``__init__`` done (the stage built: layers, optimizer); the
  admitting step called (the wait for a step boundary); the new workers' last
  ``restore`` done (the state copy: a live replica's snapshot, worker to worker);
  raypipe's "grew" line (re-forming the group); that step returned (a snapshot of
  the grown group, the step). For the two new workers each mark is the later one's.

Driver-side marks come from the driver's clock, raypipe's log records (its
warnings "healing", "shrank", "healed", "grew") and a thread polling the GCS
every 50 ms (nodes alive and dead, placement groups placed); worker-side marks
from Ray's task events (``ray.timeline()``). All are wall clock on this one
machine. The GCS health check is set as in the elastic test: a check every
500 ms, dead after 3 failures, so a node whose raylet is gone is declared dead
after ~1.5 s. With Ray's defaults (a check every 3 s, dead after 5 failures,
10 s timeout per check) that is ~15 s, and up to ~50 s for a machine that stops
answering instead of refusing: detection here is much faster than there.

With ``--optimizers replicated zero1`` each model also runs with
``shard_optimizer`` (ZeRO-1), side by side in the same rounds: a shrink then
rolls every worker back to its snapshot, each adopting its stage's parts of
every old replica (the lost one's from the keeper's copy), and redoes the steps
since; a grow snapshots every worker and each adopts its new owners' parts
(the "state copy" mark is then the workers' ``adopt``).

    python benchmarks/bench_elastic.py --rounds 3
"""
from __future__ import annotations

import os

# read by the GCS when each round's cluster starts: a missed health check every 500 ms, dead after 3
HEALTH_CHECK = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "500",
                "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
os.environ.update(HEALTH_CHECK)

import argparse  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from torch import nn  # noqa: E402

import raypipe  # noqa: E402
from alternate import command_line, print_table, spread  # noqa: E402

BATCH = 12  # 4 micro-batches a step: 2 per replica with 2 replicas, 4 with one
GROW_DEADLINE_S = 120
TASK_EVENTS_FLUSH_S = 2.0  # workers send their task events to the GCS every second
# the parts of each total, in order; a part in parentheses is shown beside them, not counted
SHRINK_PARTS = ("(the GCS marks the node dead)", "detection: until raypipe logs the failure",
                "wait for a replacement (replace_timeout_s) + drain", "drop the replica, restore, re-form, snapshot",
                "redo the step", "total: node removed -> step at 1 replica")
GROW_PARTS = ("(raylet start: add_node -> registered)", "placement group placed", "new worker processes started",
              "process start -> __init__ begins (Python, Ray, torch + raypipe imports)",
              "__init__: its arguments deserialized (the spec: layers, weights)",
              "__init__: build the stage (layers, optimizer)",
              "wait for a step boundary",
              "state copy (replicated: snapshot -> restore; zero1: every worker's snapshot, re-form, adopt)",
              "re-form the group (zero1: within the state copy)",
              "snapshot + the step itself", "total: node registered -> step at 2 replicas")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each on a fresh cluster (default 3)")
    parser.add_argument("--replace-timeout", type=float, default=5.0,
                        help="replace_timeout_s: how long a replacement may wait for room before a shrink (default 5)")
    parser.add_argument("--pause", type=float, default=0.5,
                        help="seconds between steps while the new replica starts (default 0.5)")
    parser.add_argument("--object-store-mib", type=int, default=512,
                        help="each node's object store (default 512; ray.cluster_utils' default is 150)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=["replicated"],
                        help="replicated: every replica holds the whole optimizer state; zero1: shard_optimizer")
    return parser.parse_args()


def tiny_mlp() -> nn.Sequential:
    """The elastic test's model: 8 -> 16 -> 16 -> 16 -> 4 (~700 parameters)."""
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def wide_mlp() -> nn.Sequential:
    """Four Linear(1024, 1024): 4.2M parameters, 16.8 MB of weights, 50 MB with AdamW's state."""
    return nn.Sequential(*[module for _ in range(4) for module in (nn.Linear(1024, 1024), nn.ReLU())])


MODELS = {"tiny": (tiny_mlp, 8, 4), "wide": (wide_mlp, 1024, 1024)}  # builder, input width, output width
OPTIMIZERS = ("replicated", "zero1")


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-3)


class LogMarks(logging.Handler):
    """When raypipe's driver logged each message (``record.created``, wall clock)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, record.getMessage()))

    def first(self, text: str, after: float) -> float:
        """When the first message containing ``text`` was logged at or after ``after``."""
        return next(when for when, message in self.records if when >= after and text in message)


class ClusterWatch:
    """Polls the GCS every 50 ms on a thread: when each node was first seen alive and
    dead, and each placement group first seen placed (wall clock)."""

    def __init__(self) -> None:
        self.alive: dict[str, float] = {}
        self.dead: dict[str, float] = {}
        self.placed: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = time.time()
            for node in ray.nodes():
                (self.alive if node["Alive"] else self.dead).setdefault(node["NodeID"], now)
            for group_id, group in ray.util.placement_group_table().items():
                if group["state"] == "CREATED":
                    self.placed.setdefault(group_id, now)

    def placed_after(self, since: float) -> float:
        """The first placement group seen placed after ``since``."""
        return min((when for when in self.placed.values() if when >= since), default=math.nan)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Marks:
    """One scenario's driver-side times (wall clock, seconds)."""

    lost_node: str = ""
    removed: float = 0.0
    shrunk_step_end: float = 0.0
    add_called: float = 0.0
    added_node: str = ""
    new_processes_started: list[float] = field(default_factory=list)  # the new replica's worker processes
    timeline: list[dict] = field(default_factory=list)  # Ray's task events, read before the workers exit
    step_calls: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, replicas)
    zero1: bool = False


def run_scenario(cluster: Cluster, scenario: str, args: argparse.Namespace) -> Marks:
    """Shrink then grow one trainer of ``scenario`` ("MODEL OPTIMIZER"); returns its driver-side marks."""
    model, optimizer = scenario.split()
    build, width_in, width_out = MODELS[model]
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, width_in), torch.randn(BATCH, width_out)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=(1, 2), hang_timeout_s=5,
                                    replace_timeout_s=args.replace_timeout, placement_timeout_s=60,
                                    shard_optimizer=optimizer == "zero1")
    marks = Marks(zero1=optimizer == "zero1")

    def step(trainer: raypipe.PipelineTrainer) -> int:
        start = time.time()
        replicas = trainer.step(x, y).num_replicas
        marks.step_calls.append((start, time.time(), replicas))
        return replicas

    with raypipe.PipelineTrainer(build(), nn.functional.mse_loss, adamw, config) as trainer:
        assert trainer.num_replicas == 2, f"started with {trainer.num_replicas} replica(s), not 2"
        for _ in range(3):
            step(trainer)
        lost = next(node for node in cluster.worker_nodes if node.node_id == trainer.workers[3].node_id)
        marks.lost_node, marks.removed = lost.node_id, time.time()
        cluster.remove_node(lost, allow_graceful=False)
        while step(trainer) != 1:
            pass
        marks.shrunk_step_end = marks.step_calls[-1][1]
        for _ in range(2):
            step(trainer)
        marks.add_called = time.time()
        marks.added_node = cluster.add_node(**node_resources(args)).node_id
        while step(trainer) != 2:
            if time.time() - marks.add_called > GROW_DEADLINE_S:
                raise RuntimeError(f"{scenario}: no step at 2 replicas {GROW_DEADLINE_S}s after a node was added")
            time.sleep(args.pause)
        marks.new_processes_started = [process_started(worker.pid) for worker in trainer.workers if worker.replica == 1]
        time.sleep(TASK_EVENTS_FLUSH_S)  # a worker killed at shutdown takes its unsent task events with it
        marks.timeline = ray.timeline()
    return marks


def process_started(pid: int) -> float:
    """When process ``pid`` (on this machine) started, wall clock: /proc's start time
    is in clock ticks since boot."""
    with open(f"/proc/{pid}/stat") as file:
        ticks = int(file.read().rsplit(")", 1)[1].split()[19])
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since_boot


def worker_events(timeline: list[dict], method: str, start: float, end: float) -> list[dict]:
    """The stage workers' ``method`` tasks (``PerStepWorker``, or ``StageWorker`` of the
    per-op executor) that started in [start, end], as Ray's task events."""
    return [event for event in timeline if event.get("cat", "").startswith("task::")
            and event["cat"].endswith(f"Worker.{method}") and start <= event["ts"] / 1e6 <= end]


def span(event: dict) -> tuple[float, float]:
    """A task event's start and end, seconds of wall clock."""
    return event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6


def arguments_loaded(timeline: list[dict], task: dict) -> float:
    """When ``task``'s worker finished deserializing its arguments (a part of the task's event)."""
    begin, finish = span(task)
    return max((span(event)[1] for event in timeline if event.get("cat") == "task:deserialize_arguments"
                and event["tid"] == task["tid"] and begin <= event["ts"] / 1e6 <= finish), default=math.nan)


def shrink_parts(marks: Marks, logs: LogMarks, watch: ClusterWatch) -> list[float]:
    """SHRINK_PARTS: consecutive marks from the removal to the first step at 1 replica."""
    failure_seen = logs.first("healing (failure", marks.removed)
    shrank = logs.first("shrank from", marks.removed)
    chain = [marks.removed, failure_seen, shrank, logs.first("healed in", shrank), marks.shrunk_step_end]
    return [watch.dead[marks.lost_node] - marks.removed, *differences(chain), chain[-1] - chain[0]]


def differences(chain: list[float]) -> list[float]:
    """The parts between consecutive marks."""
    return [later - earlier for earlier, later in zip(chain, chain[1:])]


def grow_parts(marks: Marks, logs: LogMarks, watch: ClusterWatch) -> list[float]:
    """GROW_PARTS: consecutive marks from the node's registration to the first step at 2
    replicas; for the two new workers, each mark is the later worker's. A mark Ray's task events
    lack (they are sampled into the GCS, and may drop) is NaN, as are its parts."""
    appeared = watch.alive[marks.added_node]
    call_start, step_end = next((start, end) for start, end, replicas in marks.step_calls
                                if start >= marks.add_called and replicas == 2)
    grew = logs.first("grew from", appeared)
    inits = worker_events(marks.timeline, "__init__", appeared, step_end)
    # the state copy: the new workers restore a live replica's snapshot, or (ZeRO-1) all four workers adopt
    # every old one's parts after the group was re-formed
    restores = [span(event) for method in ("restore", "adopt")
                for event in worker_events(marks.timeline, method, call_start, grew)]
    copies = 4 if marks.zero1 else 2

    def last(times: list[float], count: int = 2) -> float:
        return max(times) if len(times) == count and not any(map(math.isnan, times)) else math.nan

    loaded = [arguments_loaded(marks.timeline, event) for event in inits]
    chain = [appeared, watch.placed_after(appeared), last(marks.new_processes_started),
             last([span(event)[0] for event in inits]), last(loaded), last([span(event)[1] for event in inits]),
             call_start, last([finish for _, finish in restores], copies), grew, step_end]
    return [appeared - marks.add_called, *differences(chain), step_end - appeared]


def node_resources(args: argparse.Namespace) -> dict[str, int]:
    """A worker node: 1 CPU, and an object store that holds the wide model's snapshots
    (the driver's node keeps two of every worker's) without spilling to disk."""
    return {"num_cpus": 1, "object_store_memory": args.object_store_mib * 2**20}


def run_round(index: int, args: argparse.Namespace, logs: LogMarks) -> dict[str, dict[str, list[float]]]:
    """One fresh cluster; every model's shrink and grow parts."""
    cluster = Cluster(initialize_head=True, head_node_args={**node_resources(args), "num_cpus": 0})
    for _ in range(4):
        cluster.add_node(**node_resources(args))
    scenarios = scenarios_of(args) if index % 2 == 0 else list(reversed(scenarios_of(args)))
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        watch = ClusterWatch()
        marks = {scenario: run_scenario(cluster, scenario, args) for scenario in scenarios}
        watch.stop()
        return {scenario: {"shrink": shrink_parts(marks[scenario], logs, watch),
                           "grow": grow_parts(marks[scenario], logs, watch)} for scenario in scenarios}
    finally:
        ray.shutdown()
        cluster.shutdown()


def scenarios_of(args: argparse.Namespace) -> list[str]:
    """Every "MODEL OPTIMIZER" run in a round."""
    return [f"{model} {optimizer}" for model in args.models for optimizer in args.optimizers]


def print_tables(results: list[dict], args: argparse.Namespace) -> None:
    """Per scenario and phase: a row per part, a column per round, then median [min-max];
    with both optimizers, each model's zero1/replicated ratio of the totals, round by round."""
    for scenario in scenarios_of(args):
        for phase, labels in (("shrink", SHRINK_PARTS), ("grow", GROW_PARTS)):
            rows = []
            for position, label in enumerate(labels):
                values = [result[scenario][phase][position] for result in results]
                measured = [value for value in values if not math.isnan(value)]
                rows.append([label] + [f"{value:.2f}" for value in values]
                            + [spread(measured, 2) if measured else "-"])
            print()
            print_table([f"{scenario}, {phase} (s)"] + [f"round {index + 1}" for index in range(len(results))]
                        + ["median [min-max]"], rows)
    if len(args.optimizers) == 2:
        rows = []
        for model in args.models:
            for phase in ("shrink", "grow"):
                ratios = [result[f"{model} zero1"][phase][-1] / result[f"{model} replicated"][phase][-1]
                          for result in results]
                rows.append([f"{model} MLP, {phase}"] + [f"{ratio:.2f}" for ratio in ratios] + [spread(ratios, 2)])
        print()
        print_table(["zero1 / replicated, total"] + [f"round {index + 1}" for index in range(len(results))]
                    + ["median [min-max]"], rows)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    print(f"torch {torch.__version__}, ray {ray.__version__}; 2 stages x num_replicas=(1, 2) on a "
          f"ray.cluster_utils.Cluster of 4 x 1-CPU nodes, {args.object_store_mib} MiB object store each; "
          f"replace_timeout_s={args.replace_timeout:g}, a step every {args.pause:g} s while growing; "
          f"GCS health check {HEALTH_CHECK}", flush=True)
    for model in args.models:
        count = sum(parameter.numel() for parameter in MODELS[model][0]().parameters())
        print(f"{model} MLP: {count:,} parameters; weights + AdamW state {3 * 4 * count / 2**20:.1f} MiB "
              f"({3 * 4 * count / 2**20 / 2:.1f} MiB per stage)")
    logs = LogMarks()
    logging.getLogger("raypipe").addHandler(logs)
    results = []
    for index in range(args.rounds):
        results.append(run_round(index, args, logs))
        print(f"round {index + 1} done", flush=True)
    print_tables(results, args)
    print(command_line())


if __name__ == "__main__":
    main()
