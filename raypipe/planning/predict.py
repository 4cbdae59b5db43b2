"""Predicted step time, tokens/s and MFU of a pipeline on a described cluster, and the
search ``raypipe plan --cluster`` runs over (replicas, stages, micro-batches, schedule,
recompute, ZeRO-1). No Ray, no torch.

**The cluster** (:class:`Cluster`, ``planning/clusters/*.json`` or a user's file): per device
the peak flop rate of each precision, memory, memory bandwidth, host-copy bandwidth, and an
``achievable_fraction`` of peak that compute reaches; per GPU the link to a GPU on its node
(NVLink) and to one on another node (its NIC); GPUs per node.

**Placement**: stage ``s`` of replica ``r`` on GPU ``r * p + s``, GPUs ``8k .. 8k+7`` on node
``k``: a replica's stages on consecutive GPUs, as raypipe places each replica in its own PACK
placement group (as few nodes as hold it), its bundles in stage order.

**One step** (:func:`predict_step`):

1. *The pipeline*: :func:`~raypipe.core.simulator.simulate_timed` runs the lowered schedule
   with per-op times from the layers' costs: F = the stage's ``fwd_flops`` x b / (peak x
   achievable_fraction), B = (``bwd_input_flops`` + ``bwd_weight_flops``) x b / the same, plus a
   recomputed micro-batch's forward; a message takes its link's latency plus the stage
   output's bytes (``output_bytes`` x b) over its bandwidth. Sends are buffered, as the
   executors post them (``buffered_sends=True``). Each distinct placement pattern of the
   replicas is simulated; the slowest sets the pace.
2. *Data-parallel reduction*, per stage, started when the stage's last backward ends (the
   executor starts it then, overlapping the other stages' remaining work): a ring all-reduce
   of the stage's gradients, ``2 (d-1)/d x bytes / bw + 2 (d-1) x latency``, or with ZeRO-1 a
   reduce-scatter (half of that); the link is NVLink when the stage's replicas share a node,
   else the inter-node link.
3. *The step decision* (global clip norm, non-finite check) waits for every stage's
   reduction; then each stage's *optimizer step*, memory-bound: it reads and writes the
   optimizer state and the fp32 main weights, reads the gradients and writes the compute
   weights (1/d of all that with ZeRO-1), over the memory bandwidth; with ZeRO-1 an all-gather
   of the compute weights, ``(d-1)/d x bytes / bw``, follows.
4. *The snapshot copy* (``snapshot_every`` > 0): each worker copies its state (weights,
   main weights, optimizer state: what :func:`raypipe.planning.plan.snapshot_bytes` counts) to
   host memory at the host-copy bandwidth. The copy runs on a side stream but the compute
   stream waits for it before the next step's first op (``stage/checkpointing.py``), so it
   hides only in the time the stage waits anyway for its first input (the pipeline's
   warm-up bubble); the rest, for the slowest stage, is added once per ``snapshot_every``
   steps.

Not modelled: link contention (messages in flight never slow each other), kernel-launch
and Python overheads, NCCL's protocol switch for small messages, stragglers; the
``achievable_fraction`` stands for everything that makes compute slower than peak.

**MFU** = the model's flops of one step (forward and both backward halves of every layer,
no recompute: the 6 N tokens of the matmuls plus attention and the cross entropy) / (step
time x GPUs x the precision's peak).

**The search** (:func:`search_plans`): for every ``p`` dividing the GPU count up to the
layer count, ``d = N / p``, micro-batches ``m`` in ``{p, 2p, 4p}`` (or what a fixed global
batch leaves), micro-batch sizes 1 and 2, schedules gpipe and 1F1B, recompute never and
always, ZeRO-1 off and on (d > 1): the layers balanced by time (``--balance time``), or, where
that split does not fit, the fastest split that does (the memory model's exact DP, printed
as a list); a configuration that fits nowhere is dropped. Candidates are simulated in
order of an optimistic step time (the busiest stage's compute, plus the F and B of the
stages before it and the messages between, plus the optimizer tail), which no simulated
step undercuts, and the search stops when the next optimistic figure cannot beat the
``top``-th best found: the result is the exact best under the model.
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from raypipe.config import CHECKPOINT_MODES
from raypipe.core.lowering import lower
from raypipe.core.ops import B, F, OPTIMIZER_STEP, REDUCE_GRAD, LoweredOp, Op
from raypipe.core.partition import partition_by_cost
from raypipe.core.schedule import gpipe_schedule, make_schedule, one_f_one_b_schedule
from raypipe.core.timed_simulation import simulate_timed
from raypipe.models.layers import LayerCost, LayerSpec
from raypipe.models.llama import LlamaConfig
from raypipe.models.llama_costs import llama_layer_costs
from raypipe.models.llama_memory import (estimate_layer_activation_bytes, layer_kinds, layer_parameter_counts,
                                         stage_input_bytes, static_bytes_per_parameter)
from raypipe.planning.balance import balance_by_time, cost_stage_bytes, layer_step_flops, min_max_partition

CLUSTERS_DIR = Path(__file__).resolve().parent / "clusters"
PRESET_CLUSTERS = ("h100", "h200")
SEARCH_SCHEDULES = ("gpipe", "1f1b")
SEARCH_RECOMPUTE = ("never", "always")
SEARCH_MICRO_BATCH_SIZES = (1, 2)
SEARCH_MICRO_BATCHES_PER_STAGE = (1, 2, 4)  # m = p, 2p, 4p: a bubble of at most (p-1)/(5p-1) ~ 20% at 4p
_COMPUTE_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}  # raypipe leaves TF32 off: fp32 is fp32


# -- the cluster --------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    """A point-to-point path, per GPU: bytes/s one way and the latency of one message."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def seconds(self, num_bytes: float) -> float:
        """Time to move ``num_bytes`` as one message."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Cluster:
    """A cluster of identical nodes of ``gpus_per_node`` GPUs (see the module docstring)."""

    name: str
    peak_flops: dict[str, float]  # per precision ("bf16", "fp16", "fp32"; "tf32" for reference)
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    host_copy_bytes_per_s: float
    achievable_fraction: float  # of peak, for the layers' flops (the MFU ceiling of a busy GPU)
    source: str = ""
    description: str = ""

    def peak(self, precision: str) -> float:
        """Peak flop/s of ``precision``'s compute (what MFU divides by)."""
        key = _COMPUTE_PRECISION.get(precision, precision)
        if key not in self.peak_flops:
            raise ValueError(f"cluster {self.name!r} gives no peak_flops for {key!r} (it has "
                             f"{sorted(self.peak_flops)})")
        return self.peak_flops[key]

    def flops_per_s(self, precision: str) -> float:
        """The rate the layers' flops run at: peak x achievable_fraction."""
        return self.peak(precision) * self.achievable_fraction

    def node(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def link(self, gpu_a: int, gpu_b: int) -> Link:
        """NVLink between GPUs of one node, the inter-node link otherwise."""
        return self.intra_node if self.node(gpu_a) == self.node(gpu_b) else self.inter_node

    @classmethod
    def from_dict(cls, data: dict, origin: str = "cluster") -> Cluster:
        """A cluster from its JSON form; a missing or bad field raises ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"{origin}: a cluster is a JSON object, not {type(data).__name__}")

        def number(value: object, name: str, integer: bool = False) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value) or (integer and value != int(value)):
                raise ValueError(f"{origin}: {name}={value!r} must be a {'whole ' if integer else ''}number > 0")
            return int(value) if integer else float(value)

        def get(name: str) -> object:
            if name not in data:
                raise ValueError(f"{origin}: missing field {name!r} (see raypipe/planning/clusters/h100.json)")
            return data[name]

        def link(name: str) -> Link:
            value = get(name)
            if not isinstance(value, dict) or set(value) != {"bandwidth_bytes_per_s", "latency_s"}:
                raise ValueError(f"{origin}: {name} must be {{\"bandwidth_bytes_per_s\": ..., \"latency_s\": ...}}")
            latency = value["latency_s"]
            if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < math.inf:
                raise ValueError(f"{origin}: {name}.latency_s={latency!r} must be a number >= 0")
            return Link(number(value["bandwidth_bytes_per_s"], f"{name}.bandwidth_bytes_per_s"), float(latency))

        peaks = get("peak_flops")
        if not isinstance(peaks, dict) or not peaks:
            raise ValueError(f"{origin}: peak_flops must map precisions (bf16, fp16, fp32) to flop/s")
        fraction = number(get("achievable_fraction"), "achievable_fraction")
        if fraction > 1:
            raise ValueError(f"{origin}: achievable_fraction={fraction!r} must be in (0, 1]")
        known = {"name", "description", "peak_flops", "memory_bytes", "memory_bandwidth_bytes_per_s", "gpus_per_node",
                 "intra_node", "inter_node", "host_copy_bytes_per_s", "achievable_fraction", "source"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{origin}: unknown field(s) {unknown}; a cluster has {sorted(known)}")
        return cls(name=str(data.get("name", origin)),
                   peak_flops={str(key): number(value, f"peak_flops.{key}") for key, value in peaks.items()},
                   memory_bytes=number(get("memory_bytes"), "memory_bytes", integer=True),
                   memory_bandwidth_bytes_per_s=number(get("memory_bandwidth_bytes_per_s"),
                                                       "memory_bandwidth_bytes_per_s"),
                   gpus_per_node=number(get("gpus_per_node"), "gpus_per_node", integer=True),
                   intra_node=link("intra_node"), inter_node=link("inter_node"),
                   host_copy_bytes_per_s=number(get("host_copy_bytes_per_s"), "host_copy_bytes_per_s"),
                   achievable_fraction=fraction, source=str(data.get("source", "")),
                   description=str(data.get("description", "")))


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A preset (``"h100"``, ``"h200"``: ``raypipe/planning/clusters/NAME.json``) or a JSON file."""
    text = str(name_or_path)
    path = CLUSTERS_DIR / f"{text}.json" if text in PRESET_CLUSTERS else Path(text)
    if not path.is_file():
        raise ValueError(f"unknown cluster {text!r}: give a preset ({', '.join(PRESET_CLUSTERS)}) or a JSON file "
                         f"like {CLUSTERS_DIR / 'h100.json'}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"cluster file {path}: not JSON ({error})") from None
    return Cluster.from_dict(data, origin=text if text in PRESET_CLUSTERS else f"cluster file {path}")


# -- one step -----------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    """The predicted step of one configuration (times in seconds, memory in bytes).

    ``bubble_fraction`` is the share of the GPUs' step time not spent computing (the
    pipeline's bubble, the exposed reduction, optimizer and snapshot); ``pipeline_bubble``
    that of the simulated pipeline alone. ``stage_compute_s`` is each stage's F and B
    time in one step; ``stage_bytes`` each stage's memory (the memory model's total).
    """

    step_s: float
    bubble_fraction: float
    pipeline_bubble: float
    tokens_per_s: float
    mfu: float
    pipeline_s: float  # the simulated pipeline, until every stage's last op
    reduction_exposed_s: float  # what the data-parallel reduction adds after the pipeline
    optimizer_s: float  # the optimizer step (and ZeRO-1's all-gather) of the slowest stage
    snapshot_exposed_s: float  # per step: the snapshot copy not hidden in the warm-up bubble
    stage_compute_s: tuple[float, ...]
    stage_bytes: tuple[int, ...]
    fits: bool | None  # None: no memory limit given
    balance: tuple[int, ...]
    tokens_per_step: int
    model_flops_per_step: float

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_s, "tokens_per_second": self.tokens_per_s, "mfu": self.mfu,
                "bubble_fraction": self.bubble_fraction, "pipeline_bubble": self.pipeline_bubble,
                "pipeline_s": self.pipeline_s, "reduction_exposed_s": self.reduction_exposed_s,
                "optimizer_s": self.optimizer_s, "snapshot_exposed_s": self.snapshot_exposed_s,
                "stage_compute_s": list(self.stage_compute_s), "stage_bytes": list(self.stage_bytes),
                "fits": self.fits, "balance": list(self.balance), "tokens_per_step": self.tokens_per_step,
                "model_flops_per_step": self.model_flops_per_step}


@dataclass(frozen=True)
class StepShape:
    """Everything of a configuration but the layers and the cluster."""

    num_replicas: int = 1
    num_stages: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    activation_checkpoint: str = "never"
    precision: str = "bf16"
    shard_optimizer: bool = False
    micro_batch_size: int = 1
    seq_len: int = 1
    amp: str | None = None
    snapshot_every: int = 1

    @property
    def num_gpus(self) -> int:
        return self.num_replicas * self.num_stages


def predict_step(layers: Sequence[LayerCost | LayerSpec], cluster: Cluster, *, num_replicas: int = 1,
                 num_stages: int = 1, num_micro_batches: int = 1, schedule: str = "1f1b",
                 activation_checkpoint: str = "never", precision: str = "bf16", shard_optimizer: bool = False,
                 micro_batch_size: int = 1, seq_len: int = 1, balance: str | Sequence[int] = "time",
                 amp: str | None = None, snapshot_every: int = 1,
                 stage_bytes: Callable[[int, int, int], int] | None = None,
                 gpu_memory_bytes: int | None = None) -> Prediction:
    """The predicted step of ``layers`` (their :class:`LayerCost`, per sequence of ``seq_len``
    tokens) on ``cluster`` (see the module docstring for the model).

    ``balance``: "time" (:func:`~raypipe.planning.balance.balance_by_time`, as
    ``PipelineConfig(balance="time")``), "parameters" or layers per stage.
    ``stage_bytes(stage, first, end)`` gives a stage's memory (default: from the costs,
    :func:`~raypipe.planning.balance.cost_stage_bytes`); ``fits`` compares it with
    ``gpu_memory_bytes`` (default: the cluster's memory).
    """
    costs = [layer.cost if isinstance(layer, LayerSpec) else layer for layer in layers]
    if any(not isinstance(cost, LayerCost) for cost in costs):
        raise ValueError("predict_step needs every layer's LayerCost (LayerSpec(..., cost=...) or LayerCost)")
    shape = StepShape(num_replicas, num_stages, num_micro_batches, schedule, activation_checkpoint, precision,
                      shard_optimizer, micro_batch_size, seq_len, amp, snapshot_every)
    _check_shape(shape, len(costs))
    if balance == "time":
        split = balance_by_time(costs, num_stages, activation_checkpoint=activation_checkpoint,
                                num_micro_batches=num_micro_batches)
    elif balance == "parameters":
        split = partition_by_cost([cost.param_bytes for cost in costs], num_stages)
    else:
        split = list(balance)
        if len(split) != num_stages or any(size < 1 for size in split) or sum(split) != len(costs):
            raise ValueError(f"balance {split} needs {num_stages} positive entries summing to {len(costs)} layers")
    if stage_bytes is None:
        stage_bytes = cost_stage_bytes(costs, num_stages, num_micro_batches=num_micro_batches,
                                       micro_batch_size=micro_batch_size, schedule=schedule,
                                       activation_checkpoint=activation_checkpoint, precision=precision, amp=amp,
                                       optimizer_shards=num_replicas if shard_optimizer else 1)
    bounds = _bounds(split)
    memory = tuple(stage_bytes(stage, start, end) for stage, (start, end) in enumerate(bounds))
    limit = cluster.memory_bytes if gpu_memory_bytes is None else gpu_memory_bytes
    per_param = static_bytes_per_parameter(precision, amp)
    parameters = [round(sum(cost.param_bytes for cost in costs[start:end]) / per_param.weights)
                  for start, end in bounds]
    return _predict(costs, split, parameters, memory, limit, shape, cluster)


def _check_shape(shape: StepShape, num_layers: int) -> None:
    for name in ("num_replicas", "num_stages", "num_micro_batches", "micro_batch_size", "seq_len"):
        value = getattr(shape, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if shape.num_stages > num_layers:
        raise ValueError(f"num_stages={shape.num_stages}: only {num_layers} layers to split")
    if shape.activation_checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"activation_checkpoint={shape.activation_checkpoint!r} must be one of {CHECKPOINT_MODES}")
    if isinstance(shape.snapshot_every, bool) or not isinstance(shape.snapshot_every, int) or shape.snapshot_every < 0:
        raise ValueError(f"snapshot_every={shape.snapshot_every!r} must be an int >= 0")


def _bounds(split: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in split:
        out.append((start, start + size))
        start += size
    return out


def _schedule(name: str, num_stages: int, num_micro_batches: int) -> list[list[Op]]:
    """The schedule called ``name``. GPipe's and 1F1B's are built directly: make_schedule's
    dry-run of them (checked for every shape in the schedule tests) costs the search more
    than everything else at 128 stages; other schedules go through make_schedule."""
    if name == "gpipe":
        return gpipe_schedule(num_stages, num_micro_batches)
    if name == "1f1b":
        return one_f_one_b_schedule(num_stages, num_micro_batches)
    return make_schedule(name, num_stages, num_micro_batches)


@functools.lru_cache(maxsize=64)
def _lowered(schedule: str, num_stages: int, num_micro_batches: int) -> tuple[tuple[LoweredOp, ...], ...]:
    # once per shape: the search simulates many configurations of one schedule shape
    return tuple(tuple(ops) for ops in lower(_schedule(schedule, num_stages, num_micro_batches)))


@dataclass(frozen=True)
class _StageTimes:
    """Per stage: one micro-batch's F, its B, the forward a recompute adds, and the
    message to the next stage (bytes)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    recompute: tuple[float, ...]
    message_bytes: tuple[float, ...]
    backward_input: tuple[float, ...]  # the part of backward a split schedule runs as I (the rest as W)


def _stage_times(costs: Sequence[LayerCost], split: Sequence[int], shape: StepShape, rate: float) -> _StageTimes:
    forward, backward, message, backward_input = [], [], [], []
    for start, end in _bounds(split):
        part = costs[start:end]
        backward_input.append(shape.micro_batch_size * sum(cost.bwd_input_flops for cost in part) / rate)
        forward.append(shape.micro_batch_size * sum(cost.fwd_flops for cost in part) / rate)
        backward.append(shape.micro_batch_size * sum(cost.bwd_input_flops + cost.bwd_weight_flops
                                                     for cost in part) / rate)
        message.append(shape.micro_batch_size * costs[end - 1].output_bytes)
    recompute = forward if shape.activation_checkpoint != "never" else [0.0] * len(forward)
    return _StageTimes(tuple(forward), tuple(backward), tuple(recompute), tuple(message), tuple(backward_input))


def _recomputed(shape: StepShape, micro_batch: int | None) -> bool:
    if shape.activation_checkpoint == "always":
        return True
    return shape.activation_checkpoint == "except_last" and micro_batch != shape.num_micro_batches - 1


def _simulate_pipeline(times: _StageTimes, shape: StepShape, cluster: Cluster, first_gpu: int):
    """The timed pipeline of the replica whose stage 0 is on GPU ``first_gpu``."""

    def op_seconds(stage: int, op: LoweredOp) -> float:
        if op.kind == F:
            return times.forward[stage]
        recompute = times.recompute[stage] if _recomputed(shape, op.micro_batch) else 0.0
        if op.kind == B:
            return times.backward[stage] + recompute
        if op.kind == "I":  # a split backward's input gradient (zero-bubble schedules), with any recompute
            return times.backward_input[stage] + recompute
        if op.kind == "W":
            return times.backward[stage] - times.backward_input[stage]
        if op.kind in (REDUCE_GRAD, OPTIMIZER_STEP):
            return 0.0  # the reduction, decision and optimizer are added after the pipeline (see the module)
        raise ValueError(f"the predictor has no time for {op!r} (stage {stage}) of schedule {shape.schedule!r}")

    def message_seconds(sender: int, receiver: int, op: LoweredOp) -> float:
        boundary = min(sender, receiver)  # activations of stage s -> s+1, and their gradients back
        return cluster.link(first_gpu + sender, first_gpu + receiver).seconds(times.message_bytes[boundary])

    lowered = [list(ops) for ops in _lowered(shape.schedule, shape.num_stages, shape.num_micro_batches)]
    return simulate_timed(lowered, op_seconds, message_seconds, buffered_sends=True)


def _replica_starts(shape: StepShape, cluster: Cluster) -> list[int]:
    """One first GPU per distinct placement of a replica's stages on nodes (it depends only on
    the replica's first GPU modulo the node size, so the first ``gpus_per_node`` replicas have them all)."""
    seen, starts = set(), []
    for replica in range(min(shape.num_replicas, cluster.gpus_per_node)):
        first = replica * shape.num_stages
        pattern = tuple(cluster.node(first + s) - cluster.node(first) for s in range(shape.num_stages))
        if pattern not in seen:
            seen.add(pattern)
            starts.append(first)
    return starts


def _collective_link(shape: StepShape, cluster: Cluster, stage: int) -> Link:
    """The link a ring over the replicas of ``stage`` is limited by."""
    first, last = stage, (shape.num_replicas - 1) * shape.num_stages + stage
    return cluster.intra_node if cluster.node(first) == cluster.node(last) else cluster.inter_node


def _tail_seconds(parameters: Sequence[int], shape: StepShape, cluster: Cluster
                  ) -> tuple[list[float], list[float], list[float]]:
    """Per stage: the gradient reduction, the optimizer step (with ZeRO-1's all-gather), the snapshot copy."""
    per_param = static_bytes_per_parameter(shape.precision, shape.amp)
    d = shape.num_replicas
    shards = d if shape.shard_optimizer else 1
    reduce, optimizer, snapshot = [], [], []
    for stage, count in enumerate(parameters):
        link = _collective_link(shape, cluster, stage)
        gradients = count * per_param.gradients
        if d == 1:
            reduction = gather = 0.0
        elif shape.shard_optimizer:  # reduce-scatter, then an all-gather of the compute weights
            reduction = (d - 1) / d * gradients / link.bandwidth_bytes_per_s + (d - 1) * link.latency_s
            gather = (d - 1) / d * count * per_param.weights / link.bandwidth_bytes_per_s + (d - 1) * link.latency_s
        else:  # ring all-reduce
            reduction = 2 * (d - 1) / d * gradients / link.bandwidth_bytes_per_s + 2 * (d - 1) * link.latency_s
            gather = 0.0
        # Adam reads and writes its moments and the main weights (fp32 weights without mixed
        # precision), reads the gradients and writes the compute weights, for the part it owns
        if per_param.master:
            touched = 2 * per_param.optimizer + 2 * per_param.master + per_param.gradients + per_param.weights
        else:
            touched = 2 * per_param.optimizer + 2 * per_param.weights + per_param.gradients
        optimizer.append(count * touched / shards / cluster.memory_bandwidth_bytes_per_s + gather)
        reduce.append(reduction)
        # the snapshot: main weights and optimizer state it owns, compute weights of the rest
        owned = count * (per_param.master + per_param.optimizer) / shards
        others = count * per_param.weights * ((1 - 1 / shards) if per_param.master else 1.0)
        snapshot.append((owned + others) / cluster.host_copy_bytes_per_s if shape.snapshot_every else 0.0)
    return reduce, optimizer, snapshot


def _predict(costs: Sequence[LayerCost], split: Sequence[int], parameters: Sequence[int],
             memory: Sequence[int], limit: int | None, shape: StepShape, cluster: Cluster) -> Prediction:
    rate = cluster.flops_per_s(shape.precision)
    times = _stage_times(costs, split, shape, rate)
    reduce, optimizer, snapshot = _tail_seconds(parameters, shape, cluster)
    step = pipeline = reduction_exposed = snapshot_exposed = 0.0
    pipeline_bubble = 0.0
    for first_gpu in _replica_starts(shape, cluster):
        run = _simulate_pipeline(times, shape, cluster, first_gpu)
        last_compute = [0.0] * shape.num_stages
        first_compute = [math.inf] * shape.num_stages
        for timed in run.timeline:
            if timed.op.kind in (F, B, "I", "W"):
                last_compute[timed.stage] = max(last_compute[timed.stage], timed.end)
                first_compute[timed.stage] = min(first_compute[timed.stage], timed.start)
        decided = max([run.step_s] + [end + seconds for end, seconds in zip(last_compute, reduce)])
        tail = max(optimizer)
        hidden = [min(copy, start) for copy, start in zip(snapshot, first_compute)]
        exposed = max(copy - free for copy, free in zip(snapshot, hidden)) / shape.snapshot_every \
            if shape.snapshot_every else 0.0
        total = decided + tail + exposed
        if total >= step:
            step, pipeline, reduction_exposed, snapshot_exposed = total, run.step_s, decided - run.step_s, exposed
            pipeline_bubble = 1 - sum(run.busy_s) / (shape.num_stages * run.step_s) if run.step_s else 0.0
    compute = [shape.num_micro_batches * (f + b) + sum(times.recompute[s] for mb in range(shape.num_micro_batches)
                                                        if _recomputed(shape, mb))
               for s, (f, b) in enumerate(zip(times.forward, times.backward))]
    tokens = shape.num_replicas * shape.num_micro_batches * shape.micro_batch_size * shape.seq_len
    model_flops = (shape.num_replicas * shape.num_micro_batches * shape.micro_batch_size
                   * sum(cost.train_flops for cost in costs))
    return Prediction(
        step_s=step, bubble_fraction=1 - sum(compute) / (shape.num_stages * step) if step else 0.0,
        pipeline_bubble=pipeline_bubble, tokens_per_s=tokens / step if step else 0.0,
        mfu=model_flops / (step * shape.num_gpus * cluster.peak(shape.precision)) if step else 0.0,
        pipeline_s=pipeline, reduction_exposed_s=reduction_exposed, optimizer_s=max(optimizer),
        snapshot_exposed_s=snapshot_exposed, stage_compute_s=tuple(compute), stage_bytes=tuple(memory),
        fits=None if limit is None else max(memory) <= limit, balance=tuple(split), tokens_per_step=tokens,
        model_flops_per_step=model_flops)


def optimistic_step_s(costs: Sequence[LayerCost], split: Sequence[int], parameters: Sequence[int],
                      shape: StepShape, cluster: Cluster) -> float:
    """A step time no simulated step of this configuration undercuts: for each stage, the
    first micro-batch's forwards and messages through the stages before it, the stage's
    whole compute, and the last gradient's way back; plus the slowest optimizer tail."""
    times = _stage_times(costs, split, shape, cluster.flops_per_s(shape.precision))
    _, optimizer, _ = _tail_seconds(parameters, shape, cluster)
    fastest = min(cluster.intra_node, cluster.inter_node, key=lambda link: link.latency_s)
    best = 0.0
    lead = 0.0  # F and B of the stages before, and the messages between them
    for stage in range(shape.num_stages):
        compute = shape.num_micro_batches * (times.forward[stage] + times.backward[stage]) + sum(
            times.recompute[stage] for mb in range(shape.num_micro_batches) if _recomputed(shape, mb))
        best = max(best, lead + compute)
        message = fastest.latency_s + times.message_bytes[stage] / max(
            cluster.intra_node.bandwidth_bytes_per_s, cluster.inter_node.bandwidth_bytes_per_s)
        lead += times.forward[stage] + times.backward[stage] + 2 * message
    return best + max(optimizer)


# -- the search over configurations of a LLaMA ---------------------------------------

@dataclass(frozen=True)
class Candidate:
    """One configuration the search evaluated, with its prediction."""

    shape: StepShape
    balance_mode: str  # "time" (--balance time) or "memory" (the fastest split that fits: a list)
    prediction: Prediction

    def to_dict(self) -> dict:
        shape = self.shape
        return {"num_replicas": shape.num_replicas, "num_stages": shape.num_stages,
                "num_micro_batches": shape.num_micro_batches, "micro_batch_size": shape.micro_batch_size,
                "seq_len": shape.seq_len, "schedule": shape.schedule,
                "activation_checkpoint": shape.activation_checkpoint, "shard_optimizer": shape.shard_optimizer,
                "precision": shape.precision, "balance_mode": self.balance_mode, **self.prediction.to_dict()}


@dataclass
class SearchResult:
    """The best configurations, fastest first; ``smallest_stage_bytes`` and ``reason`` say
    why nothing fits when ``best`` is empty."""

    best: list[Candidate]
    evaluated: int  # configurations whose memory was checked
    simulated: int  # configurations simulated
    reason: str | None = None
    smallest_stage_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


class LlamaStageBytes:
    """A LLaMA stage's total memory as :func:`~raypipe.planning.memory.estimate_stage` counts it
    (no offload, no segments), fast enough for the search: per schedule shape, the pairs
    (kept graphs, kept inputs) the schedule's walk can peak at, reused for every split."""

    def __init__(self, config: LlamaConfig, shape: StepShape, fused_attention: bool = True) -> None:
        self.config, self.shape = config, shape
        kinds = layer_kinds(config)
        common = {"micro_batch_size": shape.micro_batch_size, "seq_len": shape.seq_len,
                  "precision": shape.precision}
        by_kind = {kind: estimate_layer_activation_bytes(config, kind, fused_attention=fused_attention,
                                                         amp=shape.amp, **common)
                   for kind in ("embedding", "block", "head", "loss")}
        self._saved = [0]
        for kind in kinds:
            self._saved.append(self._saved[-1] + by_kind[kind])
        self._loss = by_kind["loss"]
        self._input = [stage_input_bytes(config, index, amp=shape.amp, **common) for index in range(len(kinds) + 1)]
        counts = layer_parameter_counts(config)
        self._params = [0]
        for count in counts:
            self._params.append(self._params[-1] + count)
        per_param = static_bytes_per_parameter(shape.precision, shape.amp)
        shards = shape.num_replicas if shape.shard_optimizer else 1
        self._per_param_unsharded = per_param.weights + per_param.gradients
        self._per_param_sharded = (per_param.master, per_param.optimizer, shards)
        self._peaks = _walk_peaks(shape.schedule, shape.num_stages, shape.num_micro_batches,
                                  shape.activation_checkpoint)
        self.num_layers = len(kinds)

    def parameters(self, start: int, end: int) -> int:
        return self._params[end] - self._params[start]

    def __call__(self, stage: int, start: int, end: int) -> int:
        count = self.parameters(start, end)
        master, optimizer, shards = self._per_param_sharded
        static = count * self._per_param_unsharded + -(-count * master // shards) + -(-count * optimizer // shards)
        holds_loss = end == self.num_layers
        graph = self._saved[end] - self._saved[start] + (self._loss if holds_loss else self._input[end])
        kept_input = self._input[start]
        return static + max(graphs * graph + inputs * kept_input for graphs, inputs in self._peaks[stage])


@functools.lru_cache(maxsize=256)
def _walk_peaks(schedule: str, num_stages: int, num_micro_batches: int, activation_checkpoint: str
                ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, every (kept graphs, kept inputs) the memory model's walk
    (:func:`raypipe.planning.memory._walk`, no offload) may peak at."""
    out = []
    for ops in _schedule(schedule, num_stages, num_micro_batches):
        graphs = inputs = 0
        points = {(0, 0)}
        for op in ops:
            recompute = activation_checkpoint == "always" or (
                activation_checkpoint == "except_last" and op.micro_batch != num_micro_batches - 1)
            if op.kind == F:
                graphs, inputs = (graphs, inputs + 1) if recompute else (graphs + 1, inputs)
            else:
                if recompute:  # its graph rebuilt, the input it holds already counted among the kept ones
                    points.add((graphs + 1, inputs - 1))
                graphs, inputs = (graphs, inputs - 1) if recompute else (graphs - 1, inputs)
            points.add((graphs, inputs))
        # only the points no other one exceeds in both counts can be the peak (bytes are >= 0)
        out.append(tuple(point for point in points
                         if not any(other != point and other[0] >= point[0] and other[1] >= point[1]
                                    for other in points)))
    return tuple(out)


def candidate_shapes(num_gpus: int, num_layers: int, *, seq_len: int, precision: str = "bf16",
                     global_batch: int | None = None, snapshot_every: int = 1,
                     schedules: Sequence[str] = SEARCH_SCHEDULES) -> list[StepShape]:
    """Every configuration the search considers for ``num_gpus`` (see the module docstring)."""
    shapes = []
    for stages in range(1, min(num_gpus, num_layers) + 1):
        if num_gpus % stages:
            continue
        replicas = num_gpus // stages
        for size in SEARCH_MICRO_BATCH_SIZES:
            if global_batch is None:
                micro_batches = [stages * k for k in SEARCH_MICRO_BATCHES_PER_STAGE]
            elif global_batch % (replicas * size) == 0:
                micro_batches = [global_batch // (replicas * size)]
            else:
                micro_batches = []
            for m in micro_batches:
                for schedule in schedules:
                    for recompute in SEARCH_RECOMPUTE:
                        for sharded in ((False, True) if replicas > 1 else (False,)):
                            shapes.append(StepShape(replicas, stages, m, schedule, recompute, precision, sharded,
                                                    size, seq_len, None, snapshot_every))
    return shapes


def search_plans(config: LlamaConfig, cluster: Cluster, num_gpus: int, *, seq_len: int | None = None,
                 precision: str = "bf16", gpu_memory_bytes: int | None = None, global_batch: int | None = None,
                 top: int = 3, snapshot_every: int = 1, fused_attention: bool = True) -> SearchResult:
    """The ``top`` configurations of ``config`` on ``num_gpus`` GPUs of ``cluster`` with the
    highest predicted tokens/s that fit ``gpu_memory_bytes`` (default: the cluster's memory)."""
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"--gpus {num_gpus!r} must be an int >= 1")
    seq_len = seq_len or config.max_seq_len
    limit = cluster.memory_bytes if gpu_memory_bytes is None else gpu_memory_bytes
    num_layers = config.n_layers + 2
    costs = llama_layer_costs(config, seq_len, precision, fused_attention)
    shapes = candidate_shapes(num_gpus, num_layers, seq_len=seq_len, precision=precision,
                              global_batch=global_batch, snapshot_every=snapshot_every)
    if not shapes:
        return SearchResult([], 0, 0, reason=f"no (replicas, stages, micro-batches) gives a global batch of "
                                             f"{global_batch} sequences on {num_gpus} GPUs")
    time_splits: dict[tuple[int, str], list[int]] = {}
    fitting: list[tuple[float, int, StepShape, str, list[int], LlamaStageBytes]] = []
    smallest = None
    for index, shape in enumerate(shapes):
        bytes_of = LlamaStageBytes(config, shape, fused_attention)
        key = (shape.num_stages, shape.activation_checkpoint)
        if key not in time_splits:  # "never"/"always" weigh the layers alike for every m
            times = [layer_step_flops(cost, shape.activation_checkpoint) for cost in costs]
            time_splits[key] = min_max_partition(times, shape.num_stages)
        split, mode = time_splits[key], "time"
        bounds = _bounds(split)
        worst = max(bytes_of(stage, start, end) for stage, (start, end) in enumerate(bounds))
        if worst > limit:
            # a stage holds at least one layer: where even its cheapest layer does not fit, nothing does
            least = max(min(bytes_of(stage, layer, layer + 1)
                            for layer in range(stage, num_layers - (shape.num_stages - 1 - stage)))
                        for stage in range(shape.num_stages))
            smallest = least if smallest is None else min(smallest, least)
            if least > limit:
                continue
            try:
                split = balance_by_time(costs, shape.num_stages, activation_checkpoint=shape.activation_checkpoint,
                                        num_micro_batches=shape.num_micro_batches, stage_bytes=bytes_of,
                                        memory_limit_bytes=limit)
            except ValueError:
                continue
            mode = "memory"
        fitting.append((0.0, index, shape, mode, split, bytes_of))
    if not fitting:
        return SearchResult([], len(shapes), 0, smallest_stage_bytes=smallest, reason=_no_fit_reason(
            config, cluster, num_gpus, limit, smallest))
    ranked = []
    for _, index, shape, mode, split, bytes_of in fitting:
        parameters = [bytes_of.parameters(start, end) for start, end in _bounds(split)]
        bound = optimistic_step_s(costs, split, parameters, shape, cluster)
        tokens = shape.num_replicas * shape.num_micro_batches * shape.micro_batch_size * seq_len
        ranked.append((tokens / bound, index, shape, mode, split, parameters, bytes_of))
    ranked.sort(key=lambda item: (-item[0], item[1]))
    best: list[Candidate] = []
    simulated = 0
    for ceiling, _, shape, mode, split, parameters, bytes_of in ranked:
        if len(best) >= top and ceiling <= best[-1].prediction.tokens_per_s:
            break  # nothing later can enter the top
        memory = [bytes_of(stage, start, end) for stage, (start, end) in enumerate(_bounds(split))]
        prediction = _predict(costs, split, parameters, memory, limit, shape, cluster)
        simulated += 1
        best.append(Candidate(shape, mode, prediction))
        best.sort(key=lambda c: -c.prediction.tokens_per_s)
        del best[top:]
    return SearchResult(best, len(shapes), simulated)


def _no_fit_reason(config: LlamaConfig, cluster: Cluster, num_gpus: int, limit: int, smallest: int | None) -> str:
    from raypipe.units import format_bytes

    need = f" (the smallest stage found needs {format_bytes(smallest)})" if smallest is not None else ""
    return (f"no configuration fits: with pipeline and data parallelism alone, every split of the model over at "
            f"most {min(num_gpus, config.n_layers + 2)} stages of {num_gpus} GPUs leaves a stage above "
            f"{format_bytes(limit)} per device{need}. raypipe has no tensor parallelism: use devices with more "
            f"memory (--gpu-memory / a cluster file), more GPUs (more stages), or shorter sequences (--seq-len)")
