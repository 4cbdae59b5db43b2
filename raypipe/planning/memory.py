"""The memory model: what a pipeline stage of the LLaMA model holds, from first principles.

Two parts, per stage:

* **Static** memory, per parameter (:func:`static_bytes_per_parameter`), with Adam:

  ==========================  ========  =====  ======  =========  =====
  precision (``amp`` style)    weights   grads  master  Adam m, v  total
  ==========================  ========  =====  ======  =========  =====
  fp32                        4         4      0       8          16
  bf16 (``main_weights``)     2         4      4       8          18
  fp16 (``autocast``)         4         4      0       8          16
  bf16/fp16 (``standard``)    2         2      4       8          16
  ==========================  ========  =====  ======  =========  =====

  raypipe's ``precision="bf16"`` (``amp="main_weights"``, the default for
  bf16) is Megatron-LM's layout: 2-byte bf16 compute weights, fp32 main
  weights, fp32 main gradients and fp32 Adam moments, 2 + 4 + 4 + 8 = 18
  B/param. The common 16 B/param table (``amp="standard"``: a 7B model needs
  ≈ 112 GB) counts 2-byte gradients instead, 2 + 4 + 2 + 8; raypipe
  accumulates the micro-batches' gradients in fp32 main gradients, +2 B/param.
  Every micro-batch computes with the same compute weights, so its graph holds
  no weight copy (each bf16 gradient is added into the main gradient as soon as
  autograd finishes it, so at most one lives at a time).
  ``precision="fp16"`` (``amp="autocast"``) keeps fp32 parameters and
  gradients and runs the forward under ``torch.autocast``: 16 B/param, but
  autocast casts the weights once per forward, so every micro-batch whose graph
  is kept also holds a 2-byte copy of the stage's weights (counted with the
  activations, where autograd saves it).

* **Activations**: per micro-batch and layer, the bytes of the distinct
  storages autograd saves for backward, op by op as :mod:`raypipe.models.llama`
  runs them (see :func:`activation_breakdown`); then, per stage, the peak over
  the schedule of what is kept between forward and backward for the
  activation-checkpoint mode (:func:`estimate_stage`). This is what a stage
  measures as "held-for-backward bytes" with ``saved_tensors_hooks``
  (parameters and bf16 compute weights excluded), and the fp32 and bf16
  figures are checked against that measurement on CPU.

With tensor parallelism (``tensor_parallel`` t > 1, the LLaMA's plan of
:func:`~raypipe.models.llama.llama_tp_plan`), a stage's figures are those of its
rank holding the most: 1/t of each sharded layer's weights, gradients, main
weights and optimizer state (the embedding and head over the vocabulary, ceil(V/t)
rows), the RMSNorms whole, and the embedding's gradient whole during a step
(:func:`~raypipe.models.llama_memory.layer_gradient_counts` says why); activations
on local heads and FFN columns, and under sequence parallelism on a sequence shard
outside attention and the MLP, but the all-gathered sequence that q/k/v, gate/up
and the head keep for their weight gradients stays whole
(:func:`~raypipe.models.llama_memory.replicated_activation_breakdown` names what
stays whole). Checked against one rank's bytes on 2 gloo processes.

Not modelled: the CUDA context and allocator fragmentation, and transient
buffers of a single op (e.g. the logits' gradient during the head's backward,
the replicas' gradient reduction: two 25 MiB flat buckets and their results,
or under tensor parallelism the collectives' buffers); keep some headroom below
the device's capacity.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from raypipe.config import CHECKPOINT_MODES, check_offload_activations
from raypipe.core.ops import Op
from raypipe.core.schedule import make_schedule
from raypipe.core.validation import check_choice, check_int, check_positive_int
from raypipe.errors import ConfigError
from raypipe.models.llama import LlamaConfig, llama_layers, num_parameters
from raypipe.models.llama_memory import (AMP_STYLES, PRECISIONS, RAYPIPE_AMP, STATIC_BYTES_PER_PARAMETER,
                                         StaticBytes, activation_breakdown, amp_style, estimate_layer_activation_bytes,
                                         layer_gradient_counts, layer_kinds, layer_parameter_counts,
                                         replicated_activation_breakdown, stage_input_bytes, static_bytes_per_parameter)

# -- per stage -----------------------------------------------------------------------

@dataclass
class StageMemory:
    """Predicted memory of one pipeline stage, in bytes.

    ``activation_bytes`` is the peak over a step of what is held for backward
    on the device (kept graphs and stage inputs, plus a recompute in
    progress); ``offloaded_bytes`` the peak of kept inputs living in host
    memory instead. ``total_bytes`` = static + activations (device memory).

    ``held_for_backward_bytes`` is what a stage's ``saved_tensors_hooks`` meter
    reports (:attr:`raypipe.core.result.StageStats.held_for_backward_bytes`): the
    same walk without the per-segment recompute of ``activation_checkpoint_segments``,
    which runs inside autograd's backward where the meter does not look. A
    recomputed micro-batch's input counts both as kept and as saved by its
    first layer, as the meter counts it.
    """

    stage: int
    layers: list[int]
    num_parameters: int
    parameters_bytes: int
    gradients_bytes: int
    master_bytes: int
    optimizer_bytes: int
    static_bytes: int
    activation_bytes: int
    held_for_backward_bytes: int
    offloaded_bytes: int
    total_bytes: int
    fits: bool | None  # None when no device memory was given
    graph_bytes: int  # one micro-batch's saved tensors, all layers of the stage (+ loss)
    input_bytes: int  # one micro-batch's stage input
    micro_batches_in_flight: int

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_stage(config: LlamaConfig, layer_indices: Sequence[int], *, num_micro_batches: int,
                   micro_batch_size: int, seq_len: int, precision: str = "fp32",
                   activation_checkpoint: str = "never", activation_checkpoint_segments: int | None = None,
                   offload_activations: bool = False, fused_attention: bool = True,
                   schedule: str = "gpipe", stage_index: int = 0, num_stages: int = 1,
                   gpu_memory_bytes: int | None = None, amp: str | None = None, device: str = "cuda",
                   optimizer: str = "adam", optimizer_shards: int = 1,
                   chunk_sizes: Sequence[int] | None = None, tensor_parallel: int = 1,
                   sequence_parallel: bool | None = None) -> StageMemory:
    """Memory of the stage holding global layers ``layer_indices`` (contiguous), or with
    ``chunk_sizes`` (a schedule of model chunks: ``interleaved_1f1b``, ``zbv``) the worker holding
    them as chunks of that many layers each, in chunk order (each chunk contiguous).

    Walks the stage's ops in schedule order the way a stage keeps state:
    a forward keeps the graph (``activation_checkpoint`` "never", and the last
    micro-batch of "except_last") or only the stage input (offloaded when
    ``offload_activations``); a backward of a kept input recomputes that
    micro-batch's graph. With ``activation_checkpoint_segments=k`` a graph
    keeps only the input of every k layers
    (plus the loss), and a backward recomputes one segment at a time.
    ``optimizer_shards`` > 1 splits the optimizer state and the master weights
    over data-parallel replicas (ZeRO-1, ``shard_optimizer``). Each op of a chunked schedule
    keeps and frees its own chunk's graph or input (``graph_bytes`` and ``input_bytes`` are then
    the largest chunk's).

    ``tensor_parallel`` > 1: the memory of one of the stage's tensor-parallel ranks, the one
    holding the most (:func:`~raypipe.models.llama_memory.layer_parameter_counts` and
    :func:`~raypipe.models.llama_memory.activation_breakdown` say what it holds): 1/t of each
    sharded weight with its gradient, main weight and optimizer state, the RMSNorms whole (and the
    embedding's gradient, see :func:`~raypipe.models.llama_memory.layer_gradient_counts`); with
    ``sequence_parallel`` (None: on when ``tensor_parallel`` > 1) the stage's input and output
    and the norms' and dropout's tensors on a sequence shard.
    """
    layers = list(layer_indices)
    sizes = list(chunk_sizes) if chunk_sizes else [len(layers)]
    if sum(sizes) != len(layers) or min(sizes) < 1:
        raise ConfigError("chunk_sizes", sizes, f"must be >= 1 each and sum to the {len(layers)} layer indices")
    chunks = [layers[sum(sizes[:chunk]):sum(sizes[:chunk + 1])] for chunk in range(len(sizes))]
    for chunk in chunks:
        _check_stage_args(chunk, config.n_layers + 2, activation_checkpoint, activation_checkpoint_segments,
                          offload_activations, num_micro_batches, optimizer_shards)
    check_int("stage_index", stage_index, 0, num_stages - 1,
              f"must be an int in 0..{num_stages - 1} (num_stages={num_stages})")
    shape = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "precision": precision, "amp": amp,
             "tensor_parallel": tensor_parallel, "sequence_parallel": sequence_parallel}
    graphs, segment_transients = zip(*(_graph_bytes(config, chunk, activation_checkpoint_segments, fused_attention,
                                                    device, **shape) for chunk in chunks))
    inputs = [stage_input_bytes(config, chunk[0], **shape) for chunk in chunks]
    ops = _schedule(schedule, num_stages, num_micro_batches, len(chunks))[stage_index]
    walk = (ops, num_micro_batches, activation_checkpoint, offload_activations, graphs, inputs)
    measured, offloaded, in_flight = _walk(*walk, [0] * len(chunks))
    held = _walk(*walk, segment_transients)[0]
    count = sum(layer_parameter_counts(config, tensor_parallel=tensor_parallel)[i] for i in layers)
    gradients = sum(layer_gradient_counts(config, tensor_parallel=tensor_parallel)[i] for i in layers)
    # ZeRO-1 shards the master weights with the optimizer state (raypipe's bf16: each replica keeps the
    # fp32 main weights it owns, and bf16 compute weights of all); fp32 and fp16 have none apart
    static = _static_bytes(count, static_bytes_per_parameter(precision, amp, optimizer), optimizer_shards, gradients)
    total = sum(static.values()) + held
    return StageMemory(stage=stage_index, layers=layers, num_parameters=count, **static,
                       static_bytes=sum(static.values()), activation_bytes=held, held_for_backward_bytes=measured,
                       offloaded_bytes=offloaded, total_bytes=total,
                       fits=None if gpu_memory_bytes is None else total <= gpu_memory_bytes,
                       graph_bytes=max(graphs), input_bytes=max(inputs), micro_batches_in_flight=in_flight)


def _graph_bytes(config: LlamaConfig, layers: list[int], segments: int | None, fused_attention: bool, device: str,
                 *, micro_batch_size: int, seq_len: int, precision: str, amp: str | None, tensor_parallel: int,
                 sequence_parallel: bool | None) -> tuple[int, int]:
    """One micro-batch's kept graph, and the extra a segment's recompute adds during backward."""
    kinds = layer_kinds(config)
    shape = {"amp": amp, "tensor_parallel": tensor_parallel, "sequence_parallel": sequence_parallel}
    per_layer = [estimate_layer_activation_bytes(config, kinds[i], micro_batch_size, seq_len, precision,
                                                 fused_attention, device=device, **shape) for i in layers]
    holds_loss = layers[-1] == len(kinds) - 1  # the last stage computes the loss (outside any segment)
    loss = estimate_layer_activation_bytes(config, "loss", micro_batch_size, seq_len, precision, **shape) \
        if holds_loss else 0
    # the stage's output stays alive as the root of its graph until backward
    output = 0 if holds_loss else stage_input_bytes(config, layers[-1] + 1, micro_batch_size, seq_len, precision,
                                                    **shape)
    loss += output
    if not segments:
        return sum(per_layer) + loss, 0
    starts = range(0, len(layers), segments)
    inputs = [stage_input_bytes(config, layers[s], micro_batch_size, seq_len, precision, **shape) for s in starts]
    # a segment's recompute re-saves its input's storage, which is already held
    transient = max(sum(per_layer[s:s + segments]) - kept for s, kept in zip(starts, inputs))
    return sum(inputs) + loss, transient


def _static_bytes(count: int, per_param: StaticBytes, optimizer_shards: int,
                  gradients: int | None = None) -> dict[str, int]:
    """``gradients``: the gradient elements held, when not one per parameter."""
    gradients = count if gradients is None else gradients
    return {"parameters_bytes": count * per_param.weights, "gradients_bytes": gradients * per_param.gradients,
            # ZeRO-1: each data-parallel replica keeps its shard of the optimizer state (and master weights)
            "master_bytes": -(-count * per_param.master // optimizer_shards),
            "optimizer_bytes": -(-count * per_param.optimizer // optimizer_shards)}


@functools.lru_cache(maxsize=4)
def _schedule(name: str, num_stages: int, num_micro_batches: int, num_chunks: int) -> tuple[tuple[Op, ...], ...]:
    """``make_schedule``'s ops, read-only, built (and dry-run) once per shape in use: a plan
    estimates every stage of one shape, and make_schedule builds and checks the whole schedule
    each time (a plan of 34 stages x 2048 micro-batches spent 20 s there)."""
    return tuple(tuple(ops) for ops in make_schedule(name, num_stages, num_micro_batches, num_chunks))


def _walk(ops, num_micro_batches: int, activation_checkpoint: str, offload: bool, graphs: Sequence[int],
          inputs: Sequence[int], segment_transients: Sequence[int]) -> tuple[int, int, int]:
    """Peak held bytes, peak offloaded bytes and peak (chunk, micro-batch)s in flight over one step;
    ``graphs``, ``inputs`` and ``segment_transients`` per model chunk (one, without chunks).

    A backward split in two (the zero-bubble schedules) holds more than an unsplit one: the
    input-gradient op (I) runs with the graph retained, because the weight-gradient op (W)
    walks it again, so a micro-batch's graph (rebuilt whole, if it was recomputed) stays
    held from its I until its W, and the micro-batch is in flight until its W.
    """
    held = offloaded = peak_held = peak_offloaded = in_flight = peak_in_flight = 0
    for op in ops:
        graph, input_bytes, segment_transient = graphs[op.chunk], inputs[op.chunk], segment_transients[op.chunk]
        recompute = activation_checkpoint == "always" or (
            activation_checkpoint == "except_last" and op.micro_batch != num_micro_batches - 1)
        # a recompute rebuilds this micro-batch's graph while the others stay kept; its
        # input is already counted as kept unless it was offloaded
        rebuilt = graph - (0 if offload else input_bytes) if recompute else 0
        if op.kind == "F":
            in_flight += 1
            if not recompute:
                held += graph
            elif offload:
                offloaded += input_bytes
            else:
                held += input_bytes
        elif op.kind == "I":
            # the rebuilt graph (every segment of it: W needs them all) stays until W
            held += rebuilt + (segment_transient if recompute else 0)
            peak_held = max(peak_held, held)
        else:
            if op.kind == "B":
                peak_held = max(peak_held, held + rebuilt + segment_transient)
            else:  # W frees what its I kept
                held -= rebuilt + (segment_transient if recompute else 0)
            in_flight -= 1
            if not recompute:
                held -= graph
            elif offload:
                offloaded -= input_bytes
            else:
                held -= input_bytes
        peak_held, peak_offloaded = max(peak_held, held), max(peak_offloaded, offloaded)
        peak_in_flight = max(peak_in_flight, in_flight)
    return peak_held, peak_offloaded, peak_in_flight


def balanced_partition(config: LlamaConfig, num_stages: int) -> list[int]:
    """Layers per stage, contiguous, balanced by parameter count (embedding and head included)."""
    from raypipe.core.partition import partition_by_cost

    return partition_by_cost(layer_parameter_counts(config), num_stages)


def estimate_pipeline(config: LlamaConfig, num_stages: int, num_micro_batches: int, micro_batch_size: int,
                      seq_len: int, precision: str = "fp32", activation_checkpoint: str = "never",
                      offload_activations: bool = False, fused_attention: bool = True,
                      balance: Sequence[int] | None = None, gpu_memory_bytes: int | None = None, *,
                      activation_checkpoint_segments: int | None = None,
                      schedule: str = "gpipe", amp: str | None = None, device: str = "cuda",
                      optimizer: str = "adam", optimizer_shards: int = 1,
                      virtual_stages: int = 1, tensor_parallel: int = 1,
                      sequence_parallel: bool | None = None) -> list[StageMemory]:
    """:func:`estimate_stage` for every stage (worker) of ``llama_layers(config)`` split by ``balance``
    (layers per stage, or per virtual stage with ``virtual_stages`` > 1 model chunks per worker, placed
    as the schedule places them; default: balanced by parameter count); with ``tensor_parallel`` > 1
    each stage's figures are one tensor-parallel rank's (the one holding the most)."""
    from raypipe.core.partition import worker_chunks
    from raypipe.core.schedule import PLACEMENT

    num_layers = config.n_layers + 2
    check_positive_int("num_stages", num_stages)
    check_positive_int("virtual_stages", virtual_stages)
    pieces = num_stages * virtual_stages
    if pieces > num_layers:
        raise ConfigError("num_stages", num_stages, f"the model has only {num_layers} layers "
                          f"(embedding, {config.n_layers} blocks, head)"
                          + (f" for {virtual_stages} chunks a stage" if virtual_stages > 1 else ""))
    balance = list(balance) if balance is not None else balanced_partition(config, pieces)
    if len(balance) != pieces or any(size < 1 for size in balance) or sum(balance) != num_layers:
        raise ConfigError("balance", balance, f"needs {pieces} positive entries summing to {num_layers} layers")
    stages = []
    for stage, chunks in enumerate(worker_chunks(balance, num_stages, PLACEMENT[schedule])):
        stages.append(estimate_stage(
            config, [index for chunk in chunks for index in chunk], num_micro_batches=num_micro_batches,
            micro_batch_size=micro_batch_size, seq_len=seq_len, precision=precision,
            activation_checkpoint=activation_checkpoint, activation_checkpoint_segments=activation_checkpoint_segments,
            offload_activations=offload_activations, fused_attention=fused_attention,
            schedule=schedule, stage_index=stage, num_stages=num_stages, gpu_memory_bytes=gpu_memory_bytes,
            amp=amp, device=device, optimizer=optimizer, optimizer_shards=optimizer_shards,
            chunk_sizes=[len(chunk) for chunk in chunks], tensor_parallel=tensor_parallel,
            sequence_parallel=sequence_parallel))
    return stages


def spec_parameter_count(config: LlamaConfig) -> int:
    """Parameter count from building every layer on the meta device (cross-checks :func:`num_parameters`)."""
    return sum(spec.num_parameters() for spec in llama_layers(config))


# -- argument checks -------------------------------------------------------------------

def _check_stage_args(layers: list[int], num_layers: int, activation_checkpoint: str, segments: int | None,
                      offload_activations: bool, num_micro_batches: int, optimizer_shards: int) -> None:
    if not layers or layers != list(range(layers[0], layers[0] + len(layers))) or layers[0] < 0 \
            or layers[-1] >= num_layers:
        raise ConfigError("layer_indices", layers, f"must be a non-empty contiguous run within 0..{num_layers - 1}")
    check_choice("activation_checkpoint", activation_checkpoint, CHECKPOINT_MODES)
    if segments is not None:
        check_positive_int("activation_checkpoint_segments", segments)
    check_offload_activations(offload_activations, activation_checkpoint)
    check_positive_int("num_micro_batches", num_micro_batches)
    check_positive_int("optimizer_shards", optimizer_shards)


__all__ = ["AMP_STYLES", "PRECISIONS", "RAYPIPE_AMP", "STATIC_BYTES_PER_PARAMETER", "StageMemory", "StaticBytes",
           "activation_breakdown", "amp_style", "balanced_partition", "estimate_layer_activation_bytes",
           "estimate_pipeline", "estimate_stage", "layer_gradient_counts", "layer_kinds", "layer_parameter_counts",
           "num_parameters", "replicated_activation_breakdown", "spec_parameter_count", "stage_input_bytes",
           "static_bytes_per_parameter"]
