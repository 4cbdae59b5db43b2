"""When a stage does not fit: the usual knobs (mixed precision, activation checkpointing,
fused attention, a smaller micro-batch, more stages or optimizer-state sharding, activation
offload) applied one after another, each with the largest stage total it gives."""
from __future__ import annotations

from dataclasses import replace

from raypipe.models.llama import LlamaConfig
from raypipe.planning.plan_settings import PlanSettings, largest_stage_bytes

MAX_OPTIMIZER_SHARDS = 64


def suggest(config: LlamaConfig, settings: PlanSettings, gpu_memory_bytes: int) -> list[dict]:
    """The knobs, applied cumulatively in the usual order, until the largest stage fits."""
    suggestions = []

    def tried(knob: str, change: str, flags: str, new: PlanSettings, alternative: str | None = None) -> bool:
        largest = largest_stage_bytes(new.estimate(config, gpu_memory_bytes))
        entry = {"knob": knob, "change": change, "flags": flags, "max_total_bytes": largest,
                 "fits": largest <= gpu_memory_bytes}
        if alternative:
            entry["alternative"] = alternative
        suggestions.append(entry)
        return entry["fits"]

    if settings.precision == "fp32":
        settings = replace(settings, precision="bf16")
        if tried("mixed precision", "bf16 compute weights and activations, fp32 main weights and gradients",
                 "--precision bf16", settings):
            return suggestions
    if settings.activation_checkpoint == "never":
        settings = replace(settings, activation_checkpoint="always")
        if tried("activation checkpointing", "keep only stage inputs, recompute in backward",
                 "--activation-checkpoint always", settings):
            return suggestions
    if not settings.fused_attention:
        settings = replace(settings, fused_attention=True)
        if tried("fused attention", "flash attention: no (s x s) probabilities saved", "--fused-attention", settings):
            return suggestions
    if settings.micro_batch_size > 1:
        micro_batches = settings.num_micro_batches * settings.micro_batch_size
        settings = replace(settings, micro_batch_size=1, num_micro_batches=micro_batches)
        if tried("smaller micro-batch", f"micro-batch size 1, {micro_batches} micro-batches (same global batch)",
                 f"--micro-batch-size 1 --micro-batches {micro_batches}", settings):
            return suggestions
    shards = _fitting_shards(config, settings, gpu_memory_bytes)
    alternative = (f"or keep {settings.num_stages} stages and shard the optimizer state and main weights over "
                   f"{shards} data-parallel replicas (--replicas {shards} --shard-optimizer)" if shards else None)
    stages = _fitting_stages(config, settings, gpu_memory_bytes)
    if stages != settings.num_stages:
        settings = replace(settings, num_stages=stages)
        if tried("more stages", f"{stages} pipeline stages", f"--stages {stages}", settings, alternative):
            return suggestions
    if settings.activation_checkpoint != "never" and not settings.offload_activations:
        settings = replace(settings, offload_activations=True)
        tried("activation offload", "kept stage inputs in host memory", "--offload-activations", settings)
    return suggestions


def _fitting_stages(config: LlamaConfig, settings: PlanSettings, gpu_memory_bytes: int) -> int:
    """Fewest stages (doubling) whose largest stage fits; at most one layer per stage (per chunk, with
    model chunks); only stage counts the schedule runs with (interleaved_1f1b: m a multiple of p)."""
    most = (config.n_layers + 2) // settings.virtual_stages
    stages = found = settings.num_stages
    while stages < most:
        stages = min(stages * 2, most)
        more = replace(settings, num_stages=stages)
        try:
            largest = largest_stage_bytes(more.estimate(config, gpu_memory_bytes))
        except ValueError:  # interleaved_1f1b: the micro-batches are not a multiple of this many stages
            continue
        found = stages
        if largest <= gpu_memory_bytes:
            break
    return found


def _fitting_shards(config: LlamaConfig, settings: PlanSettings, gpu_memory_bytes: int) -> int | None:
    shards = 2
    while shards <= MAX_OPTIMIZER_SHARDS:
        sharded = replace(settings, optimizer_shards=shards)
        if largest_stage_bytes(sharded.estimate(config, gpu_memory_bytes)) <= gpu_memory_bytes:
            return shards
        shards *= 2
    return None
