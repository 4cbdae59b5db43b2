"""Stages balanced by time: the contiguous split of the layers whose slowest stage is
fastest, every stage within a memory limit.

A stage's time is the sum of its layers' training flops for one step (forward, the
input's and the weights' gradients, and the forward again for each micro-batch whose
activations are recomputed); one device's flop rate divides every stage alike, so
flops rank partitions as seconds do. What a stage holds comes from the memory model:
:func:`llama_stage_bytes` asks :func:`raypipe.planning.memory.estimate_stage` (the
LLaMA's exact figures), :func:`cost_stage_bytes` walks the same schedule with the
layers' :class:`~raypipe.models.layers.LayerCost` bytes (any model).

The search is an exact dynamic programme over contiguous partitions, O(stages x
layers^2 log layers) (a stage's memory is asked only until the best split of the layers
so far fits). Integer costs give exact sums, so its bottleneck is the optimum's exactly.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from raypipe.config import CHECKPOINT_MODES, PipelineConfig
from raypipe.core.partition import min_max_partition, partition_by_cost
from raypipe.core.schedule import make_schedule
from raypipe.core.validation import check_choice, check_positive_int
from raypipe.errors import ConfigError
from raypipe.models.layers import LayerCost, LayerSpec, layer_parameter_count
from raypipe.models.llama import LlamaConfig
from raypipe.models.llama_memory import static_bytes_per_parameter
from raypipe.units import format_bytes

# stage_bytes(stage_index, first_layer, end_layer): bytes the stage holding layers first..end-1 needs
StageBytes = Callable[[int, int, int], int]


def layer_step_flops(cost: LayerCost, activation_checkpoint: str = "never", num_micro_batches: int = 1) -> float:
    """One layer's flops in one step of ``num_micro_batches`` sequences: every micro-batch's
    forward and backward, and a second forward for each one recomputed ("always": all,
    "except_last": all but the last, as the stage runs them)."""
    check_choice("activation_checkpoint", activation_checkpoint, CHECKPOINT_MODES)
    check_positive_int("num_micro_batches", num_micro_batches)
    recomputed = {"never": 0, "always": num_micro_batches, "except_last": num_micro_batches - 1}[activation_checkpoint]
    return num_micro_batches * cost.train_flops + recomputed * cost.fwd_flops


def stage_times(times: Sequence[float], balance: Sequence[int]) -> list[float]:
    """Each stage's summed time under ``balance`` (layers per stage)."""
    out, start = [], 0
    for size in balance:
        out.append(sum(times[start:start + size]))
        start += size
    return out


def balance_by_time(costs: Sequence[LayerCost], num_stages: int, *, activation_checkpoint: str = "never",
                    num_micro_batches: int = 1, stage_bytes: StageBytes | None = None,
                    memory_limit_bytes: int | None = None) -> list[int]:
    """Layers per stage minimising the slowest stage's time, each stage's ``stage_bytes`` at most
    ``memory_limit_bytes`` (None: unlimited; then ``stage_bytes`` is not asked).

    Raises :class:`ConfigError` naming the limit when no split fits it.
    """
    if memory_limit_bytes is None:
        times = [layer_step_flops(cost, activation_checkpoint, num_micro_batches) for cost in costs]
        return min_max_partition(times, num_stages)
    split = fastest_split_within(costs, num_stages, stage_bytes, memory_limit_bytes,
                                 activation_checkpoint=activation_checkpoint, num_micro_batches=num_micro_batches)
    if split is None:
        smallest = min(stage_bytes(stage, layer, layer + 1) for stage in range(num_stages)
                       for layer in range(stage, len(costs) - (num_stages - 1 - stage)))
        raise ConfigError("memory_limit_bytes", memory_limit_bytes,
                          f"no split of {len(costs)} layers into {num_stages} stages keeps every stage within "
                          f"{format_bytes(memory_limit_bytes)} (a single layer's stage needs at least "
                          f"{format_bytes(smallest)}): raise the limit, add stages, or recompute activations")
    return split


def fastest_split_within(costs: Sequence[LayerCost], num_stages: int, stage_bytes: StageBytes | None,
                         memory_limit_bytes: int, *, activation_checkpoint: str = "never",
                         num_micro_batches: int = 1) -> list[int] | None:
    """:func:`balance_by_time`'s split within ``memory_limit_bytes``, or None where no split fits
    (where :func:`balance_by_time` raises, after a scan of every stage's smallest layer for its
    message, which a caller that only drops such a configuration, as the search does, need not pay)."""
    times = [layer_step_flops(cost, activation_checkpoint, num_micro_batches) for cost in costs]
    if stage_bytes is None:
        raise ValueError("a memory limit needs stage_bytes (e.g. cost_stage_bytes or llama_stage_bytes)")
    check_positive_int("memory_limit_bytes", memory_limit_bytes)
    try:
        return min_max_partition(times, num_stages,
                                 lambda stage, start, end: stage_bytes(stage, start, end) <= memory_limit_bytes)
    except ValueError:
        return None


def cost_stage_bytes(costs: Sequence[LayerCost], num_stages: int, *, num_micro_batches: int = 1,
                     micro_batch_size: int = 1, schedule: str = "gpipe", activation_checkpoint: str = "never",
                     offload_activations: bool = False, precision: str = "fp32", amp: str | None = None,
                     optimizer: str = "adam", optimizer_shards: int = 1, model_input_bytes: int = 0) -> StageBytes:
    """A stage's bytes from its layers' costs, as :mod:`raypipe.planning.memory` counts them:
    static (``param_bytes`` scaled to weights, gradients, main weights and optimizer state of
    ``precision``) plus the schedule's peak of kept graphs (``saved_bytes``, and the stage's
    output) or kept inputs (the previous layer's ``output_bytes``; ``model_input_bytes`` on
    the first stage) with a recompute in progress."""
    worker_bytes = cost_worker_bytes(costs, num_stages, 1, num_micro_batches=num_micro_batches,
                                     micro_batch_size=micro_batch_size, schedule=schedule,
                                     activation_checkpoint=activation_checkpoint,
                                     offload_activations=offload_activations, precision=precision, amp=amp,
                                     optimizer=optimizer, optimizer_shards=optimizer_shards,
                                     model_input_bytes=model_input_bytes)
    return lambda stage, start, end: worker_bytes(stage, [(start, end)])  # a stage is a worker of one chunk


# worker_bytes(worker, chunk_bounds): bytes the worker holding chunks of layers first..end-1 (in chunk order) needs
WorkerBytes = Callable[[int, Sequence[tuple[int, int]]], int]


def cost_worker_bytes(costs: Sequence[LayerCost], num_stages: int, virtual_stages: int, *,
                      num_micro_batches: int = 1, micro_batch_size: int = 1, schedule: str = "interleaved_1f1b",
                      activation_checkpoint: str = "never", offload_activations: bool = False,
                      precision: str = "fp32", amp: str | None = None, optimizer: str = "adam",
                      optimizer_shards: int = 1, model_input_bytes: int = 0) -> WorkerBytes:
    """:func:`cost_stage_bytes` for a schedule of ``virtual_stages`` model chunks per worker: a
    worker's bytes from the layers of its chunks (``chunk_bounds``: (first, end) per chunk, in
    chunk order), its ops keeping and freeing each chunk's graph or input as the memory model's
    walk does (:func:`raypipe.planning.memory._walk` with per-chunk lists)."""
    from raypipe.planning.memory import _static_bytes, _walk  # what the memory model counts, and its walk

    per_param = static_bytes_per_parameter(precision, amp, optimizer)
    schedules = make_schedule(schedule, num_stages, num_micro_batches, virtual_stages)
    saved, params = [0], [0]
    for cost in costs:
        saved.append(saved[-1] + cost.saved_bytes)
        params.append(params[-1] + cost.param_bytes)

    def worker_bytes(worker: int, chunk_bounds: Sequence[tuple[int, int]]) -> int:
        # param_bytes hold the weights
        count = round(sum(params[end] - params[start] for start, end in chunk_bounds) / per_param.weights)
        static = sum(_static_bytes(count, per_param, optimizer_shards).values())
        graphs, inputs = [], []
        for start, end in chunk_bounds:
            output = 0 if end == len(costs) else costs[end - 1].output_bytes  # the graph's root until backward
            graphs.append(micro_batch_size * (saved[end] - saved[start] + output))
            inputs.append(micro_batch_size * (costs[start - 1].output_bytes if start else model_input_bytes))
        held = _walk(schedules[worker], num_micro_batches, activation_checkpoint, offload_activations, graphs,
                     inputs, [0] * len(chunk_bounds))[0]
        return static + held

    return worker_bytes


def llama_stage_bytes(config: LlamaConfig, num_stages: int, **shape: object) -> StageBytes:
    """A LLaMA stage's total bytes from :func:`raypipe.planning.memory.estimate_stage` (``shape``:
    its keywords: num_micro_batches, micro_batch_size, seq_len, precision, schedule, ...)."""
    from raypipe.planning.memory import estimate_stage

    def stage_bytes(stage: int, start: int, end: int) -> int:
        return estimate_stage(config, range(start, end), stage_index=stage, num_stages=num_stages,
                              **shape).total_bytes  # type: ignore[arg-type]

    return stage_bytes


def layer_costs(layers: Sequence[object]) -> list[LayerCost]:
    """Each layer's :class:`LayerCost`; a layer without one raises ConfigError naming its index."""
    costs = []
    for index, layer in enumerate(layers):
        cost = layer.cost if isinstance(layer, LayerSpec) else None
        if cost is None:
            raise ConfigError("balance", "time", f"layer {index} ({layer!r}) has no cost: give every layer "
                              "as LayerSpec(..., cost=LayerCost(...)) (llama_layers does), or a balance list")
        costs.append(cost)
    return costs


def resolve_balance(config: PipelineConfig, layers: Sequence[object]) -> list[int]:
    """Layers per stage (per virtual stage, with ``virtual_stages`` > 1) of ``config.balance``: the
    list itself; "parameters" (or None) by parameter count; "time" by the layers' costs
    (:func:`balance_by_time`, no memory limit)."""
    balance = config.balance
    if balance is None or balance == "parameters":
        return partition_by_cost([layer_parameter_count(layer) for layer in layers], config.num_virtual_stages)
    if balance == "time":
        return balance_by_time(layer_costs(layers), config.num_virtual_stages,
                               activation_checkpoint=config.activation_checkpoint,
                               num_micro_batches=config.num_micro_batches)
    return list(balance)
