"""Which device a stage worker computes on: the GPU Ray assigned it, as torch numbers it."""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch


def local_cuda_index(gpu_ids: Sequence[int | str], visible_devices: str | None) -> int | None:
    """The torch (local) CUDA index of the first GPU Ray assigned to this process.

    ``gpu_ids`` is ``ray.get_gpu_ids()``: physical ids (or UUIDs, when the node's
    ``CUDA_VISIBLE_DEVICES`` named them so), and ``visible_devices`` this process's
    ``CUDA_VISIBLE_DEVICES``. Torch numbers the visible devices 0..n-1 in that list's
    order, so the index is the id's position in it: 0 where Ray narrowed the list to the
    actor's own GPU, the id's place in a wider list where Ray was told not to set it
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``). With the variable unset, every GPU
    is visible and the id is the index. None: Ray assigned no GPU (not a Ray actor, or one
    without ``num_gpus``): the caller keeps torch's current device.
    """
    if not gpu_ids:
        return None
    first = str(gpu_ids[0]).strip()
    if visible_devices is None:
        if not first.isdigit():
            raise RuntimeError(f"Ray assigned GPU {first!r}, which is not an index, and CUDA_VISIBLE_DEVICES is "
                               "unset: cannot tell which local CUDA device it is")
        return int(first)
    visible = [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
    if first not in visible:
        raise RuntimeError(f"Ray assigned GPU {first!r}, which is not among CUDA_VISIBLE_DEVICES="
                           f"{visible_devices!r}: this process cannot see the GPU it was given")
    return visible.index(first)


def stage_device(use_gpu: bool) -> torch.device:
    """The device a stage worker computes on, made torch's current CUDA device.

    On GPU: the one Ray assigned this actor (``ray.get_gpu_ids()``), so that NCCL, the
    CUDA caching allocator and kernels launched without a device all use the GPU Ray
    accounts for, whatever ``CUDA_VISIBLE_DEVICES`` the node set.
    """
    if not use_gpu:
        return torch.device("cpu")
    index = local_cuda_index(_ray_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if index is None:
        index = torch.cuda.current_device()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _ray_gpu_ids() -> list[int | str]:
    """``ray.get_gpu_ids()`` inside a Ray actor; nothing elsewhere (a worker built in the
    driver's process, as the tests and the GPU probes do, keeps torch's current device)."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return []
    return list(ray.get_gpu_ids())


def warm_up_spare_process() -> None:
    """What a warm spare does before it is needed, so a heal does not: the CUDA context of the
    GPU Ray gave it (if any), and the imports a first build makes lazily (torch's optimizers
    import dynamo, and it sympy: ~2 s on a CPU box)."""
    import importlib

    device = stage_device(torch.cuda.is_available())
    if device.type == "cuda":
        torch.empty(1, device=device)
    importlib.import_module("torch._dynamo")


def where_it_runs(device: torch.device) -> dict:
    """The device a worker computes on (name, memory) and where it runs (node, process, actor)."""
    import ray

    context = ray.get_runtime_context()
    cuda = device.type == "cuda"
    return {"device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
            "node_id": context.get_node_id(), "pid": os.getpid(), "actor_id": context.get_actor_id()}
