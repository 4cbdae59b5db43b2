"""The decision every worker takes from every stage's gradient statistics."""
import math

import pytest

from raypipe.core.step_decision import NONFINITE, OVERFLOW, StageGradStats, decide_step


def test_a_clean_step_steps_with_the_global_norm_and_the_loss():
    decision = decide_step([StageGradStats(9.0, False), StageGradStats(16.0, False, 1.25)], loss_scaled=False)
    assert (decision.grad_norm, decision.loss, decision.skipped) == (5.0, 1.25, False)


@pytest.mark.parametrize("loss_scaled,reason", [(False, NONFINITE), (True, OVERFLOW)])
def test_non_finite_gradients_skip_as_nonfinite_or_as_an_fp16_overflow(loss_scaled, reason):
    stats = [StageGradStats(1.0, False), StageGradStats(math.inf, True), StageGradStats(math.nan, True, 0.5)]
    decision = decide_step(stats, loss_scaled)
    assert (decision.skip_reason, decision.first_nonfinite_stage) == (reason, 1)


def test_a_non_finite_loss_is_nonfinite_even_with_a_loss_scale():
    decision = decide_step([StageGradStats(1.0, False), StageGradStats(1.0, False, math.nan)], loss_scaled=True)
    assert (decision.skip_reason, decision.first_nonfinite_stage) == (NONFINITE, None)


def test_every_worker_decides_alike_whatever_it_holds():
    stats = [StageGradStats(0.1 * (s + 1), False, 2.0 if s == 3 else None) for s in range(4)]
    assert len({decide_step(list(stats), False) for _ in range(3)}) == 1
