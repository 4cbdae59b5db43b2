"""A model whose boundary shape depends on the data trains exactly under ``boundary_shapes="learned"``
(the default): the step whose activation changed signature fails before anything of it is sent
(:class:`raypipe.errors.BoundaryShapeChanged`), is retried with headers on that message key without
charging ``max_failures``, and the run equals one process; with ``"headers"`` no step is retried.
The retries are the controller's: that run is on Ray (and its trainer's state dict round trips there).
With headers nothing is retried, so its run
(the same step runner's arithmetic on the same changing shapes) is in one process; each transport's
headers are counted in tests/comm/test_boundary_signatures.py."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import raypipe
from tests.reference import adamw, assert_parameters_match, in_process, on_ray, reference_step

NUM_STEPS, NUM_MICRO_BATCHES, BATCH, LENGTH = 4, 2, 4, 6


class TruncateByData(nn.Module):
    """Keeps the first 3 + (the count of positive first features of the first position) positions of
    its micro-batch: a boundary whose length changes with the data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :3 + int((x[:, 0, 0] > 0).sum())]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output.mean(dim=1), target)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, LENGTH, 8, generator=generator), torch.randn(BATCH, 4, generator=generator))
            for _ in range(NUM_STEPS)]


def lengths(inputs: torch.Tensor) -> list[int]:
    """Each micro-batch's length after the truncation: the boundary's shape."""
    return [TruncateByData()(x).shape[1] for x in torch.tensor_split(inputs, NUM_MICRO_BATCHES)]


def train(trainer_of, boundary_shapes: str) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    layers = [TruncateByData(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    reference = nn.Sequential(*copy.deepcopy(layers))
    # max_failures=0: a retry charged as a failure would stop the run
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=NUM_MICRO_BATCHES, schedule="1f1b",
                                    balance=[2, 2], max_failures=0, boundary_shapes=boundary_shapes)
    with trainer_of(layers, loss_fn, adamw, config) as trainer:
        losses = [trainer.step(x, y).loss for x, y in batches()]
        state = trainer.state_dict()
        if trainer_of is on_ray:
            assert_state_round_trips(trainer, {"1.weight", "1.bias", "3.weight", "3.bias"})
    optimizer = adamw(reference.parameters())
    expected = [reference_step(reference, optimizer, loss_fn, x, y, NUM_MICRO_BATCHES)[0] for x, y in batches()]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-7)
    assert_parameters_match(state, reference.state_dict())
    return losses, state


def test_the_data_changes_the_boundary_shape():
    seen = [lengths(x) for x, _ in batches()]
    assert any(step[0] != seen[0][0] for step in seen[1:]) or any(step[1] != seen[0][1] for step in seen[1:]), seen


def test_a_data_dependent_boundary_trains_exactly_under_learned_shapes_with_one_retry_per_new_signature(
        ray_cluster, caplog):
    with caplog.at_level(logging.INFO, logger="raypipe"):
        train(on_ray, "learned")
    retried = [record for record in caplog.records if "changed from" in record.getMessage()]
    changes = 0
    for index in range(NUM_MICRO_BATCHES):  # each key is retried once, then keeps headers
        first = lengths(batches()[0][0])[index]
        changes += any(lengths(x)[index] != first for x, _ in batches()[1:])
    assert len(retried) == changes > 0, [record.getMessage() for record in retried]


def test_a_data_dependent_boundary_trains_exactly_with_headers(caplog):
    with caplog.at_level(logging.INFO, logger="raypipe"):
        train(in_process, "headers")
    assert not [record for record in caplog.records if "changed from" in record.getMessage()]


def assert_state_round_trips(trainer, keys: set) -> None:
    """A Ray trainer's state dict has ``keys`` (a layer without parameters has none; its index is kept),
    loads back into it, and a key of no layer is refused by name."""
    state = trainer.state_dict()
    assert set(state) == keys
    zeros = {k: torch.zeros_like(v) for k, v in state.items()}
    trainer.load_state_dict(zeros)
    assert all(torch.equal(v, zeros[k]) for k, v in trainer.state_dict().items())
    with pytest.raises(KeyError, match="9.weight"):
        trainer.load_state_dict({**zeros, "9.weight": torch.zeros(1)})
