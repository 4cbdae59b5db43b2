"""Run a function on ranks of a real gloo process group, one process each forked from the tests'
forkserver (tests/forked.py), and read back what each rank returned (the tensor-parallel tests'
harness: DTensor needs a process group per rank, so the ranks cannot be threads of the test process)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tests.forked import CONTEXT
from tests.ports import free_port


def _rank_main(rank: int, work: Callable[[DeviceMesh], Any], world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.save(work(init_device_mesh("cpu", (world_size,))), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def on_gloo_ranks(work: Callable[[DeviceMesh], Any], world_size: int, out_dir: Path) -> list[Any]:
    """``work(mesh)`` on each of ``world_size`` forked ranks (a module-level function: it is
    pickled into them); what each returned, rank 0 first."""
    mp.start_processes(_rank_main, args=(work, world_size, free_port(), str(out_dir)), nprocs=world_size,
                       start_method=CONTEXT.get_start_method(), join=True)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]
