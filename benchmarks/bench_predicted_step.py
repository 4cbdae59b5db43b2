"""Predicted against measured step time and bubble on timed layers (issue 43's validation targets).

For each configuration (stages p, micro-batches m, schedule, model chunks per worker v,
replicas d, and optionally a :class:`raypipe.testing.TimedBoundary` standing for a slower link
between two stages), this runs a
raypipe ``PipelineTrainer`` on :class:`raypipe.testing.TimedLayer` layers (forward, input-gradient
and weight-gradient each sleep a fixed time, no core used, so p x d stage processes on 2 cores
behave as p x d devices) and sets beside its measured step the predictions made before it runs:

* **nominal**: :func:`raypipe.core.timed_simulation.simulate_timed` on the same lowered ops
  (``lower(make_schedule(...))``) with the layers' sleeps as op times (F = the stage's forward
  sleeps, B = its input + weight gradient sleeps, I and W apart for zb_h1; the first stage has
  no input gradient for its first layer, and raypipe's split backward runs that stage's whole
  backward as W; a boundary layer's sleep counts on its stage, in F and in B / I), messages
  free, sends buffered as the executors post them;
* **calibrated**: the same simulation with op times, message times and overheads *measured on
  calibration trainers in the same round* (p=2, m=8, GPipe and zb_h1: they run beside the
  configuration, round by round, so the machine's load hits both alike): per op kind its mean
  time on the first stage and on the others, a message's mean time (from its producing op's
  end to the end of a receive already waiting for it), the mean idle time a worker spends
  around each compute op that no wait for a message explains (posting sends, unpickling a
  message already there, Python: in the op's time, not busy),
  and the mean step time outside the compute window (the driver's dispatch and commit, the
  reduction, the decision, the optimizer and the snapshot copy), added once per step as
  a + b x workers, a line through that figure on the p=2 trainer and on a third calibration
  trainer (p=4, m=4, GPipe): on 2 cores every worker's per-step CPU work (its snapshot copy,
  optimizer, report) queues for the same cores. A chunked configuration's ops are timed
  between a one-chunk stage's and a fourth calibration trainer's chunk ops (p=2, m=8, zbv:
  chunks of L / 2 layers), an op's time a constant plus a cost per layer, each kind's line
  through the two (:func:`chunk_seconds`): part of what an op costs beyond its sleeps is per
  op, not per layer;
* **planning**: :func:`raypipe.planning.predict.predict_step`, the issue's predictor, on the
  same calibrated times given as ``LayerCost`` (seconds x 1e9 "flops" on a cluster of 1e9
  flop/s, achievable fraction 1, links of the calibrated message time, the gap and the
  per-step cost as the cluster's ``op_overhead_s`` and ``step_overhead_s``); it equals the
  calibrated simulation but for the data-parallel reduction it adds with replicas (2 (d-1)
  message latencies) and its step being from the first op, not the first F.

Measured: ``trainer.step()`` wall time on the driver, per round the median of ``--steps``
steps (after ``--warmup`` steps), the median over ``--rounds`` rounds with the [min-max];
the ratio is measured / calibrated per round, its median and [min-max] over rounds. Measured
bubble is :attr:`StepResult.bubble_fraction` (per stage 1 - busy / the replica's compute
window from its first F to its last B or W, mean over stages); the predicted bubble is the
same figure on the simulated timeline. Targets (issue 43): within 10% on step time, bubble
within 2 points.

Configurations run one after another on one private Ray instance (``address="local"``), each
trainer shut down before the next starts (the four calibration trainers, 10 processes, live
throughout); p = 8 runs 8 more processes, so keep rounds short (the default run takes ~13
minutes on 2 cores). ``--only`` picks configurations by
name (``--list`` prints them). ``--llama`` adds the tiny LLaMA on 2 real CPU stages, predicted
by ``predict_step`` from its LayerCosts with this CPU's flop rate calibrated on one block
in the driver process (see :func:`run_llama`).

On a shared machine run it with ``RAY_worker_niceness=0`` (Ray starts stage actors at nice 15,
which other users' processes starve; see README.md):

    RAY_worker_niceness=0 python benchmarks/bench_predicted_step.py --rounds 4 --steps 6 --llama
    RAY_worker_niceness=0 python benchmarks/bench_predicted_step.py --only p2-m8-1f1b p4-m8-zb_h1 --rounds 2
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from alternate import add_round_arguments, command_line, print_table, round_medians, spread


@dataclass(frozen=True)
class Config:
    name: str
    stages: int
    micro_batches: int
    schedule: str
    replicas: int = 1
    boundary_ms: float = 0.0  # a TimedBoundary after this stage's layers: BOUNDARY_STAGE -> +1
    boundary_stage: int = 1
    chunks: int = 1  # model chunks per worker (virtual_stages), layers_per_stage / chunks layers each

    def __post_init__(self) -> None:
        if self.chunks > 1 and self.boundary_ms:
            raise ValueError(f"{self.name}: a TimedBoundary is placed on one-chunk stages only")


CONFIGS = [
    Config("p2-m4-gpipe", 2, 4, "gpipe"),
    Config("p2-m8-1f1b", 2, 8, "1f1b"),
    Config("p2-m8-zb_h1", 2, 8, "zb_h1"),
    Config("p4-m8-gpipe", 4, 8, "gpipe"),
    Config("p4-m8-1f1b", 4, 8, "1f1b"),
    Config("p4-m8-zb_h1", 4, 8, "zb_h1"),
    Config("p4-m16-gpipe", 4, 16, "gpipe"),
    Config("p4-m16-1f1b", 4, 16, "1f1b"),
    Config("p4-m16-zb_h1", 4, 16, "zb_h1"),
    Config("p4-m8-1f1b-link8ms", 4, 8, "1f1b", boundary_ms=8.0),
    Config("d2-p2-m8-1f1b", 2, 8, "1f1b", replicas=2),
    Config("d2-p4-m4-gpipe", 4, 4, "gpipe", replicas=2),
    Config("p8-m8-1f1b", 8, 8, "1f1b"),
    Config("p8-m16-zb_h1", 8, 16, "zb_h1"),
    Config("p4-m8-interleaved_1f1b", 4, 8, "interleaved_1f1b", chunks=2),
    Config("p4-m8-zbv", 4, 8, "zbv", chunks=2),
    Config("p4-m16-interleaved_1f1b", 4, 16, "interleaved_1f1b", chunks=2),
    Config("p4-m16-zbv", 4, 16, "zbv", chunks=2),
    Config("p8-m8-zbv", 8, 8, "zbv", chunks=2),  # below 2m = 3p - 1: zbv's list-scheduled order
]
# measured in every round beside the configuration: F, B, messages, the per-op gap and the
# per-step cost from the first; I and W from the second; how the per-step cost grows with the
# workers from the first and the third; F, I and W of a chunk of half a stage's layers from the fourth
CALIBRATIONS = (Config("calibration-p2-m8-gpipe", 2, 8, "gpipe"), Config("calibration-p2-m8-zb_h1", 2, 8, "zb_h1"),
                Config("calibration-p4-m4-gpipe", 4, 4, "gpipe"),
                Config("calibration-p2-m8-zbv", 2, 8, "zbv", chunks=2))


# -- the model ----------------------------------------------------------------------
def build_model(args: argparse.Namespace, config: Config, seed: int = 0) -> tuple[nn.Sequential, list[int]]:
    """p x layers_per_stage timed layers (a TimedBoundary after stage ``boundary_stage``'s if
    ``boundary_ms``), and the balance that puts the boundary on that stage, last."""
    from raypipe.testing import TimedBoundary, TimedLayer, timed_model

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    balance = []
    if config.chunks > 1:  # p x v virtual stages of layers_per_stage / v layers, in virtual-stage order
        per_chunk = args.layers_per_stage // config.chunks
        model = timed_model(per_chunk * config.stages * config.chunks, args.forward_ms / 1e3,
                            args.input_grad_ms / 1e3, args.weight_grad_ms / 1e3, args.width)
        return model, [per_chunk] * (config.stages * config.chunks)
    for stage in range(config.stages):
        layers += [TimedLayer(args.forward_ms / 1e3, args.input_grad_ms / 1e3, args.weight_grad_ms / 1e3, args.width)
                   for k in range(args.layers_per_stage)]
        balance.append(args.layers_per_stage)
        if config.boundary_ms and stage == config.boundary_stage:
            layers.append(TimedBoundary(config.boundary_ms / 1e3))
            balance[-1] += 1
    return nn.Sequential(*layers), balance


def make_batch(args: argparse.Namespace, config: Config, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    rows = config.replicas * config.micro_batches * args.rows_per_micro_batch
    return torch.randn(rows, args.width, generator=generator), torch.randn(rows, args.width, generator=generator)


# -- predictions ----------------------------------------------------------------------
@dataclass(frozen=True)
class OpTimes:
    """Seconds of one micro-batch's F, B, I and W on the first stage and on any other (all
    the stage's timed layers; a boundary layer adds its own), and of one message.

    The first stage differs: its input (the batch) takes no gradient, so its first layer's
    input-gradient sleep never runs, and raypipe's split backward runs that stage's whole
    backward as W (its I only replays what was not kept: here nothing)."""

    first: dict
    rest: dict
    boundary_extra: float = 0.0  # what a boundary's measured sleep adds beyond its nominal, each way
    message: float = 0.0
    per_step: float = 0.0  # fixed cost of a step beyond the pipeline's compute window
    per_worker: float = 0.0  # what that cost grows by per worker (stage process)
    gap: float = 0.0  # a worker's idle time around each compute op (posting sends, Python), not busy
    layers: int = 2  # the timed layers of the stage ``first`` and ``rest`` are for
    # the same of a chunk of ``chunk_layers`` layers, on virtual stage 0 and on any other (for chunked configs)
    chunk_first: dict | None = None
    chunk_rest: dict | None = None
    chunk_layers: int = 1


def nominal_times(args: argparse.Namespace) -> OpTimes:
    """The layers' sleeps, nothing else (see OpTimes for the first stage), for a stage and for a
    chunk of half its layers."""
    f, i, w = args.forward_ms / 1e3, args.input_grad_ms / 1e3, args.weight_grad_ms / 1e3

    def sleeps(layers: int) -> tuple[dict, dict]:  # (first, rest)
        first_backward = (layers - 1) * i + layers * w
        return ({"F": layers * f, "B": first_backward, "I": 0.0, "W": first_backward},
                {"F": layers * f, "B": layers * (i + w), "I": layers * i, "W": layers * w})

    layers = args.layers_per_stage
    (first, rest), (chunk_first, chunk_rest) = sleeps(layers), sleeps(layers // 2)
    return OpTimes(first=first, rest=rest, layers=layers, chunk_first=chunk_first, chunk_rest=chunk_rest,
                   chunk_layers=layers // 2)


def stage_seconds(config: Config, times: OpTimes) -> list[dict[str, float]]:
    """Per virtual stage (with one chunk a worker, per stage), the time of its F, B, I and W for
    one micro-batch, the gap included."""
    if config.chunks > 1:
        return [{kind: value + times.gap for kind, value in seconds.items()}
                for seconds in chunk_seconds(config, times)]
    out = []
    for stage in range(config.stages):
        seconds = dict(times.first if stage == 0 else times.rest)
        if config.boundary_ms and stage == config.boundary_stage:
            for kind in ("F", "B", "I"):  # the boundary's sleep is on its input path both ways
                seconds[kind] += config.boundary_ms / 1e3 + times.boundary_extra
        out.append({kind: value + times.gap for kind, value in seconds.items()})
    return out


def chunk_seconds(config: Config, times: OpTimes) -> list[dict[str, float]]:
    """Per virtual stage of a chunked config, its ops' times without the gap, for chunks of
    ``n = times.layers / config.chunks`` layers.

    Each kind's time is a constant plus a cost per layer, the line through the one-chunk
    stage's ``times.layers`` layers and the chunk's ``times.chunk_layers`` (measured: on timed
    layers of 20 ms an op costs ~1.2 ms beyond a 2-layer op's sleeps and ~0.7 ms beyond a 1-layer
    op's, not in proportion to its layers; nominal, the sleeps alone: n / layers of each). B,
    which the chunk calibration (split) does not run, is the stage's B scaled as I + W scale from
    the stage's layers to the chunk's (one call costs less than I and W apart: 17.2 ms against
    18.1 on 4 ms layers). Virtual stage 0 alone has no input gradient for its first layer, and
    raypipe's split backward runs its whole backward as W (see OpTimes)."""
    n = times.layers // config.chunks
    per_layer = {kind: (times.rest[kind] - times.chunk_rest[kind]) / (times.layers - times.chunk_layers)
                 for kind in ("F", "I", "W")}

    backward_per_layer = per_layer["I"] + per_layer["W"]
    more = n - times.chunk_layers  # layers beyond the chunk calibration's
    rest = {kind: times.chunk_rest[kind] + more * per_layer[kind] for kind in ("F", "I", "W")}
    # B as one call costs less than its I and W apart (one op's overheads, not two): it scales as they do
    rest["B"] = times.rest["B"] * (rest["I"] + rest["W"]) / (times.rest["I"] + times.rest["W"])
    # its whole backward is its W; its I replays nothing
    whole = times.chunk_first["W"] + more * backward_per_layer
    first = {"F": times.chunk_first["F"] + more * per_layer["F"], "I": times.chunk_first["I"], "W": whole, "B": whole}
    return [first] + [rest] * (config.stages * config.chunks - 1)


def lowered_ops(config: Config) -> list[list]:
    from raypipe.core.lowering import lower
    from raypipe.core.schedule import PLACEMENT, make_schedule

    return lower(make_schedule(config.schedule, config.stages, config.micro_batches, config.chunks),
                 PLACEMENT[config.schedule])


def compute_window_bubble(timeline, num_stages: int) -> float:
    """StepResult.bubble_fraction's definition on a timeline of (stage, kind, start, end): per
    stage 1 - busy / (last compute end - first compute start), mean over stages."""
    compute = [(stage, start, end) for stage, kind, start, end in timeline if kind in ("F", "B", "I", "W")]
    window = max(end for _, _, end in compute) - min(start for _, start, _ in compute)
    busy = [0.0] * num_stages
    for stage, start, end in compute:
        busy[stage] += end - start
    return statistics.mean(max(0.0, 1 - b / window) for b in busy)


def simulate(args: argparse.Namespace, config: Config, times: OpTimes) -> tuple[float, float]:
    """(step seconds, bubble) of ``config`` simulated with ``times``, plus the fixed per-step cost."""
    from raypipe.core.ops import virtual_stage
    from raypipe.core.schedule import PLACEMENT
    from raypipe.core.timed_simulation import simulate_timed

    per_stage, placement = stage_seconds(config, times), PLACEMENT[config.schedule]
    run = simulate_timed(lowered_ops(config),
                         lambda stage, op: per_stage[virtual_stage(stage, op.chunk, config.stages,
                                                                   placement)].get(op.kind, 0.0),
                         times.message, buffered_sends=True, placement=placement)
    # the gap is in each compute op's time (the critical path pays it) but not busy
    bubble = compute_window_bubble([(t.stage, t.op.kind, t.start, t.end - (times.gap if t.op.kind in "FBIW" else 0))
                                    for t in run.timeline], config.stages)
    window = (max(t.end for t in run.timeline if t.op.kind in "FBIW")
              - min(t.start for t in run.timeline if t.op.kind in "FBIW"))
    return window + step_overhead(config, times), bubble


def step_overhead(config: Config, times: OpTimes) -> float:
    return times.per_step + times.per_worker * config.stages * config.replicas


def timed_cluster(message_s: float, op_overhead_s: float = 0.0, step_overhead_s: float = 0.0):
    """A 'cluster' whose device runs 1e9 flop/s (LayerCost flops = seconds x 1e9), with the
    calibrated message time and overheads."""
    from raypipe.planning.cluster_spec import Cluster, Link

    link = Link(bandwidth_bytes_per_s=1e18, latency_s=message_s)
    return Cluster(name="timed-layers", peak_flops={"fp32": 1e9}, memory_bytes=2**40,
                   memory_bandwidth_bytes_per_s=1e18, gpus_per_node=1024, intra_node=link, inter_node=link,
                   host_copy_bytes_per_s=1e18, achievable_fraction=1.0, op_overhead_s=op_overhead_s,
                   step_overhead_s=step_overhead_s)


def planning_prediction(args: argparse.Namespace, config: Config, times: OpTimes) -> tuple[float, float]:
    """predict_step on the timed layers given as LayerCosts; (step seconds, pipeline bubble)."""
    from raypipe.models.layers import LayerCost
    from raypipe.planning.predict import predict_step

    # each stage's whole times on its first layer (LayerCost's flops = seconds x 1e9), the
    # others free: the predictor sums a stage's layers; B = bwd_input + bwd_weight, I = bwd_input
    costs, balance = [], []
    # the gap and the per-step cost as the cluster's op_overhead_s and step_overhead_s
    split = any(op.kind == "I" for ops in lowered_ops(config) for op in ops)
    for stage, seconds in enumerate(stage_seconds(config, replace(times, gap=0.0))):  # per virtual stage
        if split:
            input_grad, weight_grad = seconds["I"], seconds["W"]
        else:
            input_grad, weight_grad = seconds["B"], 0.0
        size = (args.layers_per_stage // config.chunks
                + (1 if config.boundary_ms and stage == config.boundary_stage else 0))
        output = 4 * args.width * args.rows_per_micro_batch
        costs.append(LayerCost(seconds["F"] * 1e9, input_grad * 1e9, weight_grad * 1e9, param_bytes=8 * args.width,
                               output_bytes=output))
        costs += [LayerCost(0.0, 0.0, 0.0, param_bytes=8 * args.width, output_bytes=output)] * (size - 1)
        balance.append(size)
    cluster = timed_cluster(times.message, op_overhead_s=times.gap, step_overhead_s=step_overhead(config, times))
    prediction = predict_step(costs, cluster, num_replicas=config.replicas,
                              num_stages=config.stages, num_micro_batches=config.micro_batches,
                              schedule=config.schedule, precision="fp32", balance=balance, snapshot_every=0,
                              virtual_stages=config.chunks)
    return prediction.step_s, prediction.pipeline_bubble


def boundary_overshoot(repeats: int = 30) -> float:
    """What a TimedBoundary's sleep takes beyond its nominal time, measured in this process."""
    from raypipe.testing import TimedBoundary

    boundary = TimedBoundary(0.004)
    x = torch.randn(4, 8, requires_grad=True)
    extra = []
    for _ in range(repeats):
        start = time.perf_counter()
        boundary(x)
        extra.append(time.perf_counter() - start - 0.004)
    return max(0.0, statistics.median(extra))


# -- measuring ----------------------------------------------------------------------
@dataclass
class Measured:
    """One contender's steps of one round: step times, and what their timelines show. Figures
    that the calibration sums along a critical path are means (a late wake-up on a loaded
    machine counts as it costs); the step is the round's median."""

    step_ms: float  # median step of the round
    bubble: float  # median over steps of StepResult.bubble_fraction's mean over stages
    message_ms: float  # mean time from a producing op's end to the end of a receive that waited for it
    driver_ms: float  # mean step time minus the longest worker task
    window_ms: float  # mean compute window (first F to last B/W) of replica 0
    outside_ms: float  # mean step time minus the compute window
    gap_ms: float  # mean per compute op: a worker's idle time in its window that no wait explains
    op_ms: dict  # per op kind, the mean time of one stage's op (all its layers): (first stage, others)


def message_latencies(timeline, config: Config) -> tuple[list[float], dict]:
    """Per message whose receive was posted before its producer's op ended: from that op's
    end to the receive's end (one clock: every process is on this machine). A receive of
    micro-batch k on virtual stage s (a worker's chunk) that ends before s's F of k is the
    activation from s-1's F of k; a later one is the gradient from s+1's backward (B or I) of k.

    Also, per (replica, stage), the receiving time no simulated wait explains: of a receive
    posted after its message could have arrived (its producer's end plus the mean latency),
    all of it (unpickling, copying: a cost of the receiving worker, like the per-op gap)."""
    from raypipe.core.ops import virtual_stage
    from raypipe.core.schedule import PLACEMENT

    def held_by(e) -> int:
        return virtual_stage(e.stage, e.chunk, config.stages, PLACEMENT[config.schedule])

    compute = {}
    for e in timeline:
        if e.op in ("F", "B", "I"):
            kind = "F" if e.op == "F" else "back"
            compute[(e.replica, held_by(e), kind, e.micro_batch)] = e
    matched = []
    for e in timeline:
        if e.op != "recv" or e.micro_batch is None:
            continue
        own_forward = compute.get((e.replica, held_by(e), "F", e.micro_batch))
        if own_forward is not None and e.end <= own_forward.start + 1e-6:
            producer = compute.get((e.replica, held_by(e) - 1, "F", e.micro_batch))
        else:
            producer = compute.get((e.replica, held_by(e) + 1, "back", e.micro_batch))
        if producer is not None:
            matched.append((e, producer))
    latencies = [e.end - producer.end for e, producer in matched if e.start < producer.end <= e.end]
    latency = statistics.mean(latencies) if latencies else 0.0
    unexplained: dict = {}
    for e, producer in matched:
        arrived = producer.end + latency
        if e.start >= producer.end:
            key = (e.replica, e.stage)
            unexplained[key] = unexplained.get(key, 0.0) + max(0.0, e.end - max(e.start, arrived))
    return latencies, unexplained


class Runner:
    """One PipelineTrainer on ``config``'s timed layers."""

    def __init__(self, args: argparse.Namespace, config: Config) -> None:
        import raypipe
        from bench_vs_pippy import make_optimizer

        self.config = config
        model, balance = build_model(args, config)
        pipeline = raypipe.PipelineConfig(num_stages=config.stages, num_micro_batches=config.micro_batches,
                                          num_replicas=config.replicas, balance=balance, schedule=config.schedule,
                                          virtual_stages=config.chunks, snapshot_every=args.snapshot_every)
        self.trainer = raypipe.PipelineTrainer(model, nn.MSELoss(), optimizer=make_optimizer("sgd"), config=pipeline)
        self.inputs, self.targets = make_batch(args, config)

    def run(self, steps: int) -> Measured | None:
        times, results = [], []
        for _ in range(steps):
            start = time.perf_counter()
            results.append(self.trainer.step(self.inputs, self.targets))
            times.append(time.perf_counter() - start)
        return summarize(self.config, results, times) if steps else None

    def close(self) -> None:
        self.trainer.shutdown()


def summarize(config: Config, results: list, times: list[float]) -> Measured:
    matched = [message_latencies(r.timeline, config) for r in results]
    latencies = [1e3 * latency for found, _ in matched for latency in found]
    ops = {}  # kind -> (mean on the first stage, mean on the others), ms
    for kind in ("F", "B", "I", "W"):  # first: virtual stage 0, chunk 0 of stage 0 in every placement
        first = [1e3 * (e.end - e.start) for r in results for e in r.timeline
                 if e.op == kind and (e.stage, e.chunk) == (0, 0)]
        rest = [1e3 * (e.end - e.start) for r in results for e in r.timeline
                if e.op == kind and (e.stage, e.chunk) != (0, 0)]
        if first and rest:
            ops[kind] = (statistics.mean(first), statistics.mean(rest))
    windows, gaps = [], []
    for r, (_, unexplained) in zip(results, matched):
        compute = [e for e in r.timeline if e.op in ("F", "B", "I", "W") and e.replica == 0]
        windows.append(1e3 * (max(e.end for e in compute) - min(e.start for e in compute)))
        for replica in range(config.replicas):
            compute = [e for e in r.timeline if e.op in ("F", "B", "I", "W") and e.replica == replica]
            start, end = min(e.start for e in compute), max(e.end for e in compute)
            for stage in range(config.stages):
                own = [e for e in compute if e.stage == stage]
                receiving = sum(max(0.0, min(e.end, end) - max(e.start, start)) for e in r.timeline
                                if e.op == "recv" and e.stage == stage and e.replica == replica)
                idle = (max(e.end for e in own) - min(e.start for e in own)) - sum(e.end - e.start for e in own)
                unmodelled = unexplained.get((replica, stage), 0.0)
                gaps.append(1e3 * max(0.0, idle - receiving + unmodelled) / len(own))
    driver = [1e3 * (r.step_time - max(s.task_seconds or 0.0 for s in r.stages)) for r in results]
    return Measured(step_ms=1e3 * statistics.median(times),
                    bubble=statistics.median(statistics.mean(r.bubble_fraction) for r in results),
                    message_ms=statistics.mean(latencies) if latencies else 0.0, driver_ms=statistics.mean(driver),
                    window_ms=statistics.mean(windows),
                    outside_ms=statistics.mean(1e3 * t - w for t, w in zip(times, windows)),
                    gap_ms=statistics.mean(gaps), op_ms=ops)


def format_ops(op_ms: dict) -> str:
    return " / ".join(f"{kind} " + ", ".join(f"{ms:.1f}" for ms in values) for kind, values in op_ms.items()) + " ms"


def calibrated_times(gpipe: Measured, split: Measured, wider: Measured, chunked: Measured, boundary_extra: float,
                     layers: int) -> OpTimes:
    """Op times, the message time, the per-op gap and the fixed per-step cost from one round of
    the CALIBRATIONS trainers (see the module docstring): measured, not fitted to any configuration.
    The per-step cost is a + b x workers through the p=2 and p=4 GPipe trainers' figures."""
    chunk_kinds = ("F", "I", "W")
    growth = (wider.outside_ms - gpipe.outside_ms) / 2  # per worker, ms
    return OpTimes(first={"F": gpipe.op_ms["F"][0] / 1e3, "B": gpipe.op_ms["B"][0] / 1e3,
                          "I": split.op_ms["I"][0] / 1e3, "W": split.op_ms["W"][0] / 1e3},
                   rest={"F": gpipe.op_ms["F"][1] / 1e3, "B": gpipe.op_ms["B"][1] / 1e3,
                         "I": split.op_ms["I"][1] / 1e3, "W": split.op_ms["W"][1] / 1e3},
                   boundary_extra=boundary_extra, message=gpipe.message_ms / 1e3,
                   per_step=(2 * gpipe.outside_ms - wider.outside_ms) / 1e3 if growth > 0 else gpipe.outside_ms / 1e3,
                   per_worker=max(0.0, growth) / 1e3, gap=(gpipe.gap_ms + split.gap_ms) / 2e3, layers=layers,
                   chunk_first={kind: chunked.op_ms[kind][0] / 1e3 for kind in chunk_kinds},
                   chunk_rest={kind: chunked.op_ms[kind][1] / 1e3 for kind in chunk_kinds},
                   chunk_layers=layers // 2)


def describe(times: OpTimes) -> str:
    return ("first " + format_ops({k: (1e3 * v,) for k, v in times.first.items()}) + "; others "
            + format_ops({k: (1e3 * v,) for k, v in times.rest.items()}) + f"; message {1e3 * times.message:.2f} ms; "
            f"gap per stage op {1e3 * times.gap:.2f} ms; per step {1e3 * times.per_step:.1f} ms + "
            f"{1e3 * times.per_worker:.1f} ms per worker")


# -- the tiny LLaMA on real CPU stages ----------------------------------------------------
def llama_flops_per_s(layers, seq_len: int, micro_batch_size: int, repeats: int = 5) -> tuple[float, float, float]:
    """This CPU's rate for the LLaMA's flops, calibrated on ONE block in this process (one
    thread, as a stage worker with cpus_per_stage=1): (its cost's F + B flops) / (its measured
    forward + backward time) for a micro-batch; also (F ms, B ms)."""
    block = next(spec for spec in layers if spec.cls.__name__ == "LlamaBlock")
    torch.manual_seed(0)
    module = block.build()
    x = torch.randn(micro_batch_size, seq_len, block.args[0].dim, requires_grad=True)
    forward, backward = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        y = module(x)
        middle = time.perf_counter()
        y.backward(torch.ones_like(y))
        end = time.perf_counter()
        forward.append(middle - start)
        backward.append(end - middle)
    f, b = statistics.median(forward[1:]), statistics.median(backward[1:])
    cost = block.cost
    flops = micro_batch_size * (cost.fwd_flops + cost.bwd_input_flops + cost.bwd_weight_flops)
    return flops / (f + b), 1e3 * f, 1e3 * b


def run_llama(args: argparse.Namespace, times: OpTimes | None) -> list[str]:
    """The tiny LLaMA on 2 stages, m = --llama-micro-batches of --llama-micro-batch-size
    sequences of --llama-seq-len tokens, GPipe, AdamW, the parameter balance: predicted by
    predict_step from its LayerCosts on a 'cluster' of this CPU (its flop rate calibrated on one
    block in this process; the message latency, per-op gap and per-step cost of the timed
    calibration's last round as link latency, op_overhead_s and step_overhead_s; the link's
    bandwidth and the memory bandwidth the optimizer and snapshot copy run at are flags), then
    measured. Returns the table row."""
    import raypipe
    from bench_vs_pippy import make_optimizer
    from raypipe.models.llama import get_config, llama_layers, llama_loss
    from raypipe.planning.cluster_spec import Cluster, Link
    from raypipe.planning.predict import predict_step

    config = get_config("tiny")
    seq_len, b, m = args.llama_seq_len, args.llama_micro_batch_size, args.llama_micro_batches
    layers = llama_layers("tiny", seq_len=seq_len)  # CPU attention: SDPA's causal kernel (fused)
    rate, block_f, block_b = llama_flops_per_s(layers, seq_len, b)
    times = times or OpTimes(first={}, rest={})
    link = Link(bandwidth_bytes_per_s=args.llama_link_bytes_per_s, latency_s=times.message)
    cpu = Cluster(name="this-cpu", peak_flops={"fp32": rate}, memory_bytes=2**40,
                  memory_bandwidth_bytes_per_s=args.llama_memory_bytes_per_s, gpus_per_node=64, intra_node=link,
                  inter_node=link, host_copy_bytes_per_s=args.llama_memory_bytes_per_s, achievable_fraction=1.0,
                  op_overhead_s=times.gap, step_overhead_s=max(0.0, times.per_step + 2 * times.per_worker))
    prediction = predict_step(layers, cpu, num_stages=2, num_micro_batches=m, schedule="gpipe", precision="fp32",
                              micro_batch_size=b, seq_len=seq_len, balance="parameters",
                              snapshot_every=args.snapshot_every)
    balance = list(prediction.balance)
    print(f"tiny LLaMA: one block's F {block_f:.1f} / B {block_b:.1f} ms for {b} x {seq_len} tokens -> "
          f"{rate / 1e9:.2f} GFLOP/s; balance {balance}; predicted pipeline {1e3 * prediction.pipeline_s:.1f} ms, "
          f"optimizer {1e3 * prediction.optimizer_s:.1f}, snapshot {1e3 * prediction.snapshot_exposed_s:.1f}, "
          f"per step {1e3 * (times.per_step + 2 * times.per_worker):.1f} -> {1e3 * prediction.step_s:.1f} ms; "
          f"stage compute per micro-batch {[round(1e3 * s / m, 1) for s in prediction.stage_compute_s]} ms", flush=True)
    pipeline = raypipe.PipelineConfig(num_stages=2, num_micro_batches=m, balance=balance, schedule="gpipe",
                                      snapshot_every=args.snapshot_every)
    trainer = raypipe.PipelineTrainer(layers, llama_loss, optimizer=make_optimizer("adamw"), config=pipeline)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (m * b, seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    step_times, results = [], []
    try:
        for _ in range(args.warmup):
            trainer.step(inputs, targets)
        for _ in range(args.rounds * args.steps):
            start = time.perf_counter()
            results.append(trainer.step(inputs, targets))
            step_times.append(time.perf_counter() - start)
    finally:
        trainer.shutdown()
    measured = [1e3 * t for t in round_medians(step_times, args.steps)]
    ops = {(kind, stage): statistics.mean(1e3 * (e.end - e.start) for r in results for e in r.timeline
                                          if e.op == kind and e.stage == stage) for kind in "FB" for stage in (0, 1)}
    step = statistics.median(measured)
    bubble = statistics.median(statistics.mean(r.bubble_fraction) for r in results)
    print(f"tiny LLaMA measured: {spread(measured, digits=0)} ms; mean stage ops F {ops[('F', 0)]:.1f}, "
          f"{ops[('F', 1)]:.1f} / B {ops[('B', 0)]:.1f}, {ops[('B', 1)]:.1f} ms (stage 0, 1)", flush=True)
    ratio = step / (1e3 * prediction.step_s)
    return [f"tiny LLaMA p=2 m={m} b={b} S={seq_len} gpipe, balance {balance}", f"{rate / 1e9:.2f}",
            f"{1e3 * prediction.step_s:.0f}", spread(measured, digits=0), f"{ratio:.3f}",
            f"{100 * prediction.bubble_fraction:.1f}", f"{100 * bubble:.1f}",
            f"F {ops[('F', 0)]:.1f}, {ops[('F', 1)]:.1f} / B {ops[('B', 0)]:.1f}, {ops[('B', 1)]:.1f}",
            "yes" if abs(ratio - 1) <= 0.20 else "no"]


def table_row(config: Config, nominal: float, rounds: list) -> list[str]:
    """The table's row of ``config`` from its rounds (medians over rounds, [min-max] where given)."""
    measured = [m.step_ms for m, *_ in rounds]
    predicted = [1e3 * sim[0] for _, _, sim, _ in rounds]
    planning = [1e3 * plan for *_, plan in rounds]
    ratios = [m / p for m, p in zip(measured, predicted)]
    predicted_bubble = statistics.median(100 * sim[1] for _, _, sim, _ in rounds)
    bubble = statistics.median(100 * m.bubble for m, *_ in rounds)
    diff = statistics.median(100 * (m.bubble - sim[1]) for m, _, sim, _ in rounds)
    ratio = statistics.median(ratios)
    last = rounds[-1][0]
    return [config.name, f"{1e3 * nominal:.0f}", f"{statistics.median(planning):.0f}",
            f"{statistics.median(predicted):.0f}", spread(measured, digits=0), spread(ratios),
            f"{statistics.median(measured) / (1e3 * nominal):.3f}", f"{predicted_bubble:.1f}", f"{bubble:.1f}",
            f"{diff:+.1f}", f"{statistics.median(m.window_ms for m, *_ in rounds):.0f}",
            f"{statistics.median(m.outside_ms for m, *_ in rounds):.1f}",
            f"{statistics.median(m.gap_ms for m, *_ in rounds):.2f}",
            f"{statistics.median(m.message_ms for m, *_ in rounds):.2f}", format_ops(last.op_ms),
            "yes" if abs(ratio - 1) <= 0.10 and abs(diff) <= 2 else "no"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=4, steps=6, warmup=2)
    parser.add_argument("--only", nargs="*", default=None, help="configuration names (default: all; see --list)")
    parser.add_argument("--list", action="store_true", help="print the configurations and exit")
    parser.add_argument("--layers-per-stage", type=int, default=2, help="timed layers per stage (default 2)")
    parser.add_argument("--forward-ms", type=float, default=4.0, help="each layer's forward sleep (default 4)")
    parser.add_argument("--input-grad-ms", type=float, default=4.0, help="input-gradient sleep (default 4)")
    parser.add_argument("--weight-grad-ms", type=float, default=4.0, help="weight-gradient sleep (default 4)")
    parser.add_argument("--width", type=int, default=8, help="features per layer (default 8)")
    parser.add_argument("--rows-per-micro-batch", type=int, default=4, help="(default 4)")
    parser.add_argument("--snapshot-every", type=int, default=None,
                        help="raypipe's snapshot_every (default: PipelineConfig's, every step)")
    parser.add_argument("--llama", action="store_true",
                        help="also the tiny LLaMA on 2 real CPU stages (predicted from its LayerCosts with this "
                             "CPU's rate, calibrated on one block)")
    parser.add_argument("--llama-seq-len", type=int, default=256, help="(default 256, the tiny job's)")
    parser.add_argument("--llama-micro-batch-size", type=int, default=2, help="(default 2, the tiny job's)")
    parser.add_argument("--llama-micro-batches", type=int, default=8, help="(default 8, the tiny job's)")
    parser.add_argument("--llama-link-bytes-per-s", type=float, default=1e9,
                        help="the p2p channel's bandwidth the LLaMA's prediction assumes (default 1e9)")
    parser.add_argument("--llama-memory-bytes-per-s", type=float, default=5e9,
                        help="memory bandwidth for the optimizer step and the snapshot copy (default 5e9)")
    args = parser.parse_args()
    if args.list:
        for config in CONFIGS:
            print(config)
        raise SystemExit(0)
    if args.layers_per_stage < 2 or args.layers_per_stage % 2:
        parser.error(f"--layers-per-stage must be even and >= 2 (got {args.layers_per_stage}): the chunk "
                     f"calibration and the chunked configurations cut a stage into 2 chunks")
    names = {config.name for config in CONFIGS}
    if args.only is not None and set(args.only) - names:
        parser.error(f"unknown configurations {sorted(set(args.only) - names)}; known: {sorted(names)}")
    if args.snapshot_every is None:
        from raypipe import PipelineConfig

        args.snapshot_every = PipelineConfig.snapshot_every
    return args


def main() -> None:
    import ray

    args = parse_args()
    torch.set_num_threads(1)
    configs = [c for c in CONFIGS if args.only is None or c.name in args.only]
    llama_row = None
    print(command_line())
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, ray {ray.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; {args.layers_per_stage} timed layers per stage (F {args.forward_ms:g} / "
          f"I {args.input_grad_ms:g} / W {args.weight_grad_ms:g} ms each), {args.rows_per_micro_batch} rows of "
          f"{args.width} per micro-batch, sgd, p2p, snapshot_every={args.snapshot_every}", flush=True)
    boundary_extra = boundary_overshoot()
    print(f"a TimedBoundary's sleep overshoots by {1e3 * boundary_extra:.3f} ms here", flush=True)
    processes = sum(c.stages for c in CALIBRATIONS) + max(c.stages * c.replicas for c in configs)
    ray.init(address="local", num_cpus=processes, include_dashboard=False, logging_level="WARNING")
    nominal = nominal_times(args)
    rows, calibration, latest = [], [], None
    try:
        calibration = [Runner(args, config) for config in CALIBRATIONS]
        for runner in calibration:
            runner.run(args.warmup)
        for config in configs:
            started = time.perf_counter()
            runner = Runner(args, config)
            try:
                runner.run(args.warmup)
                rounds = []  # (measured, calibrated times, calibrated sim (step, bubble), planning step)
                for index in range(args.rounds):
                    gpipe, split, wider, chunked = (c.run(args.steps) for c in calibration)
                    measured = runner.run(args.steps)
                    latest = calibrated_times(gpipe, split, wider, chunked, boundary_extra, args.layers_per_stage)
                    rounds.append((measured, latest, simulate(args, config, latest),
                                   planning_prediction(args, config, latest)[0]))
                    print(f"  {config.name} round {index + 1}: measured {measured.step_ms:.0f} ms, calibrated "
                          f"{1e3 * rounds[-1][2][0]:.0f} ms ({describe(latest)})", flush=True)
            finally:
                runner.close()
            rows.append(table_row(config, simulate(args, config, nominal)[0], rounds))
            print(f"{config.name}: {' | '.join(rows[-1][1:])} ({time.perf_counter() - started:.0f} s, load "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
        for runner in calibration:
            runner.close()
        calibration = []
        if args.llama:
            try:
                llama_row = run_llama(args, latest)
            except Exception:  # keep the timed table
                import traceback

                traceback.print_exc()
    finally:
        for runner in calibration:
            runner.close()
        ray.shutdown()
    print()
    print_table(["config", "nominal sim ms", "planning ms", "calibrated sim ms", "measured ms, median [min-max]",
                 "measured / calibrated, per round", "measured / nominal", "predicted bubble %", "measured bubble %",
                 "bubble diff (points)", "compute window ms", "step - window ms", "gap per op ms", "message ms",
                 "stage op ms (first, others)", "within targets"], rows)
    if llama_row is not None:
        print()
        print_table(["config", "calibrated GFLOP/s", "predicted ms", "measured ms, median [min-max]",
                     "measured / predicted", "predicted bubble %", "measured bubble %",
                     "measured stage op ms (stage 0, 1)", "within 20%"], [llama_row])
    print(command_line())


if __name__ == "__main__":
    main()
