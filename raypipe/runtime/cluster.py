"""Connecting to Ray and reserving placement groups."""
from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray._private.state import available_resources_per_node  # DeveloperAPI: ray.available_resources() per node
from ray.util.placement_group import remove_placement_group

from raypipe.config import PipelineConfig
from raypipe.errors import PlacementError
from raypipe.runtime.spread import reserve_spread

# A raylet told to kill a worker sends it SIGTERM and waits this long for it to exit before SIGKILL
# (Ray's kill_worker_timeout_milliseconds, 5000 by default). raypipe kills a stage worker when it
# hung (a stopped process, or one wedged in a collective): it never exits on its own, and its
# neighbours' receives from it end only once it is gone, so the wait adds to every such heal. The
# local instance raypipe starts, the Helm chart (workerKillGraceMs) and clusters/*.yaml set 1 s.
WORKER_KILL_GRACE_MS = 1000
LOCAL_SYSTEM_CONFIG = {"kill_worker_timeout_milliseconds": WORKER_KILL_GRACE_MS}


def connect(address: str | None, num_workers_cpus: float = 0) -> None:
    """Use the connected cluster; else ``address`` / RAY_ADDRESS; else start a local one.

    A local instance started here gets at least ``num_workers_cpus`` logical
    CPUs, more than the machine's cores if need be: on a laptop or a CI box a CPU
    run of more workers than cores shares them instead of never being placed.
    """
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS")
    if target in (None, "", "local"):
        # "local", not None: None would join whatever cluster this machine last started (Ray's
        # address file), which refuses num_cpus; RAY_ADDRESS=auto asks for that one
        ray.init(address="local", include_dashboard=False, logging_level="WARNING",
                 num_cpus=max(os.cpu_count() or 1, math.ceil(num_workers_cpus)), _system_config=LOCAL_SYSTEM_CONFIG)
    else:
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


def stage_bundle(worker: dict[str, float], tensor_parallel: int) -> dict[str, float]:
    """The bundle of one stage: its ``tensor_parallel`` workers' resources together, so that
    Ray places them on one node (a bundle never spans nodes) and the stage's tensor-parallel
    collectives stay on that node's interconnect. Each worker still asks for its own share."""
    return {name: amount * tensor_parallel for name, amount in worker.items()}


def reserve(num_pipelines: int, bundles: list[dict[str, float]], timeout_s: float) -> list[Any]:
    """One PACK placement group of ``bundles`` per pipeline replica (spread over nodes), all placed within
    ``timeout_s``; or a clear PlacementError naming what was asked and what the cluster has."""
    placed, _ = reserve_between(num_pipelines, num_pipelines, bundles, timeout_s)
    return placed


def reserve_between(minimum: int, maximum: int, bundles: list[dict[str, float]], timeout_s: float,
                    grace_s: float = 2.0) -> tuple[list[Any], list[Any]]:
    """Placement groups of up to ``maximum`` replicas (one PACK group each, spread over
    nodes where there is room: :mod:`raypipe.runtime.spread`): waits up to ``timeout_s``
    for ``minimum`` to be placed, then ``grace_s`` for the rest. Returns (placed,
    pending): an elastic run's pending groups stay asked for, so Ray places them (and
    an autoscaler adds nodes for them) while the run goes on."""
    deadline = time.monotonic() + timeout_s
    groups = reserve_spread(maximum, bundles)
    waits = [group.ready() for group in groups]
    placed, _ = ray.wait(waits, num_returns=minimum, timeout=max(0.0, deadline - time.monotonic()))
    if len(placed) < minimum:
        release(groups)
        what, lower = ((f"{minimum} replica(s) (the elastic run's minimum)", "the minimum of num_replicas")
                       if minimum < maximum else (f"{minimum} replica(s)", "num_stages/num_replicas/cpus_per_stage"))
        raise PlacementError(
            f"could not place {what} of {len(bundles)} stage(s) of {bundles[0]} each (PACK per replica; a stage's "
            f"bundle on one node) within {timeout_s:g}s: the cluster has {_resources(ray.cluster_resources())} in "
            f"total, {_resources(ray.available_resources())} available, at most {_largest_node()} on one node. "
            f"Lower {lower} (or tensor_parallel), add nodes, or raise placement_timeout_s while the autoscaler "
            "adds them.")
    if len(placed) < maximum:
        placed, _ = ray.wait(waits, num_returns=maximum, timeout=grace_s)
    return ([group for group, ready in zip(groups, waits) if ready in placed],
            [group for group, ready in zip(groups, waits) if ready not in placed])


def placeable_workers(bundle: dict[str, float], freed_on: Sequence[str] = ()) -> int:
    """How many workers of ``bundle`` the live nodes have room for now, each within one
    node; ``freed_on``: the nodes of workers about to go, each freeing one ``bundle``."""
    count = 0
    for node, free in available_resources_per_node().items():
        freed = list(freed_on).count(node)
        # Ray counts resources in units of 1e-4: a sum of them is not exact in floating point
        count += min(math.floor((free.get(name, 0.0) + freed * amount) / amount + 1e-6)
                     for name, amount in bundle.items() if amount > 0)
    return count


def worker_memory_bytes(device_memory_bytes: int | None) -> float:
    """What one worker may hold: its device's memory on GPU, else the smallest Ray
    ``memory`` of a node with CPUs (the object store excluded)."""
    if device_memory_bytes:
        return float(device_memory_bytes)
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0]
    return min((resources.get("memory", 0.0) for resources in nodes), default=0.0)


def release(groups: list[Any]) -> None:
    """Remove the placement groups (idempotent)."""
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 - already removed is fine
            pass


def num_alive_nodes() -> int:
    """How many nodes the cluster has now."""
    return sum(1 for node in ray.nodes() if node["Alive"])


def describe_available() -> str:
    """What the cluster has available now, for error messages."""
    return _resources(ray.available_resources())


def _largest_node() -> str:
    """The CPUs and GPUs of the live node with the most GPUs (then CPUs), for error messages."""
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    largest = max(nodes, key=lambda resources: (resources.get("GPU", 0.0), resources.get("CPU", 0.0)), default={})
    return _resources({name: largest.get(name, 0.0) for name in ("CPU", "GPU") if name in largest})


def _resources(resources: dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items() if k in ("CPU", "GPU", "memory")}
    if "memory" in keep:
        keep["memory"] = f"{keep['memory'] / 2**30:.1f}GiB"
    return str(keep)
