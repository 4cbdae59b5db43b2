"""Connecting to Ray and reserving placement groups."""
from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

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


def worker_bundle(config: PipelineConfig, use_gpu: bool) -> dict[str, float]:
    """The resources of one stage worker."""
    bundle = {"CPU": float(config.cpus_per_stage)}
    if use_gpu:
        bundle["GPU"] = 1.0
    return bundle


def reserve(bundles: list[dict[str, float]], timeout_s: float) -> Any:
    """A PACK placement group of ``bundles``, or a clear PlacementError after
    ``timeout_s`` naming what was asked and what the cluster has."""
    group = placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise PlacementError(
            f"could not place {len(bundles)} stage(s) of {bundles[0]} each (PACK) within "
            f"{timeout_s:g}s: the cluster has {_resources(ray.cluster_resources())} in total, "
            f"{_resources(ray.available_resources())} available. Lower num_stages/cpus_per_stage, "
            f"add nodes, or raise placement_timeout_s while the autoscaler adds them.") from None
    return group


def release(group: Any) -> None:
    """Remove the placement group (idempotent)."""
    if group is None:
        return
    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001 - already removed is fine
        pass


def _resources(resources: dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items() if k in ("CPU", "GPU", "memory")}
    if "memory" in keep:
        keep["memory"] = f"{keep['memory'] / 2**30:.1f}GiB"
    return str(keep)
