"""Layers whose forward, input-gradient and weight-gradient each take a fixed time
without using a core.

Each timed part is a ``time.sleep``, which releases the GIL and the CPU: p stage
processes (or threads) running these layers on a machine with fewer than p cores
behave as p devices, and a pipeline step's time is its schedule's critical path
plus the system's own overhead (messages, driver, Python). The arithmetic is real
but tiny (``y = x * w + b`` elementwise over ``width`` features), so gradients
can be checked against the same math in plain PyTorch.

The backward is split the way ``torch.distributed.pipelining``'s zero-bubble
schedules split it: one autograd node on the input path sleeps ``input_grad_s``
and another on the weight path sleeps ``weight_grad_s``, so
``torch.autograd.grad(out, inputs)`` (an I op) pays only the input-gradient time
and ``torch.autograd.grad(out, weights)`` (a W op) only the weight-gradient time;
a plain ``loss.backward()`` (an unsplit B) pays both.

A slow worker (a throttled device, a noisy neighbour) is :func:`slow_down`: every timed
sleep in the process it runs in takes a factor longer from then on, the arithmetic unchanged,
so a run's losses do not move (``raypipe.testing.fault_injection.slow_down_worker`` runs it
inside one Ray worker).

Caveats: ``time.sleep`` overshoots by its granularity (about 0.1 ms on Linux, more
on a loaded machine), and Python and autograd overhead add to every op, so a
measured op takes a little longer than its nominal time, never less.
"""
from __future__ import annotations

import time

import torch
from torch import nn


_slowdown = 1.0  # every timed sleep of this process is this many times its nominal time (slow_down)


def slow_down(factor: float) -> None:
    """From now on every timed layer in this process sleeps ``factor`` times its nominal times
    (1: as built); the layers' arithmetic, and so every result, is unchanged."""
    global _slowdown
    if not factor > 0:  # also rejects NaN
        raise ValueError(f"slowdown factor={factor!r}: must be > 0")
    _slowdown = float(factor)


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds * _slowdown)


class _TimedInputPath(torch.autograd.Function):
    """Identity on the activation path: forward sleeps the layer's forward time,
    backward sleeps the input-gradient time and passes the gradient through (a link's
    delay: the same time each way)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, input_grad_s: float) -> torch.Tensor:
        ctx.input_grad_s = input_grad_s
        _sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _sleep(ctx.input_grad_s)
        return grad, None, None


class _TimedWeightPath(torch.autograd.Function):
    """Identity on the weight path: backward sleeps the weight-gradient time and
    passes the weight's gradient through."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, weight_grad_s: float) -> torch.Tensor:
        ctx.weight_grad_s = weight_grad_s
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _sleep(ctx.weight_grad_s)
        return grad, None


def _check_seconds(**named: float) -> None:
    for name, value in named.items():
        if not value >= 0:  # also rejects NaN
            raise ValueError(f"{name}={value!r}: a time in seconds must be >= 0")


class TimedLayer(nn.Module):
    """``y = x * weight + bias`` over the last dimension (``width`` features), whose
    forward takes ``forward_s``, input-gradient ``input_grad_s`` and
    weight-gradient ``weight_grad_s`` seconds, each a sleep that uses no core.

    The weight-gradient sleep covers ``weight`` only (the bias's gradient is free),
    so a weight-only ``autograd.grad`` over both parameters pays ``weight_grad_s``
    once. Over several layers, ``autograd.grad(out, weights)`` from the last
    layer's output also crosses the later layers' input paths; the split backward
    of ``torch.distributed.pipelining`` (``stage_backward_weight``) starts from the
    nodes saved by the input-gradient pass instead and pays ``weight_grad_s`` per
    layer only. See the module docstring for the timing caveats.
    """

    def __init__(self, forward_s: float, input_grad_s: float, weight_grad_s: float, width: int = 8) -> None:
        super().__init__()
        _check_seconds(forward_s=forward_s, input_grad_s=input_grad_s, weight_grad_s=weight_grad_s)
        if width < 1:
            raise ValueError(f"width={width!r}: must be >= 1")
        self.forward_s = float(forward_s)
        self.input_grad_s = float(input_grad_s)
        self.weight_grad_s = float(weight_grad_s)
        self.width = width
        # drawn from the global generator, like nn.Linear: torch.manual_seed fixes them
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(width))
        self.bias = nn.Parameter(0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _TimedInputPath.apply(x, self.forward_s, self.input_grad_s)
        weight = _TimedWeightPath.apply(self.weight, self.weight_grad_s)
        return x * weight + self.bias

    def extra_repr(self) -> str:
        return (f"width={self.width}, forward_s={self.forward_s}, input_grad_s={self.input_grad_s}, "
                f"weight_grad_s={self.weight_grad_s}")


class TimedBoundary(nn.Module):
    """An identity that sleeps ``seconds`` in forward and again in backward: placed
    between two stages' layers, it stands for the link's delay each way (it runs
    on the sending stage's time, as a blocking send would)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        _check_seconds(seconds=seconds)
        self.seconds = float(seconds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TimedInputPath.apply(x, self.seconds, self.seconds)  # a link's delay each way

    def extra_repr(self) -> str:
        return f"seconds={self.seconds}"


def timed_model(num_layers: int, forward_s: float, input_grad_s: float, weight_grad_s: float,
                width: int = 8) -> nn.Sequential:
    """``num_layers`` :class:`TimedLayer` in a row, each with the given times; the
    input is ``(batch, width)``. Seed with ``torch.manual_seed`` for fixed weights."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r}: must be >= 1")
    return nn.Sequential(*[TimedLayer(forward_s, input_grad_s, weight_grad_s, width) for _ in range(num_layers)])
