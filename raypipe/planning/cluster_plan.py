"""``raypipe plan --cluster``: predicted step time on a described cluster — the best
configurations, the job command line and Helm values that run them, the best one's stages."""
from __future__ import annotations

import argparse
import json

from raypipe.models.llama import LlamaConfig, get_config
from raypipe.models.llama_costs import llama_layer_costs
from raypipe.planning.balance import layer_step_flops, stage_times
from raypipe.planning.memory import amp_style, balanced_partition, static_bytes_per_parameter
from raypipe.planning.plan_balances import describe_balances
from raypipe.planning.plan_settings import PlanSettings, largest_stage_bytes
from raypipe.planning.predict import worker_sums
from raypipe.planning.stage_rows import stage_rows
from raypipe.units import format_bytes


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
    cluster = load_cluster(args.cluster)
    config = get_config(args.model)
    precision = args.precision or "bf16"
    seq_len = args.seq_len or config.max_seq_len
    if seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the max_seq_len of {args.model} ({config.max_seq_len})")
    memory = args.gpu_memory if args.gpu_memory is not None else cluster.memory_bytes
    result = search_plans(config, cluster, args.gpus, seq_len=seq_len, precision=precision, gpu_memory_bytes=memory,
                          global_batch=args.global_batch, top=args.top, fused_attention=args.fused_attention)
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
    if mtbf is not None:  # each configuration's goodput per recovery method; the best one's at the top
        from raypipe.planning.plan_goodput import candidate_goodput, goodput_summary

        for item, candidate in zip(out["candidates"], result.best):
            item["goodput"] = candidate_goodput(config, candidate, cluster, mtbf)
        out["goodput"] = {method: value["goodput"] for method, value in out["candidates"][0]["goodput"].items()}
        out["goodput_model"] = goodput_summary(args.gpus, cluster, mtbf)
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
        optimizer_shards=shape.num_replicas if shape.shard_optimizer else 1, virtual_stages=shape.virtual_stages)
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
    return {"model": model, "num_parameters": sum(stage.num_parameters for stage in stages),
            "num_replicas": shape.num_replicas, "elastic": None, "settings": {**vars(settings), "amp": amp},
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
    if shape.virtual_stages != 1:  # model chunks per worker (interleaved_1f1b, zbv); the jobs' default is 1
        flags.append(f"--virtual-stages {shape.virtual_stages}")
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
    if shape.snapshot_every != 1:
        helm["snapshotEvery"] = shape.snapshot_every
    if extra:
        helm["extraArgs"] = [part for flag in extra for part in flag.split(" ", 1)]
    return {"job_command": "python jobs/train_7b.py " + " ".join(flags), "helm_values": {"training": helm}}


def _cadence(snapshot_every: int) -> str:
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
    lines.append("best predicted (d replicas x p stages, m micro-batches of b sequences):")
    for rank, item in enumerate(plan["candidates"], 1):
        lines.append(
            f"  {rank}. d={item['num_replicas']} p={item['num_stages']} m={item['num_micro_batches']} "
            f"b={item['micro_batch_size']} {item['schedule']}"
            f"{'' if item['virtual_stages'] == 1 else ' v=' + str(item['virtual_stages'])} "
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
    lines.append(f"1.'s stages (balance {best['balance']}):")
    for row in plan["stages"]:
        lines.append(f"  stage {row['stage']}: {row['description']}, {row['num_parameters'] / 1e6:,.0f}M parameters, "
                     f"{format_bytes(row['total_bytes'])}")
    lines.extend(describe_balances(plan["balances"]))
    if "goodput" in plan:
        from raypipe.planning.plan_goodput import describe_goodput

        lines.extend(describe_goodput(plan))
    lines.append("(predicted: see raypipe/planning/predict.py for what the model counts and leaves out; "
                 f"cluster figures: {plan['cluster_source'][:120]}...)")
    return "\n".join(lines)
