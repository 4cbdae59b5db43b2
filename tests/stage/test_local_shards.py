"""A stage's state held as local tensors and given back (stage/local_shards.py), on plain tensors:
what moving a tensor-parallel stage onto a new mesh does to each rank's own part (the DTensor
placements are checked by the forked-process runs, tests/executor/test_tensor_parallel_faults.py)."""
import pytest
import torch
from torch import nn

from raypipe.stage.local_shards import adopt_local_tensors, as_local, copy_local_state, held_tensors


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(3, 4, bias=False), nn.Linear(4, 3, bias=False)
        self.norm = nn.LayerNorm(4)
        self.head.weight = nn.Parameter(torch.randn(3, 4))
        self.second = self.head  # the same module (and parameters) under two names
        self.register_buffer("table", torch.arange(5.0), persistent=False)


def test_rebuilt_layers_take_the_held_tensors_without_a_copy_and_stay_tied():
    torch.manual_seed(0)
    live = nn.ModuleList([Tied()])
    held = held_tensors(live)
    with torch.device("meta"):
        rebuilt = nn.ModuleList([Tied()])
    adopt_local_tensors(rebuilt, held)
    for name, tensor in [*live.named_parameters(), *live.named_buffers()]:
        again = rebuilt.get_parameter(name) if "table" not in name else rebuilt.get_buffer(name)
        assert again.data_ptr() == tensor.data_ptr() and again.requires_grad == tensor.requires_grad, name
        assert isinstance(again, nn.Parameter) == isinstance(tensor, nn.Parameter), name
    assert rebuilt[0].second.weight is rebuilt[0].head.weight
    assert not any(t.is_meta for t in [*rebuilt.parameters(), *rebuilt.buffers()])


def test_a_held_state_that_does_not_fit_is_named():
    live = nn.ModuleList([nn.Linear(2, 2)])
    with torch.device("meta"):
        wider = nn.ModuleList([nn.Linear(2, 3)])
    with pytest.raises(ValueError, match="^'weight' is \\(2, 2\\) in the state held, \\(3, 2\\) in the rebuilt"):
        adopt_local_tensors(wider, held_tensors(live))
    with pytest.raises(KeyError, match="'bias' of the rebuilt layer is not in the state held"):
        adopt_local_tensors(wider, [{"weight": torch.zeros(3, 2)}])


def test_a_snapshot_state_is_copied_into_the_live_tensors_in_place():
    source, target = nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleList([nn.Linear(2, 2)])
    pointer = target[0].weight.data_ptr()
    copy_local_state(target, as_local(source.state_dict()))
    assert torch.equal(target[0].weight, source[0].weight) and target[0].weight.data_ptr() == pointer
    with pytest.raises(KeyError, match="'0.extra'"):
        copy_local_state(target, {"0.extra": torch.zeros(1)})
