"""Run a function on ranks of a real gloo process group, one forked process each (tests/forked.py),
and read back what each rank returned (the tensor-parallel tests' harness: DTensor needs a
process group per rank, so the ranks cannot be threads of the test process)."""
from __future__ import annotations

import multiprocessing.connection
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tests.forked import CONTEXT
from tests.ports import free_port

TIMEOUT_S = 300.0  # every rank's work together; a rank stuck in a collective whose peer died is ended with it


def _rank_main(rank: int, work: Callable[[DeviceMesh], Any], world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            torch.save(work(init_device_mesh("cpu", (world_size,))), f"{out_dir}/rank{rank}.pt")
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the test process raises it with this rank's traceback
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def on_gloo_ranks(work: Callable[[DeviceMesh], Any], world_size: int, out_dir: Path) -> list[Any]:
    """``work(mesh)`` on each of ``world_size`` forked ranks (a module-level function: it is
    pickled into them); what each returned, rank 0 first. A rank that raises ends the others,
    and its traceback is raised here."""
    port = free_port()
    processes = [CONTEXT.Process(target=_rank_main, args=(rank, work, world_size, port, str(out_dir)), daemon=True)
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        running = list(processes)
        while running:
            multiprocessing.connection.wait([process.sentinel for process in running],
                                            timeout=max(0.0, deadline - time.monotonic()))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gloo ranks did not finish within {TIMEOUT_S:.0f} s")
            running = [process for process in running if process.exitcode is None]
            failed = [rank for rank, process in enumerate(processes) if process.exitcode not in (None, 0)]
            if failed:
                errors = [Path(out_dir, f"rank{rank}.error") for rank in failed]
                raise RuntimeError(f"gloo rank(s) {failed} failed:\n"
                                   + "\n".join(error.read_text() for error in errors if error.exists()))
    finally:
        for process in processes:
            if process.exitcode is None:
                process.kill()
            process.join()
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]
