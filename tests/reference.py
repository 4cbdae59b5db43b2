"""An independent reference: one process, plain PyTorch, gradient accumulation."""
from __future__ import annotations

import torch
from torch import nn


def reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, inputs, targets,
                   num_micro_batches: int, clip_grad_norm: float | None = None) -> tuple[float, float]:
    """One optimizer step over the global batch; returns (loss, grad norm before clipping)."""
    batch = inputs.shape[0]
    total_loss = 0.0
    for x, y in zip(torch.tensor_split(inputs, num_micro_batches), torch.tensor_split(targets, num_micro_batches)):
        loss = loss_fn(model(x), y) * (x.shape[0] / batch)
        loss.backward()
        total_loss += loss.item()
    if clip_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total_loss, float(norm)


def make_mlp(seed: int = 0, width: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, width), nn.Tanh(),
        nn.Linear(width, width), nn.GELU(),
        nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, 4),
    )


def assert_parameters_match(actual: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


class ReplaceGradientIf(torch.autograd.Function):
    """Identity in forward; in backward, ``replace(grad)`` instead of ``grad`` when
    ``active``: a fault injected into one micro-batch's backward pass."""

    @staticmethod
    def forward(ctx, tensor, active, replace):
        ctx.active, ctx.replace = active, replace
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        return (ctx.replace(grad) if ctx.active else grad), None, None
