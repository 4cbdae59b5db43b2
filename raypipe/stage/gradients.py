"""A stage's gradients at the end of a step: their statistics (unscaled, clamped
elementwise if asked, squared L2 norm in fp32, whether any is inf/NaN), and the
optimizer step a step's decision allows (clipped by the global norm first).

With tensor parallelism a parameter is a DTensor: its gradient's statistics are those of
the rank's local part. A parameter split over the ranks has its squared norm counted on every
tensor-parallel rank (the step's all-reduce sums the shards), a replicated one's (a plain
tensor, or a ``Replicate`` DTensor: the same on every rank) on tensor-parallel rank 0 only."""
from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from raypipe.core.step_decision import StageGradStats


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (split over a tensor-parallel mesh)."""
    dtensors = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists (seconds of import)
    return dtensors is not None and isinstance(tensor, dtensors.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local shard when it is a DTensor (sharing its storage: writes go through), else itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` gathered whole when it is a DTensor (a collective every rank of its mesh joins, in the
    same order), else itself."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def split_over_tensor_ranks(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is split over the tensor-parallel ranks (each holds a different part;
    "sharded" is ZeRO-1's word, :mod:`raypipe.stage.zero`)."""
    if not is_dtensor(parameter):
        return False
    from torch.distributed.tensor import Shard

    return any(isinstance(placement, Shard) for placement in parameter.placements)


def owned_grad_stats(owned: list[torch.nn.Parameter], loss: float | torch.Tensor | None, inv_scale: float = 1.0,
                     clip_value: float | None = None, tp_rank: int = 0) -> StageGradStats:
    """Unscale the gradients of ``owned`` (ZeRO-1: only owned sums are whole), clamp them
    elementwise if asked, and report their squared L2 norm (fp32), whether any is inf/NaN,
    and ``loss`` (the last stage's weighted loss sum, a float or a 0-d tensor, else None).
    The norm and a tensor loss are read in one go: on a GPU, the step's one host sync.
    ``tp_rank``: this worker's tensor-parallel rank; on a rank other than 0 the norm counts the
    parameters split over the ranks only, and the loss (the same on every rank) is None, so a sum over
    the stage's ranks counts each once."""
    if tp_rank != 0:
        loss = None
    present = [p for p in owned if p.grad is not None]
    grads = [local_tensor(p.grad) for p in present]
    if not grads:
        return StageGradStats(0.0, False, None if loss is None else float(loss))
    if inv_scale != 1.0:
        torch._foreach_mul_(grads, inv_scale)
    counted = grads if tp_rank == 0 else [g for p, g in zip(present, grads) if split_over_tensor_ranks(p)]
    total = _norm(counted, grads[0].device)
    if isinstance(loss, torch.Tensor):
        norm, loss = torch.stack([total.double(), loss.to(total.device, torch.float64)]).tolist()
    else:
        norm = float(total)
    found_inf = not math.isfinite(norm)
    if clip_value is not None and not found_inf:
        torch._foreach_clamp_min_(grads, -clip_value)  # clip_grad_value_'s own, on the local shards
        torch._foreach_clamp_max_(grads, clip_value)
        norm = float(_norm(counted, grads[0].device))
    return StageGradStats(norm ** 2, found_inf, loss)


def _norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The L2 norm of ``grads`` in fp32 (0 when there are none)."""
    return get_total_norm([g.float() for g in grads]) if grads else torch.zeros((), device=device)


def clip_and_step(optimizer: torch.optim.Optimizer, scheduler: Any, owned: list[torch.nn.Parameter],
                  clip_grad_norm: float | None, grad_norm: float) -> None:
    """A step that is not skipped: clip ``owned``'s gradients by the global ``grad_norm``
    (when ``clip_grad_norm`` is set), step the optimizer, then the schedule."""
    if clip_grad_norm is not None:
        # the norm filled on the gradients' device: a host tensor would be copied to it, a host sync
        device = next((p.grad.device for p in owned if p.grad is not None), torch.device("cpu"))
        norm = torch.full((), grad_norm, dtype=torch.float32, device=device)
        if any(is_dtensor(p.grad) for p in owned):  # the same coefficient, on the local shards
            torch._foreach_mul_([local_tensor(p.grad) for p in owned if p.grad is not None],
                                torch.clamp(clip_grad_norm / (norm + 1e-6), max=1.0))
        else:
            clip_grads_with_norm_(owned, clip_grad_norm, norm)
    optimizer.step()
    if scheduler is not None:  # a skipped step does not advance the schedule
        scheduler.step()
