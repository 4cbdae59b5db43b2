"""Failures are clear: where they happened, what was asked, and nothing hangs."""
import copy

import pytest
import torch
from torch import nn

import raypipe
from raypipe import ConfigError, PlacementError, StageError
from tests.reference import InterpretedTrainer, ReplaceGradientIf, assert_parameters_match, reference_step

MARK = -100.0  # an input value no real sample has: the backward tripwire's signal


class FailOnNegativeFirst(nn.Module):
    """Raises when a micro-batch's first element is negative (a 'bad sample')."""

    def forward(self, x):
        if x[0, 0] < 0:
            raise ValueError("negative sample reached the layer")
        return x


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _blow_up(grad):
    raise FloatingPointError("backward blew up")


class FailInBackward(nn.Module):
    """Identity that blows up in backward when column 1 of its micro-batch's first row is marked."""

    def forward(self, x):
        return ReplaceGradientIf.apply(x, bool(x[0, 1] < MARK / 2), _blow_up)


# stage 0: a linear layer (the identity, as KNOWN_STATE sets it: marks reach the tripwires unchanged) and the
# backward tripwire; stage 1: the forward tripwire and the head
LAYERS = (nn.Linear(4, 4), FailInBackward(), FailOnNegativeFirst(), nn.Linear(4, 2))
KNOWN_STATE = {"0.weight": torch.eye(4), "0.bias": torch.zeros(4), "3.weight": torch.zeros(2, 4),
               "3.bias": torch.zeros(2)}


@pytest.fixture
def trainer():
    """A trainer of LAYERS with KNOWN_STATE's weights (default executor, 2 stages, 3 micro-batches) for the tests
    that make a step fail, through the step runner the workers run, in one process. On Ray the same failures
    (a forward's and a backward's, each named by stage, op and micro-batch with its cause, changing nothing,
    the next step as one process's) are tests/executor/test_atomic_steps.py's, on every executor, and a batch
    smaller than the step's micro-batches refused there too: tests/executor/test_data_parallel.py."""
    layers = copy.deepcopy(list(LAYERS))
    for index, layer in enumerate(layers):
        layer.load_state_dict({name.split(".", 1)[1]: value for name, value in KNOWN_STATE.items()
                               if name.startswith(f"{index}.")})
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=3, balance=[2, 2])
    return InterpretedTrainer(layers, nn.functional.mse_loss, sgd, config)


def test_stage_failure_names_stage_micro_batch_and_op_with_cause(trainer):
    x = torch.ones(6, 4)
    x[4, 0] = -1.0  # first row of micro-batch 2 (rows 4-5)
    with pytest.raises(StageError) as error:
        trainer.step(x, torch.zeros(6, 2))
    assert (error.value.stage, error.value.op, error.value.micro_batch) == (1, "F", 2)
    assert "stage 1, op F, micro-batch 2" in str(error.value)
    assert isinstance(error.value.__cause__, ValueError)
    assert "negative sample" in str(error.value.__cause__)
    # the failed step left nothing behind: the next clean step is exactly a fresh one
    x[4, 0] = 1.0
    y = torch.ones(6, 2)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.Identity(), nn.Linear(4, 2))
    reference.load_state_dict({k: v for k, v in trainer.state_dict().items()})
    loss, norm = reference_step(reference, sgd(reference.parameters()), nn.functional.mse_loss, x, y, 3)
    result = trainer.step(x, y)
    assert (result.loss, result.grad_norm) == (pytest.approx(loss, rel=1e-6), pytest.approx(norm, rel=1e-6))
    assert_parameters_match(trainer.state_dict(), reference.state_dict())


def test_backward_failure_is_reported_not_swallowed(trainer):
    before = trainer.state_dict()
    x = torch.ones(6, 4)
    x[0, 1] = MARK  # micro-batch 0's backward blows up in stage 0
    with pytest.raises(StageError) as error:
        trainer.step(x, torch.zeros(6, 2))
    assert (error.value.stage, error.value.op) == (0, "B")
    assert isinstance(error.value.__cause__, FloatingPointError)
    assert_parameters_match(trainer.state_dict(), before, rtol=0, atol=0)  # no stage stepped


def test_batch_smaller_than_micro_batches_is_rejected_before_submitting(trainer):
    smaller = r"smaller than the step's 3 micro-batches \(num_micro_batches x num_replicas\)"
    with pytest.raises(ValueError, match=smaller):
        trainer.step(torch.ones(2, 4), torch.ones(2, 2))
    with pytest.raises(ValueError, match="targets have 2"):
        trainer.step(torch.ones(3, 4), torch.ones(2, 2))
    assert trainer.step(torch.ones(3, 4), torch.ones(3, 2)).loss >= 0  # still usable


def test_config_errors_are_raised_before_any_actor_starts(ray_cluster):
    import ray

    groups_before = len(ray.util.placement_group_table())
    with pytest.raises(ConfigError, match="num_stages"):
        raypipe.PipelineTrainer([nn.Linear(2, 2)], nn.functional.mse_loss, sgd, raypipe.PipelineConfig(num_stages=2))
    with pytest.raises(ConfigError, match="model"):
        raypipe.PipelineTrainer(nn.Linear(2, 2), nn.functional.mse_loss, sgd)
    with pytest.raises(ConfigError, match=r"model\[1\]"):
        raypipe.PipelineTrainer([nn.Linear(2, 2), "relu"], nn.functional.mse_loss, sgd)
    assert len(ray.util.placement_group_table()) == groups_before  # nothing was reserved


def test_unplaceable_pipeline_fails_with_what_was_asked_and_what_exists(ray_cluster):
    import ray

    def held():  # the placement groups not removed
        return {key for key, group in ray.util.placement_group_table().items() if group["state"] != "REMOVED"}

    held_before = held()
    config = raypipe.PipelineConfig(num_stages=2, cpus_per_stage=64, placement_timeout_s=2)
    with pytest.raises(PlacementError) as error:
        raypipe.PipelineTrainer([nn.Linear(2, 2), nn.Linear(2, 2)], nn.functional.mse_loss, sgd, config)
    message = str(error.value)
    assert "1 replica(s) of 2 stage(s) of {'CPU': 64.0}" in message and "'CPU': 6.0" in message
    assert held() <= held_before  # what the failed start asked for is removed
