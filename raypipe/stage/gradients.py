"""A stage's gradients at the end of a step: their statistics (unscaled, clamped
elementwise if asked, squared L2 norm in fp32, whether any is inf/NaN), and the
optimizer step a step's decision allows (clipped by the global norm first)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from raypipe.core.step_decision import StageGradStats


def owned_grad_stats(owned: list[torch.nn.Parameter], loss: float | torch.Tensor | None, inv_scale: float = 1.0,
                     clip_value: float | None = None) -> StageGradStats:
    """Unscale the gradients of ``owned`` (ZeRO-1: only owned sums are whole), clamp them
    elementwise if asked, and report their squared L2 norm (fp32), whether any is inf/NaN,
    and ``loss`` (the last stage's weighted loss sum, a float or a 0-d tensor, else None).
    The norm and a tensor loss are read in one go: on a GPU, the step's one host sync."""
    grads = [p.grad for p in owned if p.grad is not None]
    if not grads:
        return StageGradStats(0.0, False, None if loss is None else float(loss))
    if inv_scale != 1.0:
        torch._foreach_mul_(grads, inv_scale)
    total = get_total_norm([g.float() for g in grads])
    if isinstance(loss, torch.Tensor):
        norm, loss = torch.stack([total.double(), loss.to(total.device, torch.float64)]).tolist()
    else:
        norm = float(total)
    found_inf = not math.isfinite(norm)
    if clip_value is not None and not found_inf:
        torch.nn.utils.clip_grad_value_(owned, clip_value)
        norm = float(get_total_norm([g.float() for g in grads]))
    return StageGradStats(norm ** 2, found_inf, loss)


def clip_and_step(optimizer: torch.optim.Optimizer, scheduler: Any, owned: list[torch.nn.Parameter],
                  clip_grad_norm: float | None, grad_norm: float) -> None:
    """A step that is not skipped: clip ``owned``'s gradients by the global ``grad_norm``
    (when ``clip_grad_norm`` is set), step the optimizer, then the schedule."""
    if clip_grad_norm is not None:
        # the norm filled on the gradients' device: a host tensor would be copied to it, a host sync
        device = next((p.grad.device for p in owned if p.grad is not None), torch.device("cpu"))
        clip_grads_with_norm_(owned, clip_grad_norm, torch.full((), grad_norm, dtype=torch.float32, device=device))
    optimizer.step()
    if scheduler is not None:  # a skipped step does not advance the schedule
        scheduler.step()
