"""The timed pipeline of one configuration (:func:`simulate_pipeline`): each schedule shape
built, lowered and, for chunked ones, dry-run once for the many configurations the search times
(the caches below), each virtual stage's op times from its layers' costs, each message's from its
link, and the figures a prediction reads of the run. The step around it (the reduction, the
decision, the optimizer and the snapshot) is :mod:`raypipe.planning.predict`'s."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raypipe.core.lowering import lower
from raypipe.core.ops import B, COMPUTE, F, OPTIMIZER_STEP, RECEIVES, REDUCE_GRAD, LoweredOp, Op, boundary_of, \
    virtual_stage
from raypipe.core.schedule import (PLACEMENT, check_chunks, gpipe_schedule, interleaved_1f1b_schedule,
                                   one_f_one_b_schedule, zb_h1_schedule, zbv_schedule)
from raypipe.core.simulator import Event, simulate_events
from raypipe.core.timed_simulation import TimedRun, simulate_timed
from raypipe.models.layers import LayerCost
from raypipe.planning.cluster_spec import Cluster
from raypipe.planning.pipeline_timing import PipelineTiming, time_buffered_pipeline
from raypipe.planning.step_shape import StepShape, stage_bounds
from raypipe.planning.tensor_parallel_collectives import (ALL_GATHER, LayerCollectives, block_collectives,
                                                          collective_seconds)


def schedule_ops(name: str, num_stages: int, num_micro_batches: int, num_chunks: int = 1) -> list[list[Op]]:
    """The schedule called ``name`` with ``num_chunks`` chunks per worker, built directly:
    make_schedule's dry-run (checked for every shape in the schedule tests) costs the search more
    than everything else at 128 stages (a chunked one at 64 stages: ~3 s a shape, for each
    shape's memory walk). A chunked schedule the search simulates is still dry-run there: the
    timed simulation runs the dry-run's rule, and raises where it would."""
    check_chunks(name, num_chunks)
    if name == "interleaved_1f1b":
        return interleaved_1f1b_schedule(num_stages, num_micro_batches, num_chunks)
    if name == "zbv":
        return zbv_schedule(num_stages, num_micro_batches)
    builder = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule, "zb_h1": zb_h1_schedule}[name]
    return builder(num_stages, num_micro_batches)


@functools.lru_cache(maxsize=2)
def shared_schedule_ops(name: str, num_stages: int, num_micro_batches: int,
                        num_chunks: int = 1) -> tuple[tuple[Op, ...], ...]:
    """:func:`schedule_ops`, read-only and kept for the last two shapes asked: the search walks a
    shape's memory once per recompute mode and then lowers it, one shape after another (a large
    shape's ops are ~100 MB, so only the shapes in use are kept)."""
    return tuple(tuple(ops) for ops in schedule_ops(name, num_stages, num_micro_batches, num_chunks))


@functools.lru_cache(maxsize=64)
def lowered_schedule(schedule: str, num_stages: int, num_micro_batches: int,
             num_chunks: int = 1) -> tuple[tuple[LoweredOp, ...], ...]:
    # once per shape: the search simulates many configurations of one schedule shape
    ops = shared_schedule_ops(schedule, num_stages, num_micro_batches, num_chunks)
    return tuple(tuple(lowered) for lowered in lower([list(stage_ops) for stage_ops in ops], PLACEMENT[schedule]))


@functools.lru_cache(maxsize=4)
def dry_run_events(schedule: str, num_stages: int, num_micro_batches: int, num_chunks: int) -> tuple[Event, ...]:
    # the timed simulation's order of steps depends on the ops alone: the search times each chunked
    # shape under several configurations (micro-batch size, recompute, ZeRO-1), and the dry-run is
    # most of a timing's cost (a zbv shape of 64 stages x 256 micro-batches: ~600k events, ~100 MB, so only
    # the last four shapes are kept)
    lowered = lowered_schedule(schedule, num_stages, num_micro_batches, num_chunks)
    return tuple(simulate_events([list(ops) for ops in lowered], PLACEMENT[schedule]))


@functools.lru_cache(maxsize=256)
def split_backward_tails(schedule: str, num_stages: int, num_micro_batches: int) -> tuple[tuple[bool, int], ...]:
    """Per stage of the schedule: whether it splits the backward into I and W, and how many W
    ops come after its last I (once per shape: :func:`optimistic_step_s` bounds every candidate)."""
    out = []
    for ops in shared_schedule_ops(schedule, num_stages, num_micro_batches):
        kinds = [op.kind for op in ops]
        split = "I" in kinds
        out.append((split, kinds[len(kinds) - kinds[::-1].index("I"):].count("W") if split else 0))
    return tuple(out)


@dataclass(frozen=True)
class StageTimes:
    """Per stage: one micro-batch's F, its B, the forward a recompute adds, and the
    message to the next stage (bytes)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    recompute: tuple[float, ...]
    message_bytes: tuple[float, ...]
    backward_input: tuple[float, ...]  # the part of backward a split schedule runs as I (the rest as W)


def stage_times(costs: Sequence[LayerCost], split: Sequence[int], shape: StepShape, cluster: Cluster,
                collectives: Sequence[LayerCollectives] | None = None) -> StageTimes:
    """Each (virtual) stage's op times and message bytes under ``split`` (layers per virtual stage).

    At ``shape.tensor_parallel`` t > 1 each op is one rank's: its layers' flops / t, plus their
    tensor-parallel ``collectives`` (default: :func:`block_collectives` of each layer) over the
    node's link, not overlapped (forward's in F and in a recompute, backward's in B and a split
    backward's I); a message is what rank i sends rank i of the next stage: 1/t of the activation
    along the sequence, its shard with sequence parallelism; without it, its slice of the whole
    activation, which the next stage's first layer all-gathers over its ranks in forward (and the
    sending stage's last layer gathers the gradient's slices in backward), added to those ops."""
    t, rate = shape.tensor_parallel, cluster.flops_per_s(shape.precision)
    b = shape.micro_batch_size
    if t > 1 and collectives is None:
        collectives = [block_collectives(cost) for cost in costs]
    forward, backward, message, backward_input = [], [], [], []
    for start, end in stage_bounds(split):
        part = costs[start:end]
        sent = 0.0 if t == 1 else collective_seconds([c for layer in collectives[start:end] for c in layer.forward],
                                                     t, cluster.intra_node, b)
        received = 0.0 if t == 1 else collective_seconds([c for layer in collectives[start:end]
                                                          for c in layer.backward], t, cluster.intra_node, b)
        backward_input.append(b * sum(cost.bwd_input_flops for cost in part) / (rate * t) + received)
        forward.append(b * sum(cost.fwd_flops for cost in part) / (rate * t) + sent)
        backward.append(b * sum(cost.bwd_input_flops + cost.bwd_weight_flops for cost in part) / (rate * t)
                        + received)
        boundary = b * costs[end - 1].output_bytes
        message.append(boundary / t)
        if t > 1 and not shape.sequence_sharded:  # Megatron's scatter-gather across the boundaries
            if start > 0:
                forward[-1] += collective_seconds([(ALL_GATHER, costs[start - 1].output_bytes)], t,
                                                  cluster.intra_node, b)
            if end < len(costs):
                gathered = collective_seconds([(ALL_GATHER, costs[end - 1].output_bytes)], t, cluster.intra_node, b)
                backward[-1] += gathered
                backward_input[-1] += gathered
    recompute = forward if shape.activation_checkpoint != "never" else [0.0] * len(forward)
    return StageTimes(tuple(forward), tuple(backward), tuple(recompute), tuple(message), tuple(backward_input))


def recomputed(shape: StepShape, micro_batch: int | None) -> bool:
    if shape.activation_checkpoint == "always":
        return True
    return shape.activation_checkpoint == "except_last" and micro_batch != shape.num_micro_batches - 1


def pipeline_timers(times: StageTimes, shape: StepShape, cluster: Cluster, first_slot: int
                     ) -> tuple[Callable[[int, LoweredOp], float], Callable[[int, int, LoweredOp], float]]:
    """The op and message times of the replica whose worker 0 is in stage slot ``first_slot`` (its
    GPU at t = 1; a slot is a stage's t GPUs on one node, :meth:`Cluster.slots_per_node`), as the
    timed simulation takes them (``op_seconds``, ``message_seconds``). ``times`` is per virtual
    stage: an op of chunk c on worker w takes the times of the virtual stage that chunk holds."""

    overhead = cluster.op_overhead_s  # around every compute op (see the module's 5.)
    p, placement = shape.num_stages, PLACEMENT[shape.schedule]
    chunked = shape.virtual_stages > 1

    def op_seconds(stage: int, op: LoweredOp) -> float:
        if chunked:
            stage = virtual_stage(stage, op.chunk, p, placement)
        if op.kind == F:
            return times.forward[stage] + overhead
        recompute = times.recompute[stage] if recomputed(shape, op.micro_batch) else 0.0
        if op.kind == B:
            return times.backward[stage] + recompute + overhead
        if op.kind == "I":  # a split backward's input gradient (zero-bubble schedules), with any recompute
            return times.backward_input[stage] + recompute + overhead
        if op.kind == "W":
            return times.backward[stage] - times.backward_input[stage] + overhead
        if op.kind in (REDUCE_GRAD, OPTIMIZER_STEP):
            return 0.0  # the reduction, decision and optimizer are added after the pipeline (see the module)
        raise ValueError(f"the predictor has no time for {op!r} (stage {stage}) of schedule {shape.schedule!r}")

    def message_seconds(sender: int, receiver: int, op: LoweredOp) -> float:
        # the output of the virtual stage before the boundary the message crosses: an activation of
        # virtual stage s -> s+1, or its gradient back (one chunk: the boundary of stages s and s+1)
        if chunked:
            before = boundary_of(sender, op.chunk, op.kind, p, placement) - 1
        else:
            before = min(sender, receiver)
        return cluster.slot_link(first_slot + sender, first_slot + receiver,
                                 shape.tensor_parallel).seconds(times.message_bytes[before])

    return op_seconds, message_seconds


def simulate_pipeline(times: StageTimes, shape: StepShape, cluster: Cluster, first_slot: int) -> PipelineTiming:
    """The timed pipeline of the replica whose stage 0 is in stage slot ``first_slot``: the timed
    simulation's figures (``simulate_timed(..., buffered_sends=True)``). One chunk per worker:
    evaluated without its dry-run (:mod:`raypipe.planning.pipeline_timing` says why, and why the
    figures are the same). Several chunks: ``simulate_timed`` itself, whose rule also holds an
    EXCHANGE's batch until the activation headers it awaits are in (``LoweredOp.header_first``,
    which chunked lowerings use and ``pipeline_timing`` does not model)."""
    op_seconds, message_seconds = pipeline_timers(times, shape, cluster, first_slot)
    lowered = lowered_schedule(shape.schedule, shape.num_stages, shape.num_micro_batches, shape.virtual_stages)
    if shape.virtual_stages == 1:
        return time_buffered_pipeline(lowered, op_seconds, message_seconds)
    run = simulate_timed([list(ops) for ops in lowered], op_seconds, message_seconds, buffered_sends=True,
                         placement=PLACEMENT[shape.schedule],
                         events=dry_run_events(shape.schedule, shape.num_stages, shape.num_micro_batches,
                                                shape.virtual_stages))
    return timing_of(run, shape.num_stages)


def timing_of(run: TimedRun, num_workers: int) -> PipelineTiming:
    """What a prediction reads of a :func:`simulate_timed` run, as :class:`PipelineTiming` holds it: per
    worker its last compute op's end and when it first posted a receive, and the compute ops counted."""
    last_compute, first_wait = [0.0] * num_workers, [math.inf] * num_workers
    compute_ops = 0
    for timed in run.timeline:
        if timed.op.kind in COMPUTE:
            last_compute[timed.stage] = max(last_compute[timed.stage], timed.end)
            compute_ops += 1
        elif any(part.kind in RECEIVES for part in timed.op.unbatched()):
            first_wait[timed.stage] = min(first_wait[timed.stage], timed.start)
    return PipelineTiming(step_s=run.step_s, busy_s=run.busy_s, last_compute=tuple(last_compute),
                          first_wait=tuple(first_wait), compute_ops=compute_ops)


def replica_starts(shape: StepShape, cluster: Cluster) -> list[int]:
    """One first stage slot per distinct placement of a replica's stages on nodes (it depends only
    on the replica's first slot modulo the slots of a node, so the first ``slots_per_node`` replicas
    have them all; a slot is a GPU at t = 1)."""
    per_node = cluster.slots_per_node(shape.tensor_parallel)
    seen, starts = set(), []
    for replica in range(min(shape.num_replicas, per_node)):
        first = replica * shape.num_stages
        pattern = tuple((first + s) // per_node - first // per_node for s in range(shape.num_stages))
        if pattern not in seen:
            seen.add(pattern)
            starts.append(first)
    return starts
