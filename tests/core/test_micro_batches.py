"""A step's micro-batches split into contiguous blocks over the replicas running it."""
import pytest
import torch

from raypipe.core.micro_batches import replica_blocks


@pytest.mark.parametrize("count,replicas", [(4, 1), (4, 2), (8, 3), (5, 4), (3, 3)])
def test_blocks_cover_the_step_in_order_sized_as_tensor_split(count, replicas):
    blocks = replica_blocks(count, replicas)
    assert [index for block in blocks for index in block] == list(range(count))
    assert [len(block) for block in blocks] == [len(part) for part in torch.tensor_split(torch.arange(count), replicas)]


def test_more_replicas_than_micro_batches_is_refused():
    with pytest.raises(ValueError, match="2 replica\\(s\\) cannot share a step of 1 micro-batch"):
        replica_blocks(1, 2)
