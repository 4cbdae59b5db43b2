"""``raypipe plan``: will this pipeline fit, and if not, which knob makes it fit; with
``--cluster``, which configuration runs fastest on a described cluster.

The memory plan prints the memory model's per-stage figures (:mod:`raypipe.planning.memory`)
for the knobs it is evaluated with (:class:`PlanSettings`) and, when a stage does not fit in
``--gpu-memory``, the usual knobs in the usual order — mixed precision, activation
checkpointing, fused attention, a smaller micro-batch, more stages (or optimizer-state
sharding), activation offload — applied one after another, each with the largest stage total
it gives, until one fits (:func:`suggest`); then per-stage time and memory of the parameter
balance against the time balance (:func:`compare_balances`).

``--cluster`` prints the predicted step time on a described cluster
(:mod:`raypipe.planning.configuration_search`): the best configurations, the job command line
and Helm values that run them, what the snapshot keeper holds and copies for the best one
(:func:`keeper_plan`), the best one's stages and balances; with
``--node-mtbf-hours H`` each configuration's goodput per recovery method
(:mod:`raypipe.planning.goodput`), from its predicted step and its stages' state.
``--published`` predicts published runs at their own layouts beside their measured throughput
(:mod:`raypipe.planning.published_layouts`).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace

from raypipe.config import activation_arguments, add_activation_arguments, max_replicas, parse_replicas
from raypipe.core.micro_batches import replica_blocks
from raypipe.core.schedule import NATURAL_CHUNKS, SCHEDULES, check_chunks
from raypipe.errors import ConfigError
from raypipe.models.llama import CONFIGS, LlamaConfig, get_config
from raypipe.models.llama_costs import llama_layer_costs
from raypipe.models.llama_memory import layer_parameter_counts
from raypipe.planning.balance import balance_by_time, layer_step_flops, llama_stage_bytes, stage_times
from raypipe.planning.cluster_spec import Cluster
from raypipe.planning.goodput import (METHODS, STRAGGLER_POLICIES, GoodputAssumptions, RunShape, goodput_by_method,
                                      job_mttf_hours, keeper_snapshot_every, straggler_goodput)
from raypipe.planning.memory import (AMP_STYLES, PRECISIONS, RAYPIPE_AMP, StageMemory, amp_style, balanced_partition,
                                     estimate_pipeline, static_bytes_per_parameter)
from raypipe.planning.predict import stage_bounds, worker_sums
from raypipe.units import format_bytes, parse_bytes


# -- the knobs a plan is evaluated with ----------------------------------------------

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
    virtual_stages: int = 1  # model chunks per worker (interleaved_1f1b, zbv)
    tensor_parallel: int = 1  # GPUs per stage; each stage's figures are one rank's
    sequence_parallel: bool | None = None  # None: on when tensor_parallel > 1

    def estimate(self, config: LlamaConfig, gpu_memory_bytes: int | None,
                 balance: list[int] | None = None) -> list[StageMemory]:
        return estimate_pipeline(
            config, self.num_stages, self.num_micro_batches, self.micro_batch_size, self.seq_len,
            self.precision, self.activation_checkpoint, self.offload_activations, self.fused_attention,
            balance=balance, gpu_memory_bytes=gpu_memory_bytes,
            activation_checkpoint_segments=self.activation_checkpoint_segments,
            schedule=self.schedule, amp=self.amp, optimizer_shards=self.optimizer_shards,
            virtual_stages=self.virtual_stages, tensor_parallel=self.tensor_parallel,
            sequence_parallel=self.sequence_parallel)

    def to_dict(self, amp: str | None) -> dict:
        """The plan's ``settings``: the knobs with the amp style resolved; the tensor-parallel ones only
        at ``tensor_parallel`` > 1 (a plan without it reads as before)."""
        out = {**vars(self), "amp": amp}
        if self.tensor_parallel == 1:
            del out["tensor_parallel"], out["sequence_parallel"]
        return out


def largest_stage_bytes(stages: list[StageMemory]) -> int:
    """The largest stage total of an estimate."""
    return max(stage.total_bytes for stage in stages)


# -- the command's flags -------------------------------------------------------------

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
    parser.add_argument("--precision", default=None, choices=PRECISIONS,
                        help="(default: fp32; bf16 with --cluster)")
    add_activation_arguments(parser)
    parser.add_argument("--fused-attention", action=argparse.BooleanOptionalAction, default=True,
                        help="flash-style attention that saves no (s x s) probabilities (default: on)")
    parser.add_argument("--schedule", default="gpipe", choices=SCHEDULES,
                        help="(default gpipe); interleaved_1f1b and zbv hold --virtual-stages chunks a stage")
    parser.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                        help="model chunks per stage: >= 2 for interleaved_1f1b, 2 for zbv, 1 for the others "
                             "(default: the schedule's own, 2 for interleaved_1f1b and zbv, 1 for the others); "
                             "each stage row then sums its chunks")
    parser.add_argument("--amp", default=None, choices=AMP_STYLES,
                        help="bf16/fp16 style (default: what raypipe runs, "
                             + ", ".join(f"{p}: {s}" for p, s in RAYPIPE_AMP.items()) + "): "
                             "'main_weights' = bf16 compute weights + fp32 main weights and grads (18 B/param); "
                             "'autocast' = fp32 weights under torch.autocast (weight copies per micro-batch); "
                             "'standard' = 2-byte weights and grads + fp32 master (the common 16 B/param)")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="T",
                        help="GPUs per stage splitting its layers (tensor parallelism): each stage row is one rank's "
                             "memory (default 1; with --cluster: searched over 1, 2, 4, 8, or fixed to T)")
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                        help="with tensor parallelism, activations sharded along the sequence between the split "
                             "layers and across stage boundaries (default: on)")
    parser.add_argument("--gpu-memory", type=memory_size, default=None, metavar="SIZE",
                        help="device memory per stage, e.g. 80GB or 80GiB; enables fits/suggestions")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cluster = parser.add_argument_group(
        "predicted step time (--cluster)",
        "search replicas x stages x tensor parallelism = --gpus, micro-batches, schedule (gpipe, 1f1b, zb_h1, "
        "interleaved_1f1b, zbv), recompute and ZeRO-1 for the highest predicted tokens/s that fits; --stages, "
        "--replicas, --micro-batches, --schedule, --activation-checkpoint and --shard-optimizer are searched, not "
        "taken; --tensor-parallel T fixes t")
    cluster.add_argument("--cluster", metavar="h100|h200|FILE",
                         help="a preset (raypipe/planning/clusters/NAME.json) or a JSON file of that form")
    cluster.add_argument("--gpus", type=int, default=None, metavar="N",
                         help="GPUs of the run (replicas x stages x tensor-parallel ranks)")
    cluster.add_argument("--global-batch", type=int, default=None, metavar="SEQUENCES",
                         help="fix sequences per step (replicas x micro-batches x micro-batch size); default: "
                              "micro-batches from {stages, 2 x stages, 4 x stages}")
    cluster.add_argument("--top", type=int, default=3, metavar="K", help="configurations printed (default 3)")
    cluster.add_argument("--published", action="store_true",
                         help="instead of a search: predict published runs (the Llama 3 paper's, Megatron-LM's and "
                              "torchtitan's on H100s) at their own layouts, beside their published tokens/s per GPU "
                              "and the reason for each difference, on --cluster (default h100); the rows fix their "
                              "own models and layouts: --gpus, --global-batch and --node-mtbf-hours are errors")
    cluster.add_argument("--node-mtbf-hours", type=float, default=None, metavar="H",
                         help="mean hours between failures of one node (a Poisson process per node): adds each "
                              "configuration's goodput per recovery method (raypipe's stage replacement with and "
                              "without warm spares, a full restart from checkpoints, dropping the failed replica's "
                              "step); arXiv 2410.21680's 7.9 h job MTTF at 1,024 GPUs is H ~ 1011")
    cluster.add_argument("--slow-node-share", type=float, default=None, metavar="S",
                         help="with --node-mtbf-hours: the share of nodes slow for the whole run (a persistent "
                              "straggler), adding each configuration's goodput under on_slow report, replace and "
                              "rebalance")
    cluster.add_argument("--slow-node-factor", type=float, default=2.0, metavar="F",
                         help="how many times slower a slow node's workers compute (default 2)")


# -- the memory plan: the knobs that make a stage fit ----------------------------------

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
    model chunks); only stage counts the schedule runs with (interleaved_1f1b: m in max(1, m // p) equal rounds)."""
    most = (config.n_layers + 2) // settings.virtual_stages
    stages = found = settings.num_stages
    while stages < most:
        stages = min(stages * 2, most)
        more = replace(settings, num_stages=stages)
        try:
            largest = largest_stage_bytes(more.estimate(config, gpu_memory_bytes))
        except ValueError:  # interleaved_1f1b: the micro-batches do not split into m // p equal rounds
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


# -- the memory plan: the balance by parameters against the balance by time -----------

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
        schedule=settings.schedule, amp=settings.amp, optimizer_shards=settings.optimizer_shards,
        tensor_parallel=settings.tensor_parallel, sequence_parallel=settings.sequence_parallel)
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


# -- the memory plan: per-stage rows ---------------------------------------------------

def snapshot_bytes(stage: StageMemory) -> int:
    """One in-memory snapshot of a worker of ``stage`` (host memory, object store): its
    layers' weights (fp32 main weights under mixed precision; with ZeRO-1 those it owns,
    and the compute weights of the others) and its optimizer state."""
    if not stage.master_bytes:
        return stage.parameters_bytes + stage.optimizer_bytes
    owned_share = stage.master_bytes / (4 * stage.num_parameters)  # fp32 main weights: 4 B each
    return stage.master_bytes + round(stage.parameters_bytes * (1 - owned_share)) + stage.optimizer_bytes


def describe_layers(config: LlamaConfig, layers: list[int]) -> str:
    """Global layer indices as "embedding + blocks 0-3" etc.; a worker's model chunks (runs of
    consecutive layers) one after the other, joined by " | "."""
    runs: list[list[int]] = []
    for index in layers:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return " | ".join(_describe_run(config, run) for run in runs)


def _describe_run(config: LlamaConfig, layers: list[int]) -> str:
    parts = []
    if layers[0] == 0:
        parts.append("embedding")
    blocks = [index - 1 for index in layers if 1 <= index <= config.n_layers]
    if blocks:
        parts.append(f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}")
    if layers[-1] == config.n_layers + 1:
        parts.append("head")
    return " + ".join(parts)


def stage_rows(config: LlamaConfig, stages: list[StageMemory]) -> list[dict]:
    """Each stage's figures as a row of a plan, with its layers described and its snapshot size."""
    rows = []
    for stage in stages:
        row = stage.to_dict()
        row["description"] = describe_layers(config, stage.layers)
        row["snapshot_bytes"] = snapshot_bytes(stage)
        rows.append(row)
    return rows


# -- the memory plan -------------------------------------------------------------------

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
    if args.virtual_stages is None:  # the schedule's own, as PipelineConfig.virtual_stages=None
        args.virtual_stages = NATURAL_CHUNKS[args.schedule]
    settings = PlanSettings(
        num_stages=args.stages, num_micro_batches=micro_batches, micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len or config.max_seq_len, precision=args.precision or "fp32", **activation_arguments(args),
        fused_attention=args.fused_attention, schedule=args.schedule, amp=args.amp,
        optimizer_shards=fewest if args.shard_optimizer else 1, virtual_stages=args.virtual_stages,
        tensor_parallel=1 if args.tensor_parallel is None else args.tensor_parallel,
        sequence_parallel=args.sequence_parallel)
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
        "num_parameters": sum(layer_parameter_counts(config)),  # the model's (a row at t > 1: one rank's)
        "num_replicas": max_replicas(args.replicas),
        "elastic": {"min_replicas": args.replicas[0], "max_replicas": args.replicas[1],
                    "micro_batches_per_replica": micro_batches} if elastic else None,
        "settings": settings.to_dict(amp),
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
    node's object store (three for a step when one is still being stored as the next is taken:
    the one before stays until it is), and on a multi-node cluster a copy of two on the driver's
    node (the keeper takes no new one while it copies)."""
    replicas = plan["num_replicas"]
    largest = max(row["snapshot_bytes"] for row in plan["stages"])
    every_worker = replicas * sum(row["snapshot_bytes"] for row in plan["stages"])
    return (f"snapshots (snapshot_every > 0): host memory up to 2 x {format_bytes(largest)} per worker (3 x while "
            "one is still being stored as the next is taken), and on a "
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
        + (f" ({settings['virtual_stages']} chunks a stage)" if settings["virtual_stages"] > 1 else "")
        + (f", tensor parallel {settings['tensor_parallel']} (sequence parallel "
           f"{'off' if settings['sequence_parallel'] is False else 'on'}): each row is one rank's"
           if "tensor_parallel" in settings else ""),
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


# -- --cluster: the best configurations on a described cluster -------------------------

def build_cluster_plan(args: argparse.Namespace) -> dict:
    """``raypipe plan --cluster``: the best configurations on ``--gpus`` GPUs
    (:func:`raypipe.planning.configuration_search.search_plans`), the best one with today's fields (its
    stages' memory, its balance against the parameter balance) and the commands that run them."""
    from raypipe.planning.cluster_spec import load_cluster
    from raypipe.planning.configuration_search import search_plans

    if args.gpus is None or args.gpus < 1:
        raise ValueError(f"--cluster needs --gpus N >= 1 (the run's GPUs: replicas x stages), got {args.gpus}")
    if args.global_batch is not None and args.global_batch < 1:
        raise ValueError(f"--global-batch must be >= 1 sequences, got {args.global_batch}")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    mtbf = getattr(args, "node_mtbf_hours", None)
    if mtbf is not None and not 0 < mtbf < float("inf"):
        raise ValueError(f"--node-mtbf-hours must be a number of hours > 0, got {mtbf}")
    slow_share, slow_factor = getattr(args, "slow_node_share", None), getattr(args, "slow_node_factor", 2.0)
    if slow_share is not None and mtbf is None:
        raise ValueError("--slow-node-share adds rows to the goodput table: it needs --node-mtbf-hours")
    if slow_share is not None and not 0 <= slow_share <= 1:
        raise ValueError(f"--slow-node-share must be a share of nodes in [0, 1], got {slow_share}")
    if not 1 <= slow_factor < float("inf"):
        raise ValueError(f"--slow-node-factor must be a factor >= 1, got {slow_factor}")
    cluster = load_cluster(args.cluster)
    config = get_config(args.model)
    precision = args.precision or "bf16"
    seq_len = args.seq_len or config.max_seq_len
    if seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the max_seq_len of {args.model} ({config.max_seq_len})")
    memory = args.gpu_memory if args.gpu_memory is not None else cluster.memory_bytes
    result = search_plans(config, cluster, args.gpus, seq_len=seq_len, precision=precision, gpu_memory_bytes=memory,
                          global_batch=args.global_batch, top=args.top, fused_attention=args.fused_attention,
                          tensor_parallel=getattr(args, "tensor_parallel", None),
                          sequence_parallel=getattr(args, "sequence_parallel", None))
    out = {"model": args.model, "cluster": cluster.name, "cluster_source": cluster.source, "gpus": args.gpus,
           "gpu_memory_bytes": memory, "fits": bool(result.best), "reason": result.reason,
           "configurations_checked": result.evaluated, "configurations_simulated": result.simulated,
           "candidates": [{**candidate.to_dict(), **run_commands(args.model, candidate)}
                          for candidate in result.best]}
    if not result.best:
        return out
    best = result.best[0]
    out.update(chosen_plan_fields(config, args.model, best, memory, args.fused_attention))
    out.update(fits=True, step_time_s=best.prediction.step_s, tokens_per_second=best.prediction.tokens_per_s,
               mfu=best.prediction.mfu, bubble_fraction=best.prediction.bubble_fraction)
    if best.shape.snapshot_every:
        out["snapshot_keeper"] = keeper_plan(run_shape(config, best, cluster))
    if mtbf is not None:  # each configuration's goodput per recovery method; the best one's at the top
        for item, candidate in zip(out["candidates"], result.best):
            item["goodput"] = candidate_goodput(config, candidate, cluster, mtbf)
            if slow_share is not None:
                item["straggler_goodput"] = candidate_straggler_goodput(config, candidate, cluster, slow_share,
                                                                        slow_factor)
        out["goodput"] = {method: value["goodput"] for method, value in out["candidates"][0]["goodput"].items()}
        out["goodput_model"] = goodput_summary(args.gpus, cluster, mtbf)
        if slow_share is not None:
            out["goodput_model"]["straggler"] = {"slow_node_share": slow_share, "slow_node_factor": slow_factor}
    return out


def chosen_plan_fields(config: LlamaConfig, model: str, candidate, gpu_memory_bytes: int,
                       fused_attention: bool = True) -> dict:
    """Today's ``raypipe plan`` fields (settings, stages, balances, ...) for the configuration
    the search chose, its stages split as it chose."""
    from raypipe.planning.configuration_search import LlamaStageBytes, worker_bytes

    shape = candidate.shape
    settings = PlanSettings(
        num_stages=shape.num_stages, num_micro_batches=shape.num_micro_batches,
        micro_batch_size=shape.micro_batch_size, seq_len=shape.seq_len, precision=shape.precision,
        activation_checkpoint=shape.activation_checkpoint, activation_checkpoint_segments=None,
        offload_activations=False, fused_attention=fused_attention, schedule=shape.schedule, amp=None,
        optimizer_shards=shape.num_replicas if shape.shard_optimizer else 1, virtual_stages=shape.virtual_stages,
        tensor_parallel=shape.tensor_parallel, sequence_parallel=shape.sequence_parallel)
    chosen = list(candidate.prediction.balance)
    stages = settings.estimate(config, gpu_memory_bytes, balance=chosen)
    amp = amp_style(settings.precision, settings.amp)
    per_parameter = static_bytes_per_parameter(settings.precision, amp)
    rows = stage_rows(config, stages)
    # the chosen split against the parameter balance, as compare_balances reports them (from the
    # search's stage memory: the memory model's figures, without its per-stage schedule rebuilds)
    costs = llama_layer_costs(config, settings.seq_len, settings.precision, fused_attention)
    times = [settings.micro_batch_size * layer_step_flops(cost, settings.activation_checkpoint,
                                                          settings.num_micro_batches) for cost in costs]
    bytes_of = LlamaStageBytes(config, shape, fused_attention)
    balances = {}
    # per worker (its chunks together, with several); the splits are per virtual stage
    for name, split in (("parameters", balanced_partition(config, shape.num_virtual_stages)), ("time", chosen)):
        flops = worker_sums(stage_times(times, split), shape)
        totals = worker_bytes(bytes_of, shape, split)
        balances[name] = {"balance": split, "stage_flops": flops, "max_stage_flops": max(flops),
                          "stage_total_bytes": totals, "max_total_bytes": max(totals),
                          "fits": max(totals) <= gpu_memory_bytes}
    balances["time"]["memory_limited"] = True  # the search's split fits (--balance time's, or the DP's within memory)
    return {"model": model, "num_parameters": sum(layer_parameter_counts(config)),
            "num_replicas": shape.num_replicas, "elastic": None, "settings": settings.to_dict(amp),
            "bytes_per_parameter": {**vars(per_parameter), "total": per_parameter.total},
            "max_total_bytes": largest_stage_bytes(stages), "stages": rows, "suggestions": [], "balances": balances}


def run_commands(model: str, candidate) -> dict:
    """The job command (jobs/train_7b.py) and Helm values that run ``candidate``."""
    shape = candidate.shape
    balance = "time" if candidate.balance_mode == "time" else ",".join(map(str, candidate.prediction.balance))
    flags = [f"--stages {shape.num_stages}", f"--replicas {shape.num_replicas}",
             f"--micro-batches {shape.num_micro_batches}", f"--micro-batch-size {shape.micro_batch_size}",
             f"--seq-len {shape.seq_len}", f"--precision {shape.precision}",
             f"--activation-checkpoint {shape.activation_checkpoint}", f"--balance {balance}"]
    if shape.shard_optimizer:
        flags.append("--shard-optimizer")
    if shape.schedule != "gpipe":
        flags.append(f"--schedule {shape.schedule}")
    if shape.virtual_stages != 1:  # model chunks per worker (interleaved_1f1b, zbv), given though it is their own
        flags.append(f"--virtual-stages {shape.virtual_stages}")
    if shape.tensor_parallel != 1:
        flags.append(f"--tensor-parallel {shape.tensor_parallel}")
        if not shape.sequence_sharded:
            flags.append("--no-sequence-parallel")
    if shape.snapshot_every != 1:  # the jobs' default is 1
        flags.append(f"--snapshot-every {shape.snapshot_every}")
    extra = [f"--precision {shape.precision}"] if shape.precision != "bf16" else []
    if shape.activation_checkpoint != "always":
        extra.append(f"--activation-checkpoint {shape.activation_checkpoint}")
    if model != "llama-7b":  # the job's 7b preset is llama-7b's shape; another model comes from its checkpoint
        flags.append("--init-from HF_CHECKPOINT_DIR")
        extra.append("--init-from HF_CHECKPOINT_DIR")
    helm = {"stages": shape.num_stages, "replicas": shape.num_replicas, "microBatches": shape.num_micro_batches,
            "microBatchSize": shape.micro_batch_size, "seqLen": shape.seq_len,
            "balance": "time" if candidate.balance_mode == "time" else list(candidate.prediction.balance),
            "shardOptimizer": shape.shard_optimizer}
    if shape.schedule != "gpipe":
        helm["schedule"] = shape.schedule
    if shape.virtual_stages != 1:
        helm["virtualStages"] = shape.virtual_stages
    if shape.tensor_parallel != 1:
        helm["tensorParallel"] = shape.tensor_parallel
        if not shape.sequence_sharded:
            helm["sequenceParallel"] = False
    if shape.snapshot_every != 1:
        helm["snapshotEvery"] = shape.snapshot_every
    if extra:
        helm["extraArgs"] = [part for flag in extra for part in flag.split(" ", 1)]
    return {"job_command": "python jobs/train_7b.py " + " ".join(flags), "helm_values": {"training": helm}}


def _tensor_parallel(item: dict) -> str:
    """A candidate's tensor parallelism in the table: nothing at t = 1."""
    if item["tensor_parallel"] == 1:
        return ""
    return f" t={item['tensor_parallel']}" + ("" if item["sequence_parallel"] else " (no sequence parallel)")


def _cadence(snapshot_every: int) -> str:
    if snapshot_every == 0:
        return "; no snapshots (--snapshot-every 0): a failure rolls back to the newest checkpoint"
    return (f" a step: one snapshot every {snapshot_every} steps, so a heal redoes up to {snapshot_every - 1}; "
            "every step would cost more than 3%")


def render_cluster_plan(plan: dict) -> str:
    """``raypipe plan --cluster`` as text: the best configurations, then the best one's stages."""
    lines = [f"{plan['model']} on {plan['gpus']} x {plan['cluster']} ({format_bytes(plan['gpu_memory_bytes'])} per "
             f"GPU): {plan['configurations_checked']} configurations checked, {plan['configurations_simulated']} "
             "simulated"]
    if not plan["fits"]:
        lines.append(f"NOT POSSIBLE: {plan['reason']}")
        return "\n".join(lines)
    lines.append("best predicted (d replicas x p stages" + (" x t GPUs a stage" if any(
        item["tensor_parallel"] > 1 for item in plan["candidates"]) else "") + ", m micro-batches of b sequences):")
    for rank, item in enumerate(plan["candidates"], 1):
        lines.append(
            f"  {rank}. d={item['num_replicas']} p={item['num_stages']} m={item['num_micro_batches']} "
            f"b={item['micro_batch_size']} {item['schedule']}"
            f"{'' if item['virtual_stages'] == 1 else ' v=' + str(item['virtual_stages'])}"
            f"{_tensor_parallel(item)} "
            f"recompute={item['activation_checkpoint']} "
            f"zero1={'on' if item['shard_optimizer'] else 'off'}: step {item['step_time_s']:.3g} s, "
            f"{item['tokens_per_second']:,.0f} tokens/s, MFU {item['mfu']:.1%}, bubble {item['bubble_fraction']:.1%} "
            f"(pipeline {item['pipeline_s']:.3g} s + reduction {item['reduction_exposed_s']:.3g} s + optimizer "
            f"{item['optimizer_s']:.3g} s + snapshot {item['snapshot_exposed_s']:.3g} s"
            f"{'' if item['snapshot_every'] == 1 else _cadence(item['snapshot_every'])}), "
            f"{item['tokens_per_step']:,} tokens/step, largest stage {format_bytes(max(item['stage_bytes']))}")
        lines.append(f"     {item['job_command']}")
    best = plan["candidates"][0]
    lines.append("helm values of 1.: " + json.dumps(best["helm_values"]))
    if "snapshot_keeper" in plan:
        lines.append(describe_keeper(plan["snapshot_keeper"], best["snapshot_every"]))
    lines.append(f"1.'s stages (balance {best['balance']}"
                 + (f"; each row one of its {best['tensor_parallel']} tensor-parallel ranks"
                    if best["tensor_parallel"] > 1 else "") + "):")
    for row in plan["stages"]:
        lines.append(f"  stage {row['stage']}: {row['description']}, {row['num_parameters'] / 1e6:,.0f}M parameters, "
                     f"{format_bytes(row['total_bytes'])}")
    lines.extend(describe_balances(plan["balances"]))
    if "goodput" in plan:
        lines.extend(describe_goodput(plan))
    lines.append("(predicted: see raypipe/planning/predict.py for what the model counts and leaves out; "
                 f"cluster figures: {plan['cluster_source'][:120]}...)")
    return "\n".join(lines)


def describe_keeper(keeper: dict, snapshot_every: int) -> str:
    """The plan's line on the snapshot keeper of the configuration chosen (:func:`keeper_plan`)."""
    held = format_bytes(keeper["held_bytes"])
    line = (f"1.'s snapshot keeper (on the driver's node: the chart's head pod, whose object store is its "
            f"head.shmSize, spilling to its disk beyond): {KEEPER_HELD_SNAPSHOTS} snapshots of every worker, "
            f"{held} ({format_bytes(keeper['state_bytes'])} each, a third while one is copied), each copied in "
            f"{keeper['copy_s']:.3g} s")
    if keeper["min_snapshot_every"] > snapshot_every:
        return (line + f": a new snapshot waits for it, so snapshots are at least {keeper['min_snapshot_every']} steps "
                f"apart, not {snapshot_every}, and a lost node redoes up to {keeper['min_snapshot_every'] - 1} steps")
    return line + " (within the steps between two snapshots)"


# -- --cluster --node-mtbf-hours: goodput per recovery method --------------------------

METHOD_LABELS = {
    "raypipe_warm_spare": "raypipe, warm spares (stage replaced, step redone)",
    "raypipe": "raypipe, no spare (replacement started, step redone)",
    "checkpoint_restart": "full restart from a checkpoint (Young's interval)",
    "replica_drop": "drop the failed replica's step (torchft-style)",
}


def run_shape(config: LlamaConfig, candidate, cluster: Cluster) -> RunShape:
    """A searched configuration as :class:`~raypipe.planning.goodput.RunShape`: its step, and the
    state (weights + optimizer) of its largest worker and of one copy of the model."""
    shape, prediction = candidate.shape, candidate.prediction
    counts = layer_parameter_counts(config)
    per = static_bytes_per_parameter(shape.precision, shape.amp)
    shards = shape.num_replicas if shape.shard_optimizer else 1
    # per worker: its chunks' parameters together (the balance is per virtual stage with several)
    stage_params = worker_sums([sum(counts[start:end]) for start, end in stage_bounds(prediction.balance)], shape)
    # one tensor-parallel rank's (a replacement's t ranks receive their state in parallel, each on its own link)
    rank_counts = layer_parameter_counts(config, tensor_parallel=shape.tensor_parallel)
    rank_params = worker_sums([sum(rank_counts[start:end]) for start, end in stage_bounds(prediction.balance)],
                              shape)

    def worker_state(params: int) -> float:  # what a snapshot of the worker holds (snapshot_bytes)
        if not per.master:
            return params * (per.weights + per.optimizer / shards)
        return params * ((per.master + per.optimizer) / shards + per.weights * (1 - 1 / shards))

    full = per.master + per.optimizer if per.master else per.weights + per.optimizer
    # the snapshot keeper (runtime/snapshot_keeper.py) copies every worker's snapshot (each replica's, each
    # tensor-parallel rank's) onto the driver's node: fetched through that node's one link and stored by one
    # thread into its object store. The plan assumes the Helm chart's layout, the driver on a head node that
    # holds no stage, so every worker is off its node
    keeper_state = shape.num_replicas * shape.tensor_parallel * sum(worker_state(params) for params in rank_params)
    keeper_copy_s = (keeper_state / cluster.inter_node.bandwidth_bytes_per_s
                     + keeper_state / cluster.object_store_bytes_per_s)
    # the goodput model picks its own cadence from what one snapshot costs, taken as fixed: its cost with a
    # snapshot every step (the prediction's is at the candidate's cadence, where the steps between may hide
    # the whole store), which a longer cadence only lowers: an upper bound, never an optimistic one
    per_snapshot = prediction.snapshot_exposed_at(1)
    # in stage slots (a stage's t GPUs, on one node: GPUs at t = 1), as candidate_goodput's node size counts them
    return RunShape(num_gpus=shape.num_replicas * shape.num_stages, num_replicas=shape.num_replicas,
                    num_stages=shape.num_stages,
                    step_s=prediction.step_s - prediction.snapshot_exposed_s + per_snapshot,
                    snapshot_exposed_s=per_snapshot,
                    largest_worker_state_bytes=max(worker_state(params) for params in rank_params),
                    model_state_bytes=sum(stage_params) * full,
                    inter_node_bytes_per_s=cluster.inter_node.bandwidth_bytes_per_s,
                    shard_optimizer=shape.shard_optimizer, keeper_state_bytes=keeper_state,
                    keeper_copy_s=keeper_copy_s)


KEEPER_HELD_SNAPSHOTS = 2
"""The snapshots the keeper holds (``KEPT_SNAPSHOTS`` of ``runtime/snapshot_keeper.py``; not imported from
there: the planner stays free of Ray, and a test checks that the two agree)."""


def keeper_plan(run: RunShape) -> dict:
    """The plan's ``snapshot_keeper`` fields for a configuration (its :func:`run_shape`): one snapshot of
    every worker, which the keeper copies onto the driver's node (``state_bytes``), the two that node holds
    (``held_bytes``; a third arrives while one is copied), one copy's seconds (``copy_s``), and the fewest
    steps between two snapshots that it allows (``min_snapshot_every``:
    :func:`~raypipe.planning.goodput.keeper_snapshot_every`)."""
    return {"state_bytes": run.keeper_state_bytes, "held_bytes": KEEPER_HELD_SNAPSHOTS * run.keeper_state_bytes,
            "copy_s": run.keeper_copy_s, "min_snapshot_every": keeper_snapshot_every(run)}


def candidate_goodput(config: LlamaConfig, candidate, cluster: Cluster, node_mtbf_hours: float) -> dict:
    """``{method: {goodput, closed_form, downtime_per_failure_s, ...}}`` for one configuration (at
    t > 1 counted in stage slots of t GPUs, ``gpus_per_node / t`` a node: the same nodes fail)."""
    assumptions = GoodputAssumptions(node_mtbf_hours=node_mtbf_hours,
                                     gpus_per_node=cluster.slots_per_node(candidate.shape.tensor_parallel))
    results = goodput_by_method(run_shape(config, candidate, cluster), assumptions)
    return {method: results[method].to_dict() for method in METHODS}


def candidate_straggler_goodput(config: LlamaConfig, candidate, cluster: Cluster, slow_share: float,
                                slow_factor: float) -> dict[str, float]:
    """``{policy: goodput}`` of one configuration with a persistent straggler
    (:func:`~raypipe.planning.goodput.straggler_goodput`, nodes counted as :func:`candidate_goodput` does)."""
    assumptions = GoodputAssumptions(gpus_per_node=cluster.slots_per_node(candidate.shape.tensor_parallel))
    shape = candidate.shape  # raypipe rebalances one chunk of whole layers a worker (config.py refuses the rest)
    return straggler_goodput(run_shape(config, candidate, cluster), assumptions, slow_share, slow_factor,
                             can_rebalance=shape.virtual_stages == 1)


def goodput_summary(num_gpus: int, cluster: Cluster, node_mtbf_hours: float) -> dict:
    """The plan's top-level goodput fields: the failure model and its assumptions."""
    assumptions = GoodputAssumptions(node_mtbf_hours=node_mtbf_hours, gpus_per_node=cluster.gpus_per_node)
    return {"node_mtbf_hours": node_mtbf_hours,
            "job_mttf_hours": job_mttf_hours(num_gpus, node_mtbf_hours, cluster.gpus_per_node),
            "assumptions": vars(assumptions)}


def describe_goodput(plan: dict) -> list[str]:
    """The goodput table of ``raypipe plan --cluster ... --node-mtbf-hours H``."""
    summary = plan["goodput_model"]
    lines = [f"goodput with node MTBF {summary['node_mtbf_hours']:,.0f} h (job MTTF "
             f"{summary['job_mttf_hours']:.3g} h on {plan['gpus']} GPUs; simulated, closed form in brackets):"]
    width = max(map(len, METHOD_LABELS.values()))
    lines.append("  " + "configuration".ljust(width) + "".join(
        f"{rank}.".rjust(20) for rank in range(1, len(plan["candidates"]) + 1)))
    for method in METHODS:
        cells = []
        for item in plan["candidates"]:
            result = item["goodput"][method]
            cells.append("n/a".rjust(20) if result["goodput"] is None else
                         f"{result['goodput']:.2%} [{result['closed_form']:.2%}]".rjust(20))
        lines.append("  " + METHOD_LABELS[method].ljust(width) + "".join(cells))
    straggler = summary.get("straggler")
    if straggler is not None:  # a persistent straggler: the share of the unslowed pace, over a day
        for policy in STRAGGLER_POLICIES:
            label = (f"{straggler['slow_node_share']:.3g} of nodes {straggler['slow_node_factor']:g}x slow, "
                     f"on_slow={policy}")
            lines.append("  " + label.ljust(width) + "".join(  # None: not at t > 1, nor with model chunks
                ("n/a (model chunks)" if item["straggler_goodput"][policy] is None
                 else f"{item['straggler_goodput'][policy]:.2%}").rjust(20) for item in plan["candidates"]))
    best = plan["candidates"][0]["goodput"]
    lines.append("  1.: " + "; ".join(f"{method} {best[method]['note']}" for method in METHODS if best[method]["note"]))
    lines.append("  (raypipe's seconds from bench_recovery on CPU; a checkpoint's relaunch 5 min assumed: see "
                 "raypipe/planning/goodput.py)")
    return lines


# -- the command -----------------------------------------------------------------------

def build_published_plan(args: argparse.Namespace) -> dict:
    """``raypipe plan --published``: each published run's prediction at its own layout
    (:func:`raypipe.planning.published_layouts.predict_published`) on ``--cluster`` (default h100)."""
    from raypipe.planning.cluster_spec import load_cluster
    from raypipe.planning.published_layouts import PUBLISHED_CLUSTER, TOLERANCE, predict_published

    given = [flag for flag, value in (("--gpus", args.gpus), ("--global-batch", args.global_batch),
                                      ("--node-mtbf-hours", getattr(args, "node_mtbf_hours", None)))
             if value is not None]
    if given:
        raise ValueError(f"--published predicts the published runs' own layouts: it takes no {', '.join(given)}")
    cluster = load_cluster(args.cluster or PUBLISHED_CLUSTER)
    return {"published_on": cluster.name, "tolerance": TOLERANCE,
            "rows": [item.to_dict() for item in predict_published(cluster)]}


def run_plan(args: argparse.Namespace) -> int:
    """Entry point of ``raypipe plan``; returns the exit status."""
    try:
        if getattr(args, "published", False):
            plan = build_published_plan(args)
        elif getattr(args, "cluster", None) is not None:
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
    elif "published_on" in plan:
        from raypipe.planning.published_layouts import render_published_plan

        print(render_published_plan(plan))
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
