"""Non-finite steps never reach the weights, in every precision and executor.

A NaN in one input row makes the loss and every gradient NaN. With
``nonfinite="skip"`` (the default) the step is skipped on every worker:
parameters, optimizer and LR-scheduler state stay bitwise as they were, the
step counter advances, and training goes on. With ``"raise"`` the step raises
:class:`NonFiniteError` naming the step and the first non-finite stage, and
nothing changed either. In fp16 a gradient overflow lowers the loss scale and
skips; ``"raise"`` fires only when it happens at the minimum loss scale.
"""
import copy
import math

import pytest
import torch
from torch import nn

import raypipe
from raypipe import NonFiniteError
from tests.reference import ReplaceGradientIf, assert_bitwise_equal, checkpoint_state, make_mlp

BATCH, MICRO_BATCHES = 6, 3
NUM_LAYERS = 7  # make_mlp()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def batch(seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 4, generator=generator)


def poisoned(x):
    x = x.clone()
    x[2, 3] = math.nan  # a row of micro-batch 1
    return x


# Each precision and each policy (p2p); the per-op executor once, under fp16's skip: both decide with
# core.step_decision.decide_step and raise in the trainer, and differ only in who gathers the stages'
# statistics (fp16: the case that also moves the loss scale; its raise at the floor is tested below).
# Every precision under skip (fp16's on the per-step executor among them), with and without clipping, runs
# the same step runner in one process with the same checks (skipped, NaN loss, every worker's weights and
# optimizer state bitwise as before, the next clean step the uninterrupted run's):
# tests/testing/test_op_interpreter.py.
CASES = [("p2p", "fp32", None, "skip"), ("p2p", "bf16", 1.0, "raise"), ("p2p", "fp16", 1.0, "raise"),
         ("object_store", "fp16", None, "skip")]


@pytest.mark.parametrize("transport,precision,clip,policy", CASES)
def test_a_nan_step_changes_nothing(ray_cluster, tmp_path, transport, precision, clip, policy):
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES, precision=precision,
                                    clip_grad_norm=clip, nonfinite=policy, transport=transport)
    model = make_mlp()
    with raypipe.PipelineTrainer(model, nn.functional.mse_loss, adamw, config, lr_scheduler=halving) as trainer:
        trainer.step(*batch(1))  # optimizer and scheduler have state
        before = checkpoint_state(trainer, tmp_path / "before", NUM_LAYERS)
        x, y = batch(2)
        if policy == "skip":
            result = trainer.step(poisoned(x), y)
            assert (result.skipped, result.skip_reason) == (True, "nonfinite")
            assert math.isnan(result.loss) and trainer.step_count == 2
        else:
            with pytest.raises(NonFiniteError, match="step 1: non-finite stage 0's gradients") as error:
                trainer.step(poisoned(x), y)
            assert (error.value.step, error.value.stage) == (1, 0) and trainer.step_count == 1
        after = checkpoint_state(trainer, tmp_path / "after", NUM_LAYERS)
        assert_bitwise_equal(before, after)
        clean = trainer.step(x, y)  # training goes on, as if the poisoned batch never came
        state = trainer.state_dict()
    expected_loss, expected_state = uninterrupted(model, config)
    assert not clean.skipped and clean.loss == expected_loss
    assert_bitwise_equal(expected_state, state)


_UNINTERRUPTED = {}


def uninterrupted(model: nn.Module, config: raypipe.PipelineConfig) -> tuple[float, dict]:
    """The second step's loss and the state after it, without the poisoned batch. The
    policy changes no number of a clean step: cases that differ only in it share one run."""
    numerics = (config.transport, config.precision, config.clip_grad_norm)
    if numerics not in _UNINTERRUPTED:
        with raypipe.PipelineTrainer(copy.deepcopy(model), nn.functional.mse_loss, adamw, config,
                                     lr_scheduler=halving) as trainer:
            trainer.step(*batch(1))
            _UNINTERRUPTED[numerics] = trainer.step(*batch(2)).loss, trainer.state_dict()
    return _UNINTERRUPTED[numerics]


def _all_inf(grad):
    return torch.full_like(grad, math.inf)


class OverflowOnMarker(nn.Module):
    """An elementwise scale whose weight gradient overflows (all inf) for a
    micro-batch whose first value is marked; the loss stays finite."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * ReplaceGradientIf.apply(self.weight, bool(x[0, 0] > 1e3), _all_inf)


@pytest.mark.parametrize("transport", ["p2p", "object_store"])
def test_fp16_overflow_lowers_the_scale_and_raises_only_at_its_floor(ray_cluster, transport):
    layers = [OverflowOnMarker(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)]
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, precision="fp16", nonfinite="raise",
                                    initial_loss_scale=4.0, min_loss_scale=2.0, transport=transport, balance=[2, 2])
    x, y = batch(3)
    marked = x.clone()
    marked[0, 0] = 1e4
    with raypipe.PipelineTrainer(layers, nn.functional.mse_loss, adamw, config) as trainer:
        before = trainer.state_dict()
        result = trainer.step(marked, y)
        assert (result.skipped, result.skip_reason, result.loss_scale) == (True, "overflow", 4.0)
        assert trainer.scaler.scale == 2.0 and math.isfinite(result.loss)
        with pytest.raises(NonFiniteError, match="overflow at the minimum loss scale 2"):
            trainer.step(marked, y)
        assert_bitwise_equal(before, trainer.state_dict())
        assert not trainer.step(x, y).skipped
