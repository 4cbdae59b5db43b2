"""Optimizer state is placed where torch's own ``Optimizer.load_state_dict`` places it,
for plain, fused and capturable AdamW (the reference is torch itself)."""
import copy

import pytest
import torch
from torch import nn

from raypipe.stage.optimizer_state import gather_optimizer_state, scatter_optimizer_state

ADAMW_KINDS = {"plain": {}, "fused": {"fused": True}, "capturable": {"capturable": True}}


def _layers(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return nn.ModuleList([nn.Linear(4, 3), nn.Linear(3, 2)]).to(device=device, dtype=dtype)


def _trained_state(options):
    """A source stage's gathered state, and torch's state_dict of it, after two real AdamW
    steps on the host (capturable AdamW cannot step on a CPU: its state is a plain one's
    saved under a capturable group, as a GPU run's snapshot read back on the host is)."""
    layers = _layers()
    capturable = options.get("capturable", False)
    optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-2, **{**options, "capturable": False})
    for _ in range(2):
        layers[1](layers[0](torch.randn(5, 4))).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    gathered, state_dict = gather_optimizer_state(optimizer, layers, [0, 1]), optimizer.state_dict()
    for groups in (gathered[-1]["param_groups"], state_dict["param_groups"]):
        groups[0]["capturable"] = capturable
    # copies: on a CPU both share the source's live tensors, and two loads of them would too
    return copy.deepcopy(gathered), copy.deepcopy(state_dict)


def _restored_both_ways(options: dict, *where) -> tuple:
    """Layers (on ``where``: device, dtype) and an AdamW of ``options`` given the trained state twice:
    by raypipe's scatter (ours) and by torch's ``load_state_dict`` (the reference)."""
    gathered, state_dict = _trained_state(options)
    ours, reference = _layers(*where), _layers(*where)
    ours_optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-2, **options)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, **options)
    scatter_optimizer_state(ours_optimizer, ours, [0, 1], gathered)
    reference_optimizer.load_state_dict(state_dict)
    return ours, ours_optimizer, reference, reference_optimizer


def _assert_placed_like_torch(ours: torch.optim.Optimizer, reference: torch.optim.Optimizer) -> None:
    for mine, theirs in zip(ours.param_groups[0]["params"], reference.param_groups[0]["params"]):
        assert ours.state[mine].keys() == reference.state[theirs].keys()
        for key, value in reference.state[theirs].items():
            placed = ours.state[mine][key]
            assert (placed.device, placed.dtype, placed.shape) == (value.device, value.dtype, value.shape), key
            if value.device.type != "meta":
                assert torch.equal(placed, value), key
    assert [{k: v for k, v in g.items() if k != "params"} for g in ours.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in reference.param_groups]


@pytest.mark.parametrize("kind", sorted(ADAMW_KINDS))
def test_adamw_state_lands_where_load_state_dict_puts_it(kind):
    options = ADAMW_KINDS[kind]
    ours, ours_optimizer, reference, reference_optimizer = _restored_both_ways(options)
    _assert_placed_like_torch(ours_optimizer, reference_optimizer)
    if options:  # fused / capturable: step is a float32 on the parameter's device
        assert all(s["step"].dtype == torch.float32 for s in ours_optimizer.state.values())


@pytest.mark.parametrize("kind", ["plain", "capturable"])
def test_placement_follows_the_parameters_device_and_dtype(kind):
    # Parameters on the "meta" device (no memory, no kernels) make the device choice visible
    # on a CPU-only machine: plain AdamW keeps ``step`` on the host, capturable moves it.
    # float64 parameters show the dtype cast of the floating state.
    options = ADAMW_KINDS[kind]
    ours, ours_optimizer, reference, reference_optimizer = _restored_both_ways(options, "meta", torch.float64)
    _assert_placed_like_torch(ours_optimizer, reference_optimizer)
    steps = {s["step"].device.type for s in ours_optimizer.state.values()}
    assert steps == ({"meta"} if options else {"cpu"})


def test_a_restored_fused_adamw_steps_as_the_uninterrupted_one():
    # The placement is not only where torch puts it: the next fused step runs with it.
    options = ADAMW_KINDS["fused"]
    ours, ours_optimizer, reference, reference_optimizer = _restored_both_ways(options)
    for layers, optimizer in ((ours, ours_optimizer), (reference, reference_optimizer)):
        torch.manual_seed(1)
        layers[1](layers[0](torch.randn(5, 4))).square().sum().backward()
        optimizer.step()
    for mine, theirs in zip(ours.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
