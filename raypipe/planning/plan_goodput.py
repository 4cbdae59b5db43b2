"""``raypipe plan --cluster ... --node-mtbf-hours H``: each configuration's goodput per recovery
method (:mod:`raypipe.planning.goodput`), from its predicted step and its stages' state."""
from __future__ import annotations

from raypipe.models.llama import LlamaConfig
from raypipe.models.llama_memory import layer_parameter_counts, static_bytes_per_parameter
from raypipe.planning.cluster_spec import Cluster
from raypipe.planning.goodput import (METHODS, GoodputAssumptions, RunShape, goodput_by_method, job_mttf_hours)
from raypipe.planning.predict import stage_bounds, worker_sums

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

    def worker_state(params: int) -> float:  # what a snapshot of the worker holds (stage_rows.snapshot_bytes)
        if not per.master:
            return params * (per.weights + per.optimizer / shards)
        return params * ((per.master + per.optimizer) / shards + per.weights * (1 - 1 / shards))

    full = per.master + per.optimizer if per.master else per.weights + per.optimizer
    # the goodput model picks its own cadence from a snapshot's whole exposed copy (the prediction's is
    # spread over the candidate's snapshot_every steps)
    per_snapshot = prediction.snapshot_exposed_s * max(1, shape.snapshot_every)
    return RunShape(num_gpus=shape.num_gpus, num_replicas=shape.num_replicas, num_stages=shape.num_stages,
                    step_s=prediction.step_s - prediction.snapshot_exposed_s + per_snapshot,
                    snapshot_exposed_s=per_snapshot,
                    largest_worker_state_bytes=max(worker_state(params) for params in stage_params),
                    model_state_bytes=sum(stage_params) * full,
                    inter_node_bytes_per_s=cluster.inter_node.bandwidth_bytes_per_s,
                    shard_optimizer=shape.shard_optimizer)


def candidate_goodput(config: LlamaConfig, candidate, cluster: Cluster, node_mtbf_hours: float) -> dict:
    """``{method: {goodput, closed_form, downtime_per_failure_s, ...}}`` for one configuration."""
    assumptions = GoodputAssumptions(node_mtbf_hours=node_mtbf_hours, gpus_per_node=cluster.gpus_per_node)
    results = goodput_by_method(run_shape(config, candidate, cluster), assumptions)
    return {method: results[method].to_dict() for method in METHODS}


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
    best = plan["candidates"][0]["goodput"]
    lines.append("  1.: " + "; ".join(f"{method} {best[method]['note']}" for method in METHODS if best[method]["note"]))
    lines.append("  (raypipe's seconds from bench_recovery on CPU; a checkpoint's relaunch 5 min assumed: see "
                 "raypipe/planning/goodput.py)")
    return lines
