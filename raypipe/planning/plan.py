"""``raypipe plan``: will this pipeline fit, and if not, which knob makes it fit.

Prints the memory model's per-stage figures (:mod:`raypipe.planning.memory`) and, when
a stage does not fit in ``--gpu-memory``, the usual knobs in the usual order —
mixed precision, activation checkpointing, fused attention, a smaller
micro-batch, more stages (or optimizer-state sharding), activation offload — applied one
after another, each with the largest stage total it gives, until one fits.
"""
from __future__ import annotations

import argparse
import json
import sys

from raypipe.config import activation_arguments, max_replicas
from raypipe.core.micro_batches import replica_blocks
from raypipe.core.schedule import check_chunks
from raypipe.errors import ConfigError
from raypipe.models.llama import get_config
from raypipe.planning.cluster_plan import build_cluster_plan, render_cluster_plan
from raypipe.planning.knob_suggestions import suggest
from raypipe.planning.memory import amp_style, static_bytes_per_parameter
from raypipe.planning.plan_arguments import add_plan_arguments
from raypipe.planning.plan_balances import compare_balances, describe_balances
from raypipe.planning.plan_settings import PlanSettings, largest_stage_bytes
from raypipe.planning.stage_rows import stage_rows
from raypipe.units import format_bytes


def elastic_micro_batches(micro_batches: int, replicas: int | tuple[int, int]) -> int:
    """The most micro-batches one replica runs a step: an elastic run's step has
    ``micro_batches x MAX``, shared by as few as MIN replicas."""
    if isinstance(replicas, int):
        return micro_batches
    low, high = replicas
    return len(replica_blocks(micro_batches * high, low)[0])


def build_plan(args: argparse.Namespace) -> dict:
    """Everything ``raypipe plan`` prints, as plain data."""
    config = get_config(args.model)
    elastic = not isinstance(args.replicas, int)
    fewest = args.replicas[0] if elastic else args.replicas  # an elastic run's largest ZeRO-1 part: at MIN
    micro_batches = elastic_micro_batches(args.micro_batches, args.replicas)
    settings = PlanSettings(
        num_stages=args.stages, num_micro_batches=micro_batches, micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len or config.max_seq_len, precision=args.precision or "fp32", **activation_arguments(args),
        fused_attention=args.fused_attention, schedule=args.schedule, amp=args.amp,
        optimizer_shards=fewest if args.shard_optimizer else 1, virtual_stages=args.virtual_stages)
    try:
        check_chunks(args.schedule, args.virtual_stages)
    except ValueError as error:
        raise ConfigError("virtual_stages", args.virtual_stages, str(error)) from None
    stages = settings.estimate(config, args.gpu_memory)
    amp = amp_style(settings.precision, settings.amp)
    per_parameter = static_bytes_per_parameter(settings.precision, amp)
    fits = None if args.gpu_memory is None else all(stage.fits for stage in stages)
    rows = stage_rows(config, stages)
    return {
        "model": args.model,
        "num_parameters": sum(stage.num_parameters for stage in stages),
        "num_replicas": max_replicas(args.replicas),
        "elastic": {"min_replicas": args.replicas[0], "max_replicas": args.replicas[1],
                    "micro_batches_per_replica": micro_batches} if elastic else None,
        "settings": {**vars(settings), "amp": amp},
        "bytes_per_parameter": {**vars(per_parameter), "total": per_parameter.total},
        "gpu_memory_bytes": args.gpu_memory,
        "fits": fits,
        "max_total_bytes": largest_stage_bytes(stages),
        "stages": rows,
        "suggestions": suggest(config, settings, args.gpu_memory) if fits is False else [],
        # the balance by time is of one chunk per worker (contiguous stages)
        "balances": compare_balances(config, settings, stages, args.gpu_memory) if settings.virtual_stages == 1
        else None,
    }


# per amp style (None: fp32): what the weights, master and gradients columns hold, and a note
_STATIC_LABELS = {
    None: ("weights", "master weights", "gradients", None),
    "main_weights": ("bf16 compute weights", "fp32 main weights", "fp32 main gradients",
                     ("the common 16 B/param mixed-precision table counts 2-byte gradients, 2 + 4 + 2 + 8; "
                      "raypipe accumulates the micro-batches in fp32 main gradients: +2 B/param")),
    "autocast": ("fp32 weights", "master weights", "fp32 gradients",
                 ("autocast casts the weights in every forward: a 2-byte copy per kept micro-batch, "
                  "counted with the activations")),
    "standard": ("weights", "fp32 master weights", "gradients", None),
}


def describe_bytes_per_parameter(per_parameter: dict, amp: str | None) -> str:
    """E.g. "per parameter: 2 B bf16 compute weights + 4 B fp32 main weights + ... = 18 B (...)"."""
    weights, master, gradients, note = _STATIC_LABELS[amp]
    parts = [(per_parameter["weights"], weights), (per_parameter["master"], master),
             (per_parameter["gradients"], gradients), (per_parameter["optimizer"], "Adam moments")]
    text = " + ".join(f"{count} B {label}" for count, label in parts if count)
    return f"per parameter: {text} = {per_parameter['total']} B" + (f" ({note})" if note else "")


def describe_snapshots(plan: dict) -> str:
    """Host memory that in-memory snapshots (snapshot_every > 0) take: two kept per worker in its
    node's object store, and on a multi-node cluster a copy of both on the driver's node."""
    replicas = plan["num_replicas"]
    largest = max(row["snapshot_bytes"] for row in plan["stages"])
    every_worker = replicas * sum(row["snapshot_bytes"] for row in plan["stages"])
    return (f"snapshots (snapshot_every > 0): host memory up to 2 x {format_bytes(largest)} per worker, and on a "
            f"multi-node cluster 2 x {format_bytes(every_worker)} on the driver's node (disk when it spills)")


def describe_background_saves(plan: dict) -> str:
    """Host memory a background checkpoint save (``fit``, ``save_checkpoint(wait=False)``) takes
    while it is written: one more copy of each worker's weights and optimizer state, as a snapshot."""
    largest = max(row["snapshot_bytes"] for row in plan["stages"])
    return (f"background checkpoint saves (fit): one more host copy of up to {format_bytes(largest)} per worker "
            "while a save is written")


def render_table(plan: dict) -> str:
    """The plan as a human-readable table."""
    settings = plan["settings"]
    lines = [
        f"{plan['model']}: {plan['num_parameters'] / 1e9:.2f}B parameters, {settings['num_stages']} stages, "
        f"{settings['num_micro_batches']} micro-batches of {settings['micro_batch_size']} x {settings['seq_len']} "
        f"tokens, {settings['precision']}"
        + (f" ({settings['amp']})" if settings["precision"] != "fp32" else "")
        + f", activation_checkpoint={settings['activation_checkpoint']}"
        + (f" every {settings['activation_checkpoint_segments']} layers"
           if settings["activation_checkpoint_segments"] else "")
        + (", offload_activations" if settings["offload_activations"] else "")
        + f", {'fused' if settings['fused_attention'] else 'unfused'} attention, {settings['schedule']}"
        + (f" ({settings['virtual_stages']} chunks a stage)" if settings["virtual_stages"] > 1 else ""),
    ]
    lines.append(describe_bytes_per_parameter(plan["bytes_per_parameter"], settings["amp"]))
    if plan["elastic"]:
        elastic = plan["elastic"]
        lines.append(f"elastic {elastic['min_replicas']}-{elastic['max_replicas']} replicas: planned at "
                     f"{elastic['min_replicas']}, where each replica runs {elastic['micro_batches_per_replica']} "
                     "micro-batches a step (fewer replicas run more each; under gpipe a stage holds them all)"
                     + (f"; each worker keeps 1/{elastic['min_replicas']} of its stage's optimizer state there"
                        if settings["optimizer_shards"] > 1 else ""))
    header = ["stage", "layers", "params", "weights", "grads", "master", "optimizer", "activations",
              "offloaded", "total", "fits"]
    table = [header]
    for row in plan["stages"]:
        table.append([
            str(row["stage"]), row["description"], f"{row['num_parameters'] / 1e6:.0f}M",
            format_bytes(row["parameters_bytes"]), format_bytes(row["gradients_bytes"]),
            format_bytes(row["master_bytes"]), format_bytes(row["optimizer_bytes"]),
            format_bytes(row["activation_bytes"]), format_bytes(row["offloaded_bytes"]),
            format_bytes(row["total_bytes"]), {True: "yes", False: "NO", None: "-"}[row["fits"]]])
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    for cells in table:
        lines.append("  ".join(cell.rjust(width) if i != 1 else cell.ljust(width)
                               for i, (cell, width) in enumerate(zip(cells, widths))))
    if plan["balances"] is not None:
        lines.extend(describe_balances(plan["balances"]))
    lines.append(describe_snapshots(plan))
    lines.append(describe_background_saves(plan))
    if plan["gpu_memory_bytes"] is not None:
        verdict = "fits" if plan["fits"] else "does NOT fit"
        lines.append(f"largest stage {format_bytes(plan['max_total_bytes'])} {verdict} in "
                     f"{format_bytes(plan['gpu_memory_bytes'])} per device")
    if plan["suggestions"]:
        lines.append("next knobs, applied one after another:")
        for number, item in enumerate(plan["suggestions"], 1):
            mark = "fits" if item["fits"] else "still too large"
            lines.append(f"  {number}. {item['knob']} ({item['flags']}): {item['change']} -> largest stage "
                         f"{format_bytes(item['max_total_bytes'])}, {mark}")
            if "alternative" in item:
                lines.append(f"     {item['alternative']}")
        if not plan["suggestions"][-1]["fits"]:
            lines.append("  even with all of these the largest stage does not fit: a larger device, "
                         "shorter sequences or tensor parallelism is needed")
    lines.append("(not modelled: CUDA context, allocator fragmentation, per-op temporaries; keep headroom)")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """Entry point of ``raypipe plan``; returns the exit status."""
    try:
        if getattr(args, "cluster", None) is not None:
            plan = build_cluster_plan(args)
        elif getattr(args, "gpus", None) is not None or getattr(args, "global_batch", None) is not None:
            raise ValueError("--gpus and --global-batch need --cluster (h100, h200 or a JSON file)")
        else:
            plan = build_plan(args)
    except ValueError as error:
        print(f"raypipe plan: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(render_cluster_plan(plan) if "cluster" in plan else render_table(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m raypipe.planning.plan ...`` (the same as ``raypipe plan ...``)."""
    parser = argparse.ArgumentParser(prog="raypipe plan", description=__doc__.splitlines()[0])
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
