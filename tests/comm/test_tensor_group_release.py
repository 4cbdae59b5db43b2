"""A worker that leaves its group releases a tensor-parallel peer blocked in a collective with it
at once, though its split parameters (and their DeviceMesh) live on.

The mesh of a stage's tensor-parallel group holds the group, and every parameter split over the
mesh holds the mesh: before ``GroupMembership.leave`` dropped the mesh's reference
(``raypipe.comm.membership.release_mesh_group``), ``destroy_process_group`` left the group object,
and gloo's connections, alive, and a peer that had gone on into a DTensor collective while this rank
stopped at an abort waited the group's whole timeout (``p2p_timeout_s``, 300 s by default): a heal
held five minutes (found by the seeded TP kills on Ray, tests/executor/test_tensor_parallel_faults.py).
The ranks are real processes over real gloo (tests/comm/shared_ranks.py)."""
from __future__ import annotations

import queue
import time

import torch

from raypipe.comm.p2p import P2PChannel
from raypipe.core.topology import Topology
from tests.comm.shared_ranks import shared_ranks
from tests.ports import free_port

GROUP_TIMEOUT_S = 120.0  # a wait released by this timeout is the bug, not a release


def run_rank_of_a_split_stage(rank: int, port: int, shared: queue.Queue) -> tuple[str, str]:
    """One stage split over t = 2. Rank 1 goes into a DTensor collective (an all-gather of a
    sharded parameter); rank 0, once rank 1 is in it, leaves the group instead (as a rank that
    stops at an abort leaves), its parameter kept. What each saw."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    channel = P2PChannel(Topology(num_stages=1, tensor_parallel=2), 0, 0, torch.device("cpu"), tp_rank=rank)
    channel.join("127.0.0.1", port, timeout_s=GROUP_TIMEOUT_S)
    mesh = channel.tensor_mesh
    parameter = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    parameter.redistribute(mesh, [Replicate()]).to_local()  # both ranks in step once
    if rank == 1:
        shared.put("in the collective")
        try:
            parameter.redistribute(mesh, [Replicate()]).to_local()
            outcome = "the collective completed"
        except Exception as error:  # noqa: BLE001 - what released it is the answer
            outcome = f"{type(error).__name__}: {error}"
        channel.leave()
        return "blocked rank", outcome
    shared.get(timeout=60)
    time.sleep(0.5)  # rank 1 posts the collective's transfers (nothing tells rank 0 when it has)
    channel.leave()
    assert parameter.to_local().shape == (2, 4)  # the split parameter (and its mesh) live on
    return "leaving rank", "left"


def test_a_rank_that_leaves_releases_its_tensor_parallel_peer_blocked_in_a_collective_at_once():
    (_, left), (_, outcome) = shared_ranks().run(run_rank_of_a_split_stage, free_port(), nprocs=2,
                                                 shared_queue=True, timeout_s=GROUP_TIMEOUT_S + 60)
    assert left == "left"
    # gloo's own words for a peer whose connection closed, not its "Timed out waiting" after the timeout
    assert "Connection closed by peer" in outcome, outcome
