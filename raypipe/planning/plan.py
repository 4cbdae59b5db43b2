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
from dataclasses import dataclass, replace

from raypipe.config import activation_arguments, add_activation_arguments, max_replicas, parse_replicas
from raypipe.core.micro_batches import replica_blocks
from raypipe.core.schedule import SCHEDULES
from raypipe.models.llama import CONFIGS, LlamaConfig, get_config
from raypipe.planning.memory import (
    AMP_STYLES,
    PRECISIONS,
    RAYPIPE_AMP,
    StageMemory,
    amp_style,
    estimate_pipeline,
    static_bytes_per_parameter,
)
from raypipe.units import format_bytes, parse_bytes

MAX_OPTIMIZER_SHARDS = 64


def memory_size(text: str) -> int:
    """``--gpu-memory``'s type: :func:`~raypipe.units.parse_bytes`, its error as argparse shows one."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``raypipe plan``."""
    parser.add_argument("--model", default="llama-7b", choices=sorted(CONFIGS), help="named model config")
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step and replica (default 1)")
    parser.add_argument("--replicas", type=parse_replicas, default=1, metavar="N|MIN:MAX",
                        help="data-parallel copies of the pipeline (default 1); MIN:MAX plans an elastic run at MIN, "
                             "where each replica runs the most micro-batches")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="ZeRO-1: each replica of a stage keeps 1/replicas of the optimizer state "
                             "(and in bf16 of the fp32 main weights); elastic: 1/MIN")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's max)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    add_activation_arguments(parser)
    parser.add_argument("--fused-attention", action=argparse.BooleanOptionalAction, default=True,
                        help="flash-style attention that saves no (s x s) probabilities (default: on)")
    parser.add_argument("--schedule", default="gpipe", choices=SCHEDULES)
    parser.add_argument("--amp", default=None, choices=AMP_STYLES,
                        help="bf16/fp16 style (default: what raypipe runs, "
                             + ", ".join(f"{p}: {s}" for p, s in RAYPIPE_AMP.items()) + "): "
                             "'main_weights' = bf16 compute weights + fp32 main weights and grads (18 B/param); "
                             "'autocast' = fp32 weights under torch.autocast (weight copies per micro-batch); "
                             "'standard' = 2-byte weights and grads + fp32 master (the common 16 B/param)")
    parser.add_argument("--gpu-memory", type=memory_size, default=None, metavar="SIZE",
                        help="device memory per stage, e.g. 80GB or 80GiB; enables fits/suggestions")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


@dataclass(frozen=True)
class PlanSettings:
    """The knobs a plan (and each suggestion) is evaluated with."""

    num_stages: int
    num_micro_batches: int
    micro_batch_size: int
    seq_len: int
    precision: str
    activation_checkpoint: str
    activation_checkpoint_segments: int | None
    offload_activations: bool
    fused_attention: bool
    schedule: str
    amp: str | None  # None: the style raypipe runs for the precision
    optimizer_shards: int = 1

    def estimate(self, config: LlamaConfig, gpu_memory_bytes: int | None) -> list[StageMemory]:
        return estimate_pipeline(
            config, self.num_stages, self.num_micro_batches, self.micro_batch_size, self.seq_len,
            self.precision, self.activation_checkpoint, self.offload_activations, self.fused_attention,
            gpu_memory_bytes=gpu_memory_bytes, activation_checkpoint_segments=self.activation_checkpoint_segments,
            schedule=self.schedule, amp=self.amp, optimizer_shards=self.optimizer_shards)


def suggest(config: LlamaConfig, settings: PlanSettings, gpu_memory_bytes: int) -> list[dict]:
    """The knobs, applied cumulatively in the usual order, until the largest stage fits."""
    suggestions = []

    def tried(knob: str, change: str, flags: str, new: PlanSettings, alternative: str | None = None) -> bool:
        largest = _max_total(new.estimate(config, gpu_memory_bytes))
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


def _max_total(stages: list[StageMemory]) -> int:
    return max(stage.total_bytes for stage in stages)


def _fitting_stages(config: LlamaConfig, settings: PlanSettings, gpu_memory_bytes: int) -> int:
    """Fewest stages (doubling) whose largest stage fits; at most one layer per stage."""
    most = config.n_layers + 2
    stages = settings.num_stages
    while stages < most:
        stages = min(stages * 2, most)
        if _max_total(replace(settings, num_stages=stages).estimate(config, gpu_memory_bytes)) <= gpu_memory_bytes:
            break
    return stages


def _fitting_shards(config: LlamaConfig, settings: PlanSettings, gpu_memory_bytes: int) -> int | None:
    shards = 2
    while shards <= MAX_OPTIMIZER_SHARDS:
        sharded = replace(settings, optimizer_shards=shards)
        if _max_total(sharded.estimate(config, gpu_memory_bytes)) <= gpu_memory_bytes:
            return shards
        shards *= 2
    return None


def snapshot_bytes(stage: StageMemory) -> int:
    """One in-memory snapshot of a worker of ``stage`` (host memory, object store): its
    layers' weights (fp32 main weights under mixed precision; with ZeRO-1 those it owns,
    and the compute weights of the others) and its optimizer state."""
    if not stage.master_bytes:
        return stage.parameters_bytes + stage.optimizer_bytes
    owned_share = stage.master_bytes / (4 * stage.num_parameters)  # fp32 main weights: 4 B each
    return stage.master_bytes + round(stage.parameters_bytes * (1 - owned_share)) + stage.optimizer_bytes


def describe_layers(config: LlamaConfig, layers: list[int]) -> str:
    """Global layer indices as "embedding + blocks 0-3" etc."""
    parts = []
    if layers[0] == 0:
        parts.append("embedding")
    blocks = [index - 1 for index in layers if 1 <= index <= config.n_layers]
    if blocks:
        parts.append(f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}")
    if layers[-1] == config.n_layers + 1:
        parts.append("head")
    return " + ".join(parts)


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
        seq_len=args.seq_len or config.max_seq_len, precision=args.precision, **activation_arguments(args),
        fused_attention=args.fused_attention, schedule=args.schedule, amp=args.amp,
        optimizer_shards=fewest if args.shard_optimizer else 1)
    stages = settings.estimate(config, args.gpu_memory)
    amp = amp_style(settings.precision, settings.amp)
    per_parameter = static_bytes_per_parameter(settings.precision, amp)
    fits = None if args.gpu_memory is None else all(stage.fits for stage in stages)
    rows = []
    for stage in stages:
        row = stage.to_dict()
        row["description"] = describe_layers(config, stage.layers)
        row["snapshot_bytes"] = snapshot_bytes(stage)
        rows.append(row)
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
        "max_total_bytes": _max_total(stages),
        "stages": rows,
        "suggestions": suggest(config, settings, args.gpu_memory) if fits is False else [],
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
        + f", {'fused' if settings['fused_attention'] else 'unfused'} attention, {settings['schedule']}",
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
        plan = build_plan(args)
    except ValueError as error:
        print(f"raypipe plan: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else render_table(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m raypipe.planning.plan ...`` (the same as ``raypipe plan ...``)."""
    parser = argparse.ArgumentParser(prog="raypipe plan", description=__doc__.splitlines()[0])
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
