"""The balances block of ``raypipe plan``: per-stage time and memory of the parameter balance
against the time balance."""
from __future__ import annotations

from raypipe.models.llama import LlamaConfig
from raypipe.models.llama_costs import llama_layer_costs
from raypipe.planning.balance import balance_by_time, layer_step_flops, llama_stage_bytes, stage_times
from raypipe.planning.memory import StageMemory
from raypipe.planning.plan_settings import PlanSettings, largest_stage_bytes
from raypipe.units import format_bytes


def compare_balances(config: LlamaConfig, settings: PlanSettings, parameter_stages: list[StageMemory],
                     gpu_memory_bytes: int | None) -> dict:
    """Per-stage time (training flops of one step) and memory of the parameter balance (the
    plan's stages) and of the time balance (:func:`raypipe.planning.balance.balance_by_time`,
    each stage within ``gpu_memory_bytes`` when one exists, else unconstrained)."""
    costs = llama_layer_costs(config, settings.seq_len, settings.precision, settings.fused_attention,
                              amp=settings.amp)
    # one step of one replica: micro-batches of micro_batch_size sequences
    times = [settings.micro_batch_size * layer_step_flops(cost, settings.activation_checkpoint,
                                                          settings.num_micro_batches) for cost in costs]
    stage_bytes = llama_stage_bytes(
        config, settings.num_stages, num_micro_batches=settings.num_micro_batches,
        micro_batch_size=settings.micro_batch_size, seq_len=settings.seq_len, precision=settings.precision,
        activation_checkpoint=settings.activation_checkpoint,
        activation_checkpoint_segments=settings.activation_checkpoint_segments,
        offload_activations=settings.offload_activations, fused_attention=settings.fused_attention,
        schedule=settings.schedule, amp=settings.amp, optimizer_shards=settings.optimizer_shards)
    memory_limited = gpu_memory_bytes is not None
    try:
        by_time = balance_by_time(costs, settings.num_stages, activation_checkpoint=settings.activation_checkpoint,
                                  num_micro_batches=settings.num_micro_batches, stage_bytes=stage_bytes,
                                  memory_limit_bytes=gpu_memory_bytes)
    except ValueError:  # no split fits: the fastest one regardless, marked as not fitting
        memory_limited = False
        by_time = balance_by_time(costs, settings.num_stages, activation_checkpoint=settings.activation_checkpoint,
                                  num_micro_batches=settings.num_micro_batches)
    time_stages = settings.estimate(config, gpu_memory_bytes, balance=by_time)
    out = {}
    for name, stages in (("parameters", parameter_stages), ("time", time_stages)):
        balance = [len(stage.layers) for stage in stages]
        flops = stage_times(times, balance)
        out[name] = {"balance": balance, "stage_flops": flops, "max_stage_flops": max(flops),
                     "stage_total_bytes": [stage.total_bytes for stage in stages],
                     "max_total_bytes": largest_stage_bytes(stages),
                     "fits": None if gpu_memory_bytes is None else all(stage.fits for stage in stages)}
    out["time"]["memory_limited"] = memory_limited
    return out

def describe_balances(balances: dict) -> list[str]:
    """Per-stage time and memory of the parameter balance (the table above) and the time balance."""
    slowest = balances["parameters"]["max_stage_flops"] or 1
    lines = ["stage time (training flops of a step, relative to the slowest stage above) and total memory:"]
    for name in ("parameters", "time"):
        entry = balances[name]
        times = " ".join(f"{flops / slowest:.2f}" for flops in entry["stage_flops"])
        memory = " ".join(format_bytes(total) for total in entry["stage_total_bytes"])
        note = "" if entry["fits"] is not False else ", does NOT fit"
        if name == "time" and not entry["memory_limited"] and entry["fits"] is not None:
            note += " (no split fits: the fastest regardless of memory)"
        lines.append(f"  by {name:<10} {entry['balance']}: time {times} (slowest "
                     f"{entry['max_stage_flops'] / 1e12:,.1f} TFLOP); memory {memory}{note}")
    gain = balances["parameters"]["max_stage_flops"] / (balances["time"]["max_stage_flops"] or 1)
    lines.append(f"  --balance time: slowest stage {gain:.2f}x faster than --balance parameters (predicted, "
                 "compute only)")
    return lines


