"""Predicted step time, tokens/s and MFU of one configuration of a pipeline on a described
cluster (:class:`~raypipe.planning.cluster_spec.Cluster`). The search ``raypipe plan --cluster``
runs over configurations is in :mod:`raypipe.planning.configuration_search`. No Ray, no torch.

**Placement**: stage ``s`` of replica ``r`` on GPU ``r * p + s``, GPUs ``8k .. 8k+7`` on node
``k``: a replica's stages on consecutive GPUs, as raypipe places each replica in its own PACK
placement group (as few nodes as hold it), its bundles in stage order. With tensor parallelism
(t > 1) the same over stage *slots* of t GPUs on one node (slot ``r * p + s``, ``8 // t`` slots a
node: :meth:`~raypipe.planning.cluster_spec.Cluster.slots_per_node`).

**Tensor parallelism** (``tensor_parallel`` t > 1, each stage split over t GPUs of a node): a
rank's op takes its layers' flops / t, plus the layers' tensor-parallel collectives on the node's
link (:mod:`raypipe.planning.tensor_parallel_collectives`: a block's two all-reduces of its
activation in forward and two in backward, or with sequence parallelism an all-gather and a
reduce-scatter for each; the embedding's and the head's vocabulary-parallel ones), not overlapped
with compute (conservative: they count as the op's busy time); rank i of a stage sends rank i of
the next 1/t of the activation along the sequence either way (without sequence parallelism the
receiving stage all-gathers the slices, and the sending stage the gradient's, over the node). The
reduction, the optimizer step, the snapshot and the memory are one rank's (its share of the
parameters), each rank's ring over the replicas on its own GPU's link; MFU divides by d x p x t GPUs.

**Model chunks** (``virtual_stages`` v > 1: ``interleaved_1f1b``, ``zbv``): the layers are split
into ``p * v`` virtual stages in model order (``balance`` has ``p * v`` entries), and worker ``w``'s
chunk ``c`` holds virtual stage ``virtual_stage(w, c, p, PLACEMENT[schedule])`` (looped, or the V).
An op of chunk c on worker w takes that virtual stage's F/B/I/W time; a message (an activation or
its gradient) carries the output of the virtual stage before the boundary it crosses
(:func:`~raypipe.core.ops.boundary_of`) over the link between the two *workers'* GPUs, so
interleaving's wrap from worker p - 1 to worker 0 crosses the replica's span, and zbv's turn on
worker p - 1 sends nothing. A worker's memory is the memory model's for its chunks together
(``chunk_sizes``), its parameters (the reduction, optimizer and snapshot below) its chunks' sum.
The pipeline is timed by ``simulate_timed`` itself: a chunked lowering awaits some activations'
headers before posting a batch (``LoweredOp.header_first``), which delays that batch's sends, and
:mod:`raypipe.planning.pipeline_timing` does not model it.

**One step** (:func:`predict_step`):

1. *The pipeline*: :func:`~raypipe.core.timed_simulation.simulate_timed` runs the lowered schedule
   with per-op times from the layers' costs: F = the stage's ``fwd_flops`` x b / (peak x
   achievable_fraction), B = (``bwd_input_flops`` + ``bwd_weight_flops``) x b / the same, plus a
   recomputed micro-batch's forward; a message takes its link's latency plus the stage
   output's bytes (``output_bytes`` x b) over its bandwidth. Sends are buffered, as the
   executors post them (``buffered_sends=True``). Each distinct placement pattern of the
   replicas is simulated; the slowest sets the pace. (The figures are ``simulate_timed``'s,
   evaluated by :mod:`raypipe.planning.pipeline_timing` without the dry-run's checks and order.)
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
   host memory at the host-copy bandwidth (a side stream on a GPU) and then stores it into Ray's
   object store at ``object_store_bytes_per_s`` (the task result the keeper and a heal read), as
   the per-step executor takes it (``PerStepWorker.snapshot_at_first_wait``): the copy starts when
   the stage first waits for a neighbour in the next step, while its compute goes on, and holds
   only that step's commit, which may not change the state before the copy is in host memory
   (``stage/step_gate.py``); the store follows, beside the steps after, and the worker's next
   snapshot starts only once it is done (one task after another). So a snapshot costs a step
   what its copy takes beyond the time from the stage's first wait to the step's decision, and,
   where the copy and the store together take longer than the ``snapshot_every`` steps between
   two snapshots, the steps stretch until they do not (the snapshots then run back to back); the
   slowest stage's, amortized over ``snapshot_every`` steps (:attr:`Prediction.snapshot_exposed_s`;
   :func:`snapshot_exposed_at` at another cadence).

5. *Fixed overheads* a calibration measured (the cluster's ``op_overhead_s`` and
   ``step_overhead_s``, 0 in the presets): each compute op (F, B, I, W) takes ``op_overhead_s``
   more, counted as the worker's idle time, not its compute (it is dispatch, launches, Python),
   and each step ``step_overhead_s`` more (the driver's dispatch and commit).

Not modelled: link contention (messages in flight never slow each other), kernel-launch
and Python overheads unless the cluster gives them (5.), NCCL's protocol switch for small
messages, stragglers; the ``achievable_fraction`` stands for everything that makes compute
slower than peak.

**MFU** = the model's flops of one step (forward and both backward halves of every layer,
no recompute: the 6 N tokens of the matmuls plus attention and the cross entropy) / (step
time x GPUs x the precision's peak).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raypipe.core.ops import B, virtual_stage
from raypipe.core.partition import partition_by_cost
from raypipe.core.schedule import PLACEMENT
from raypipe.models.layers import LayerCost, LayerSpec
from raypipe.models.llama_memory import static_bytes_per_parameter
from raypipe.planning.balance import balance_by_time, cost_stage_bytes, cost_worker_bytes
from raypipe.planning.cluster_spec import Cluster, Link
from raypipe.planning.pipeline_prediction import (StageTimes, recomputed, replica_starts, shared_schedule_ops,
                                                  simulate_pipeline, split_backward_tails, stage_times)
from raypipe.planning.pipeline_timing import PipelineTiming
from raypipe.planning.step_shape import StepShape, check_shape, stage_bounds, worker_sums
from raypipe.planning.tensor_parallel_collectives import LayerCollectives

__all__ = ["Prediction", "StepShape", "PipelineRun", "predict_step", "predict_split", "pipeline_runs",
           "optimistic_step_s", "stage_bounds", "worker_sums", "snapshot_exposed_at"]


# -- one step -----------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    """The predicted step of one configuration (times in seconds, memory in bytes).

    ``bubble_fraction`` is the share of the GPUs' step time not spent computing (the
    pipeline's bubble, the exposed reduction, optimizer and snapshot); ``pipeline_bubble``
    that of the simulated pipeline alone. ``stage_compute_s`` is each stage's F and B
    time in one step; ``stage_bytes`` each stage's memory (the memory model's total); with
    several chunks per worker both are per worker (its chunks together) and ``balance`` is
    layers per virtual stage, in model order. With tensor parallelism (t > 1) both are one of a
    stage's t ranks', and ``mfu`` divides by all d x p x t GPUs.
    """

    step_s: float
    bubble_fraction: float
    pipeline_bubble: float
    tokens_per_s: float
    mfu: float
    pipeline_s: float  # the simulated pipeline, until every stage's last op
    reduction_exposed_s: float  # what the data-parallel reduction adds after the pipeline
    optimizer_s: float  # the optimizer step (and ZeRO-1's all-gather) of the slowest stage
    snapshot_exposed_s: float  # per step: what the snapshot adds (amortized over snapshot_every)
    stage_compute_s: tuple[float, ...]
    stage_bytes: tuple[int, ...]
    fits: bool | None  # None: no memory limit given
    balance: tuple[int, ...]
    tokens_per_step: int
    model_flops_per_step: float
    # per snapshot, the slowest stage's: what its copy to host memory holds the commit past the decision,
    # and its copy and store together (from its start to the end of the store)
    snapshot_commit_wait_s: float = 0.0
    snapshot_busy_s: float = 0.0

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_s, "tokens_per_second": self.tokens_per_s, "mfu": self.mfu,
                "bubble_fraction": self.bubble_fraction, "pipeline_bubble": self.pipeline_bubble,
                "pipeline_s": self.pipeline_s, "reduction_exposed_s": self.reduction_exposed_s,
                "optimizer_s": self.optimizer_s, "snapshot_exposed_s": self.snapshot_exposed_s,
                "stage_compute_s": list(self.stage_compute_s), "stage_bytes": list(self.stage_bytes),
                "fits": self.fits, "balance": list(self.balance), "tokens_per_step": self.tokens_per_step,
                "model_flops_per_step": self.model_flops_per_step,
                "snapshot_commit_wait_s": self.snapshot_commit_wait_s, "snapshot_busy_s": self.snapshot_busy_s}

    def snapshot_exposed_at(self, snapshot_every: int) -> float:
        """What :attr:`snapshot_exposed_s` would be with a snapshot every ``snapshot_every`` steps
        (0: none) instead of this prediction's cadence, the rest of the step as it is (see the
        module docstring, 4). A prediction without snapshots knows no snapshot's cost: 0."""
        return snapshot_exposed_at(self.step_s - self.snapshot_exposed_s, self.snapshot_commit_wait_s,
                                   self.snapshot_busy_s, snapshot_every)


def snapshot_exposed_at(step_s: float, commit_wait_s: float, busy_s: float, snapshot_every: int) -> float:
    """What a snapshot every ``snapshot_every`` steps adds to a step of ``step_s`` without it
    (0: none): per snapshot, its commit's wait for the copy (``commit_wait_s``), or, where
    the copy and the store (``busy_s``) outlast the ``snapshot_every`` steps until the next
    snapshot, what they outlast them by (the steps stretch until one snapshot's store ends as
    the next one's copy starts), the larger; amortized over the steps."""
    if not snapshot_every:
        return 0.0
    return max(0.0, commit_wait_s, busy_s - snapshot_every * step_s) / snapshot_every



def predict_step(layers: Sequence[LayerCost | LayerSpec], cluster: Cluster, *, num_replicas: int = 1,
                 num_stages: int = 1, num_micro_batches: int = 1, schedule: str = "1f1b",
                 activation_checkpoint: str = "never", precision: str = "bf16", shard_optimizer: bool = False,
                 micro_batch_size: int = 1, seq_len: int = 1, balance: str | Sequence[int] = "time",
                 amp: str | None = None, snapshot_every: int = 1,
                 stage_bytes: Callable[..., int] | None = None,
                 gpu_memory_bytes: int | None = None, virtual_stages: int = 1, tensor_parallel: int = 1,
                 sequence_parallel: bool | None = None,
                 collectives: Sequence[LayerCollectives] | None = None) -> Prediction:
    """The predicted step of ``layers`` (their :class:`LayerCost`, per sequence of ``seq_len``
    tokens) on ``cluster`` (see the module docstring for the model).

    ``virtual_stages`` (v): model chunks per worker, >= 2 for interleaved_1f1b, 2 for zbv; the
    model is then cut into ``num_stages * v`` virtual stages, placed as the schedule places them.
    ``balance``: "time" (:func:`~raypipe.planning.balance.balance_by_time`, as
    ``PipelineConfig(balance="time")``), "parameters" or layers per (virtual) stage.
    ``stage_bytes(stage, first, end)`` gives a stage's memory (default: from the costs,
    :func:`~raypipe.planning.balance.cost_stage_bytes`); with v > 1 it is
    ``stage_bytes(worker, chunk_bounds)``, the (first, end) layers of each of the worker's chunks
    in chunk order (default :func:`~raypipe.planning.balance.cost_worker_bytes`). ``fits``
    compares it with ``gpu_memory_bytes`` (default: the cluster's memory).

    ``tensor_parallel`` (t) > 1: every layer split over a stage's t GPUs (the module's
    *Tensor parallelism*), with ``collectives`` per layer (default: each a transformer block's,
    :func:`~raypipe.planning.tensor_parallel_collectives.block_collectives`); ``stage_bytes`` is
    then required (one rank's memory: the layers' costs do not say what a rank holds).
    """
    costs = [layer.cost if isinstance(layer, LayerSpec) else layer for layer in layers]
    if any(not isinstance(cost, LayerCost) for cost in costs):
        raise ValueError("predict_step needs every layer's LayerCost (LayerSpec(..., cost=...) or LayerCost)")
    shape = StepShape(num_replicas, num_stages, num_micro_batches, schedule, activation_checkpoint, precision,
                      shard_optimizer, micro_batch_size, seq_len, amp, snapshot_every, virtual_stages,
                      tensor_parallel, sequence_parallel)
    check_shape(shape, len(costs))
    if tensor_parallel > 1 and stage_bytes is None:
        raise ValueError(f"tensor_parallel={tensor_parallel} needs stage_bytes (one rank's memory: the layers' "
                         "LayerCost does not say how a rank splits them)")
    pieces = shape.num_virtual_stages
    if balance == "time":
        split = balance_by_time(costs, pieces, activation_checkpoint=activation_checkpoint,
                                num_micro_batches=num_micro_batches)
    elif balance == "parameters":
        split = partition_by_cost([cost.param_bytes for cost in costs], pieces)
    else:
        split = list(balance)
        if len(split) != pieces or any(size < 1 for size in split) or sum(split) != len(costs):
            raise ValueError(f"balance {split} needs {pieces} positive entries summing to {len(costs)} layers"
                             + (f" ({num_stages} stages x {virtual_stages} chunks)" if virtual_stages > 1 else ""))
    bounds = stage_bounds(split)
    optimizer_shards = num_replicas if shard_optimizer else 1
    if virtual_stages == 1:
        if stage_bytes is None:
            stage_bytes = cost_stage_bytes(costs, num_stages, num_micro_batches=num_micro_batches,
                                           micro_batch_size=micro_batch_size, schedule=schedule,
                                           activation_checkpoint=activation_checkpoint, precision=precision,
                                           amp=amp, optimizer_shards=optimizer_shards)
        memory = tuple(stage_bytes(stage, start, end) for stage, (start, end) in enumerate(bounds))
    else:
        if stage_bytes is None:
            stage_bytes = cost_worker_bytes(costs, num_stages, virtual_stages, num_micro_batches=num_micro_batches,
                                            micro_batch_size=micro_batch_size, schedule=schedule,
                                            activation_checkpoint=activation_checkpoint, precision=precision,
                                            amp=amp, optimizer_shards=optimizer_shards)
        memory = tuple(stage_bytes(worker, [bounds[piece] for piece in pieces_of])
                       for worker, pieces_of in enumerate(shape.worker_virtual_stages()))
    limit = cluster.memory_bytes if gpu_memory_bytes is None else gpu_memory_bytes
    per_param = static_bytes_per_parameter(precision, amp)
    # one rank's: every layer split t ways
    piece_parameters = [round(sum(cost.param_bytes for cost in costs[start:end]) / per_param.weights
                              / tensor_parallel) for start, end in bounds]
    parameters = worker_sums(piece_parameters, shape)
    return predict_split(costs, split, parameters, memory, limit, shape, cluster, collectives=collectives)


def _collective_link(shape: StepShape, cluster: Cluster, stage: int) -> Link:
    """The link a ring over the replicas of ``stage`` (of each of its tensor-parallel ranks) is limited by."""
    first, last = stage, (shape.num_replicas - 1) * shape.num_stages + stage
    return cluster.slot_link(first, last, shape.tensor_parallel)


def _tail_seconds(parameters: Sequence[int], shape: StepShape, cluster: Cluster
                  ) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """Per stage: the gradient reduction, the optimizer step (with ZeRO-1's all-gather), and the
    snapshot's copy to host memory and store into Ray's object store (0 for none)."""
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
            reduction = link.ring_seconds(1, gradients, d)
            gather = link.ring_seconds(1, count * per_param.weights, d)
        else:  # ring all-reduce
            reduction, gather = link.ring_seconds(2, gradients, d), 0.0
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
        copied = owned + others
        snapshot.append((copied / cluster.host_copy_bytes_per_s, copied / cluster.object_store_bytes_per_s)
                        if shape.snapshot_every else (0.0, 0.0))
    return reduce, optimizer, snapshot


@dataclass(frozen=True)
class PipelineRun:
    """One replica placement's timed pipeline, as a prediction reads it."""

    first_slot: int  # the replica's stage 0's slot (its GPU at t = 1)
    timing: PipelineTiming


def pipeline_runs(costs: Sequence[LayerCost], split: Sequence[int], shape: StepShape, cluster: Cluster,
                  collectives: Sequence[LayerCollectives] | None = None) -> tuple[PipelineRun, ...]:
    """The timed pipeline of each distinct placement of a replica (see the module's 1.), as
    :func:`predict_split` reads it. It does not depend on ``shape.snapshot_every``: a prediction
    of the same split at another snapshot cadence can reuse it."""
    times = stage_times(costs, split, shape, cluster, collectives)
    return tuple(PipelineRun(first_slot, simulate_pipeline(times, shape, cluster, first_slot))
                 for first_slot in replica_starts(shape, cluster))


def predict_split(costs: Sequence[LayerCost], split: Sequence[int], parameters: Sequence[int],
                  memory: Sequence[int], limit: int | None, shape: StepShape, cluster: Cluster,
                  runs: Sequence[PipelineRun] | None = None,
                  collectives: Sequence[LayerCollectives] | None = None) -> Prediction:
    """The predicted step of ``costs`` split into stages of ``split`` layers (per virtual stage:
    ``shape.num_virtual_stages`` entries; ``parameters`` and ``memory`` per worker, its chunks
    together; ``limit`` the memory per device, None for none). ``runs``: this split's
    :func:`pipeline_runs` where already simulated (at any snapshot cadence), else they are.
    ``stage_compute_s`` is per worker, its chunks' compute together (with its tensor-parallel
    collectives at t > 1); ``parameters`` and ``memory`` are one tensor-parallel rank's, and
    ``collectives`` each layer's (:func:`~raypipe.planning.pipeline_prediction.stage_times`)."""
    cluster.slots_per_node(shape.tensor_parallel)  # a stage's t GPUs on one node
    times = stage_times(costs, split, shape, cluster, collectives)
    reduce, optimizer, snapshot = _tail_seconds(parameters, shape, cluster)
    step = pipeline = reduction_exposed = snapshot_exposed = commit_wait = busy = 0.0
    pipeline_bubble = 0.0
    for placement in pipeline_runs(costs, split, shape, cluster, collectives) if runs is None else runs:
        run = placement.timing
        decided = max([run.step_s] + [end + seconds for end, seconds in zip(run.last_compute, reduce)])
        tail = max(optimizer)
        without = decided + tail + cluster.step_overhead_s
        # each stage's copy runs from its first wait; the commit after the decision waits for it
        waits = max(max(0.0, (0.0 if start == math.inf else start) + to_host - decided)
                    for (to_host, _), start in zip(snapshot, run.first_wait))
        busiest = max(to_host + to_store for to_host, to_store in snapshot)
        exposed = snapshot_exposed_at(without, waits, busiest, shape.snapshot_every)
        total = without + exposed
        if total >= step:
            step, pipeline, reduction_exposed, snapshot_exposed = total, run.step_s, decided - run.step_s, exposed
            commit_wait, busy = waits, busiest  # both 0 without snapshots (_tail_seconds)
            # busy: the ops' compute, not the per-op overhead the simulation put in their times
            overheads = cluster.op_overhead_s * run.compute_ops
            pipeline_bubble = (1 - (sum(run.busy_s) - overheads) / (shape.num_stages * run.step_s)
                               if run.step_s else 0.0)
    compute = worker_sums([shape.num_micro_batches * (f + b) + sum(times.recompute[s]
                                                                   for mb in range(shape.num_micro_batches)
                                                                   if recomputed(shape, mb))
                           for s, (f, b) in enumerate(zip(times.forward, times.backward))], shape)
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
        model_flops_per_step=model_flops, snapshot_commit_wait_s=commit_wait, snapshot_busy_s=busy)


def optimistic_step_s(costs: Sequence[LayerCost], split: Sequence[int], parameters: Sequence[int],
                      shape: StepShape, cluster: Cluster,
                      collectives: Sequence[LayerCollectives] | None = None) -> float:
    """A step time no simulated step of this configuration undercuts: for each stage, the
    first micro-batch's forwards and messages through the stages before it, the stage's
    whole compute, and the last gradient's way back; plus the slowest optimizer tail.
    ``split`` and ``parameters`` as :func:`predict_split` takes them; several chunks per worker
    are bounded as :func:`_chunked_pipeline_bound` says."""
    times = stage_times(costs, split, shape, cluster, collectives)
    _, optimizer, _ = _tail_seconds(parameters, shape, cluster)
    if shape.virtual_stages > 1:
        return _chunked_pipeline_bound(times, shape, cluster) + max(optimizer) + cluster.step_overhead_s
    fastest = min(cluster.intra_node, cluster.inter_node, key=lambda link: link.latency_s)
    tails = split_backward_tails(shape.schedule, shape.num_stages, shape.num_micro_batches)
    best = 0.0
    lead = 0.0  # F and B (a split backward: I) of the stages before, and the messages between them
    for stage in range(shape.num_stages):
        compute = shape.num_micro_batches * (times.forward[stage] + times.backward[stage]) + sum(
            times.recompute[stage] for mb in range(shape.num_micro_batches) if recomputed(shape, mb))
        # a split backward's W ops after the stage's last I may run while the last gradient goes back
        split, trailing = tails[stage]
        weight = times.backward[stage] - times.backward_input[stage]
        best = max(best, lead + compute - trailing * weight)
        message = fastest.latency_s + times.message_bytes[stage] / max(
            cluster.intra_node.bandwidth_bytes_per_s, cluster.inter_node.bandwidth_bytes_per_s)
        back = times.backward_input[stage] if split else times.backward[stage]
        lead += times.forward[stage] + back + 2 * message
    return best + max(optimizer) + cluster.step_overhead_s


def _chunked_pipeline_bound(times: StageTimes, shape: StepShape, cluster: Cluster) -> float:
    """A pipeline time no simulated run of a chunked schedule undercuts: per worker, its whole
    compute (a worker runs one op at a time), after the chain its first op waits for (the forwards
    of that micro-batch through the virtual stages before its chunk, and the messages between
    them) and before the chain its last op starts, where that is a whole backward (B): the
    gradient's way back through the virtual stages before it. A chain that passes through the
    worker itself is left out (its ops are already in the worker's compute); a split backward's
    last op (a W) starts no chain. Messages at the fastest latency and bandwidth of the cluster.
    Looser than the one-chunk bound (nothing of the fill beyond the first op's wait): the search
    simulates more chunked candidates for it, never drops one that could enter its top."""
    p, placement = shape.num_stages, PLACEMENT[shape.schedule]
    bandwidth = max(cluster.intra_node.bandwidth_bytes_per_s, cluster.inter_node.bandwidth_bytes_per_s)
    latency = min(cluster.intra_node.latency_s, cluster.inter_node.latency_s)
    owner = {piece: worker for worker, pieces in enumerate(shape.worker_virtual_stages()) for piece in pieces}

    def chain(worker: int, before: int, seconds: Sequence[float]) -> float:
        # the ops of virtual stages 0 .. before - 1 of one micro-batch and the messages between them
        if any(owner[piece] == worker for piece in range(before)):
            return 0.0
        return sum(seconds[piece] + (latency + times.message_bytes[piece] / bandwidth
                                     if owner[piece] != owner[piece + 1] else 0.0) for piece in range(before))

    ops = shared_schedule_ops(shape.schedule, p, shape.num_micro_batches, shape.virtual_stages)
    compute = worker_sums([shape.num_micro_batches * (f + b) for f, b in zip(times.forward, times.backward)], shape)
    best = 0.0
    for worker, worker_ops in enumerate(ops):
        first, last = worker_ops[0], worker_ops[-1]
        lead = chain(worker, virtual_stage(worker, first.chunk, p, placement), times.forward)
        trail = chain(worker, virtual_stage(worker, last.chunk, p, placement), times.backward) \
            if last.kind == B else 0.0
        best = max(best, lead + compute[worker] + trail)
    return best
