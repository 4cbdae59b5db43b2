"""Connecting to Ray, reserving a placement group, creating the stage actors."""
from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypipe.config import PipelineConfig
from raypipe.errors import PlacementError


def connect(address: str | None) -> None:
    """Use the connected cluster; else ``address`` / RAY_ADDRESS; else start a local one."""
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level="WARNING")


def resolve_use_gpu(config: PipelineConfig) -> bool:
    """``use_gpu=None`` means: a GPU per stage when the cluster has GPUs."""
    if config.use_gpu is not None:
        return bool(config.use_gpu)
    return ray.cluster_resources().get("GPU", 0) > 0


def stage_bundle(config: PipelineConfig) -> dict[str, float]:
    bundle = {"CPU": float(config.cpus_per_stage)}
    if config.use_gpu:
        bundle["GPU"] = 1.0
    return bundle


def reserve_stages(config: PipelineConfig) -> Any:
    """A PACK placement group with one bundle per stage, or a clear PlacementError
    after ``placement_timeout_s`` naming what was asked and what the cluster has."""
    bundles = [stage_bundle(config) for _ in range(config.num_stages)]
    group = placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=config.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"could not place {config.num_stages} stage(s) of {bundles[0]} each (PACK) within "
            f"{config.placement_timeout_s:g}s: the cluster has {_resources(ray.cluster_resources())} in total, "
            f"{_resources(ray.available_resources())} available. Lower num_stages/cpus_per_stage, "
            f"add nodes, or raise placement_timeout_s while the autoscaler adds them.") from None
    return group


def create_actors(actor_class: Any, group: Any, config: PipelineConfig, stage_args: list[tuple]) -> list[Any]:
    """One actor per stage, each pinned to its bundle of the placement group."""
    actors = []
    for index, args in enumerate(stage_args):
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        options = {"num_cpus": config.cpus_per_stage, "num_gpus": 1 if config.use_gpu else 0,
                   "scheduling_strategy": strategy, "max_restarts": 0}
        actors.append(actor_class.options(**options).remote(*args))
    return actors


def release(actors: list[Any], group: Any) -> None:
    """Kill the actors and remove the placement group (idempotent)."""
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already dead is fine
            pass
    if group is not None:
        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 - already removed is fine
            pass


def _resources(resources: dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items() if k in ("CPU", "GPU", "memory")}
    if "memory" in keep:
        keep["memory"] = f"{keep['memory'] / 2**30:.1f}GiB"
    return str(keep)
