"""What every worker decides after a step's backward, from every stage's gradient
statistics: the global gradient norm, and whether the optimizer steps.

Each worker computes this from the same numbers in the same order (a fixed
stage order, fp32), so every worker reaches the same decision without asking
the driver: clip by the same norm and step, or skip everywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

OVERFLOW, NONFINITE = "overflow", "nonfinite"


class StageGradStats(NamedTuple):
    """One stage's contribution: its squared gradient norm (unscaled, fp32), whether
    any of its gradients is inf/NaN, and its share of the loss (last stage only)."""

    squared_norm: float
    found_inf: bool
    loss: float | None = None


@dataclass(frozen=True)
class StepDecision:
    """The global outcome of one step's backward pass."""

    loss: float
    grad_norm: float
    skip_reason: str | None  # None: step; OVERFLOW (fp16, loss scale lowered) or NONFINITE: skip
    first_nonfinite_stage: int | None

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None


def decide_step(stats: Sequence[StageGradStats], loss_scaled: bool) -> StepDecision:
    """Reduce every stage's statistics (in stage order) into one decision.

    With a dynamic loss scale (``loss_scaled``), non-finite gradients are an
    overflow: the step is skipped and the scale lowered. A non-finite loss, or
    non-finite gradients without a loss scale, skip the step as ``nonfinite``.
    """
    squares = torch.tensor([s.squared_norm for s in stats], dtype=torch.float32)
    grad_norm = float(squares.sum().sqrt())
    loss = math.fsum(s.loss for s in stats if s.loss is not None)
    bad_stages = [stage for stage, s in enumerate(stats) if s.found_inf or not math.isfinite(s.squared_norm)]
    first_bad = bad_stages[0] if bad_stages else None
    if not math.isfinite(loss):
        return StepDecision(loss, grad_norm, NONFINITE, first_bad)
    if first_bad is not None or not math.isfinite(grad_norm):
        return StepDecision(loss, grad_norm, OVERFLOW if loss_scaled else NONFINITE, first_bad)
    return StepDecision(loss, grad_norm, None, None)
