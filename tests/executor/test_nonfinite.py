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
from tests.reference import (InterpretedTrainer, ReplaceGradientIf, assert_bitwise_equal, checkpoint_state,
                             in_process, make_mlp, on_ray)

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


# Each policy on p2p, bf16's raise on Ray, fp32's and fp16's skip through the per-step executor's step runner
# in one process (the checkpoints written and loaded by its stage workers, as on Ray). The per-op executor
# decides with core.step_decision.decide_step and raises in the trainer as the per-step one does, and differs
# only in who gathers the stages' statistics (the driver): on Ray under fp16, skipping an overflow (which
# also moves the loss scale) and raising at the floor, below. The raise on a NaN is the trainer's, whatever
# the precision (bf16's below; fp16's decision, "nonfinite" and not an overflow, is
# tests/core/test_step_decision.py's and the in-process matrix's; fp16 with nonfinite="raise":
# test_fp16_overflow_lowers_the_scale_and_raises_only_at_its_floor).
# Every precision under skip (fp16's on the per-step executor among them), with and without clipping, runs
# the same step runner in one process with the same checks (skipped, NaN loss, every worker's weights and
# optimizer state bitwise as before, the next clean step the uninterrupted run's):
# tests/testing/test_op_interpreter.py.
CASES = [("p2p", "bf16", 1.0, "raise")]
IN_PROCESS_CASES = [("p2p", "fp32", None, "skip"), ("p2p", "fp16", None, "skip")]


@pytest.mark.parametrize("transport,precision,clip,policy", CASES)
def test_a_nan_step_changes_nothing(ray_cluster, tmp_path, transport, precision, clip, policy):
    assert_a_nan_step_changes_nothing(on_ray, tmp_path, transport, precision, clip, policy)


@pytest.mark.parametrize("transport,precision,clip,policy", IN_PROCESS_CASES)
def test_a_nan_step_changes_nothing_in_process(tmp_path, transport, precision, clip, policy):
    assert_a_nan_step_changes_nothing(in_process, tmp_path, transport, precision, clip, policy)


def assert_a_nan_step_changes_nothing(trainer_of, tmp_path, transport, precision, clip, policy) -> None:
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES, precision=precision,
                                    clip_grad_norm=clip, nonfinite=policy, transport=transport)
    with trainer_of(make_mlp(), nn.functional.mse_loss, adamw, config, lr_scheduler=halving) as trainer:
        trainer.step(*batch(1))  # optimizer and scheduler have state
        # the uninterrupted run first: its second step's loss and state, without the poisoned batch; then the
        # same trainer back at the first step (weights, optimizer, scheduler and loss scale, bitwise)
        trainer.save_checkpoint(tmp_path / "first")
        x, y = batch(2)
        uninterrupted = trainer.step(x, y)
        expected_loss, expected_state = uninterrupted.loss, trainer.state_dict()
        trainer.load_checkpoint(tmp_path / "first")
        assert trainer.step_count == 1
        before = checkpoint_state(trainer, tmp_path / "before", NUM_LAYERS)
        if policy == "skip":
            result = trainer.step(poisoned(x), y)
            assert (result.skipped, result.skip_reason) == (True, "nonfinite")
            assert math.isnan(result.loss) and trainer.step_count == 2
        else:  # the trainer's raise: on Ray only
            with pytest.raises(NonFiniteError, match="step 1: non-finite stage 0's gradients") as error:
                trainer.step(poisoned(x), y)
            assert (error.value.step, error.value.stage) == (1, 0) and trainer.step_count == 1
        after = checkpoint_state(trainer, tmp_path / "after", NUM_LAYERS)
        assert_bitwise_equal(before, after)
        clean = trainer.step(x, y)  # training goes on, as if the poisoned batch never came
        state = trainer.state_dict()
    assert not uninterrupted.skipped
    assert not clean.skipped and clean.loss == expected_loss
    assert_bitwise_equal(expected_state, state)


# what the trainer would raise on, fp16's under nonfinite="raise" with clipping: the step runner's decision, in
# one process (the trainer raises NonFiniteError(step, decision.first_nonfinite_stage) for it, as for bf16's
# above); the loss scale stays, and the next clean step is the uninterrupted run's
def test_an_fp16_nan_step_is_nonfinite_and_changes_nothing_in_process():
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES, precision="fp16",
                                    clip_grad_norm=1.0, nonfinite="raise")

    def run(poison: bool):
        trainer = InterpretedTrainer(make_mlp(), nn.functional.mse_loss, adamw, config)
        trainer.step(*batch(1))  # the optimizer has state
        x, y = batch(2)
        if poison:
            before = worker_states(trainer)
            scale = trainer.scaler.scale
            result = trainer.step(poisoned(x), y)
            assert (result.skipped, result.skip_reason) == (True, "nonfinite") and math.isnan(result.loss)
            assert trainer.pipeline.reports[0].decision.first_nonfinite_stage == 0  # what NonFiniteError names
            assert trainer.scaler.scale == scale  # a NaN is no overflow: the loss scale stays
            assert_bitwise_equal(before, worker_states(trainer))
        return trainer.step(x, y), trainer.state_dict()

    (clean, state), (expected, expected_state) = run(True), run(False)
    assert not clean.skipped and clean.loss == expected.loss
    assert_bitwise_equal(expected_state, state)


def worker_states(trainer: InterpretedTrainer) -> list:
    """Every worker's weights and optimizer state (its step counts as tensors), copied."""
    return [copy.deepcopy((worker.layers.state_dict(), worker.optimizer.state_dict()))
            for worker in trainer.pipeline.workers]


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


# the trainer's raise on Ray, under the per-op executor (the driver gathers the stages' statistics); the
# per-step executor's decision (its workers all-reduce them) through its step runner in one process, with
# what the trainer raises on there (an overflow, skipped, at the minimum loss scale: control/steps.py)
@pytest.mark.parametrize("transport", ["object_store"])
def test_fp16_overflow_lowers_the_scale_and_raises_only_at_its_floor(ray_cluster, transport):
    assert_fp16_overflow_lowers_the_scale_and_raises_only_at_its_floor(on_ray, transport)


def test_fp16_overflow_lowers_the_scale_and_raises_only_at_its_floor_in_process():
    assert_fp16_overflow_lowers_the_scale_and_raises_only_at_its_floor(in_process, "p2p")


def assert_fp16_overflow_lowers_the_scale_and_raises_only_at_its_floor(trainer_of, transport: str) -> None:
    layers = [OverflowOnMarker(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)]
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, precision="fp16", nonfinite="raise",
                                    initial_loss_scale=4.0, min_loss_scale=2.0, transport=transport, balance=[2, 2])
    x, y = batch(3)
    marked = x.clone()
    marked[0, 0] = 1e4
    with trainer_of(layers, nn.functional.mse_loss, adamw, config) as trainer:
        before = trainer.state_dict()
        result = trainer.step(marked, y)
        assert (result.skipped, result.skip_reason, result.loss_scale) == (True, "overflow", 4.0)
        assert trainer.scaler.scale == 2.0 and math.isfinite(result.loss)
        if trainer_of is on_ray:
            with pytest.raises(NonFiniteError, match="overflow at the minimum loss scale 2"):
                trainer.step(marked, y)
        else:  # what the trainer raises NonFiniteError on
            result = trainer.step(marked, y)
            assert (result.skipped, result.skip_reason, result.loss_scale) == (True, "overflow", 2.0)
            assert trainer.scaler.scale == trainer.scaler.min_scale == 2.0
        assert_bitwise_equal(before, trainer.state_dict())
        assert not trainer.step(x, y).skipped
