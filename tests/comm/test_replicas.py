"""A stage's replicas over gloo between three real processes: all-reduce,
ZeRO-1's reduce-scatter onto owners and all-gather from them, in chunks small
enough that every chunk boundary cuts a tensor, match sums computed in one
process, on plain gloo and under NCCL's emulation (each wait polled, as the
channel waits); and the flat layout reads and writes exactly the elements it names. The ranks are
forked processes reused from test to test (tests/comm/shared_ranks.py), each run joining its
group afresh."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raypipe.comm import replicas
from raypipe.comm.p2p import P2PChannel
from raypipe.comm.replicas import StageReplicas, _FlatBucket
from raypipe.core.topology import Topology
from tests.comm.shared_ranks import shared_ranks
from tests.ports import free_port

REPLICAS = 3
SHAPES = [(5, 3), (7,), (2, 2, 2), (1,), (4, 4)]  # unequal: padded owner segments
OWNERS = (0, 1, 2, 2, 0)


@pytest.fixture(scope="module")
def ranks():
    """Forked ranks (tests/comm/shared_ranks.py's, shared with the other modules that use them)."""
    return shared_ranks()


def tensors_of(replica: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Each replica's own values (what its backward would have accumulated)."""
    generator = torch.Generator().manual_seed(replica)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]


def run_replica(replica: int, port: int, emulate_nccl: bool) -> tuple[list, list, list]:
    """Replica ``replica``'s tensors after the all-reduce, the reduce-scatter and the all-gather."""
    bucket_bytes, replicas._BUCKET_BYTES = replicas._BUCKET_BYTES, 24  # 6 fp32 elements per collective:
    # every chunk cuts some tensor (put back after: the rank's next run may be another module's)
    topology = Topology(num_stages=1, num_replicas=REPLICAS)
    channel = None
    try:
        if emulate_nccl:  # the channel's own replicas, waited for as the channel waits: polled
            channel = P2PChannel(topology, replica, 0, torch.device("cpu"))
            channel.join("127.0.0.1", port, timeout_s=20, emulate_nccl=True)
            group = channel.replicas
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=replica,
                                    world_size=REPLICAS)
            group = StageReplicas(topology, replica, 0, lambda work, what: work.wait())
            group.join()
        summed = tensors_of(replica)
        group.finish_gradient_reduction(group.start_gradient_reduction(summed))
        owned = tensors_of(replica)
        group.finish_gradient_reduction(group.start_gradient_reduction(owned, OWNERS))
        # the owners' new values (bf16, as a ZeRO-1 run gathers its compute weights)
        gathered = [t if owner == replica else torch.zeros_like(t)
                    for t, owner in zip(tensors_of(10 + replica, torch.bfloat16), OWNERS)]
        group.gather_parameters(gathered, OWNERS)
        return summed, owned, gathered
    finally:
        replicas._BUCKET_BYTES = bucket_bytes
        if channel is not None:
            channel.leave()
        elif dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("emulate_nccl", [False, True], ids=["gloo", "nccl-emulation"])
def test_all_reduce_reduce_scatter_and_all_gather_in_chunks_match_one_process(ranks, emulate_nccl):
    # a replica left waiting on its peers past the timeout is killed (it would spin on a core)
    received = dict(enumerate(ranks.run(run_replica, free_port(), emulate_nccl, nprocs=REPLICAS, timeout_s=120)))
    expected = [sum(tensors_of(replica)[index] for replica in range(REPLICAS)) for index in range(len(SHAPES))]
    new_values = [tensors_of(10 + owner, torch.bfloat16)[index] for index, owner in enumerate(OWNERS)]
    for replica, (summed, owned, gathered) in received.items():
        for index, owner in enumerate(OWNERS):
            torch.testing.assert_close(summed[index], expected[index])  # every replica: the sum
            if owner == replica:  # the owner: the sum; the others: their own, untouched
                torch.testing.assert_close(owned[index], expected[index])
            else:
                assert torch.equal(owned[index], tensors_of(replica)[index])
            assert torch.equal(gathered[index], new_values[index])  # everyone: the owner's value


def test_a_flat_layout_reads_and_writes_the_elements_it_names():
    tensors = [torch.arange(12.0).reshape(3, 4), torch.arange(100.0, 105.0), torch.arange(200.0, 203.0)]
    [layout] = _FlatBucket.of(tensors, (1, 0, 1), num_replicas=2)
    assert layout.length == 15  # owner 1: 12 + 3 elements; owner 0: 5, padded
    assert torch.equal(layout.read(1, 10, 14), torch.tensor([10.0, 11.0, 200.0, 201.0]))
    assert torch.equal(layout.read(0, 3, 8), torch.tensor([103.0, 104.0, 0.0, 0.0, 0.0]))
    layout.write(1, 11, torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0]))  # the last lands in the padding
    assert tensors[0][2, 3] == -1.0 and torch.equal(tensors[2], torch.tensor([-2.0, -3.0, -4.0]))
    assert torch.equal(tensors[1], torch.arange(100.0, 105.0))
