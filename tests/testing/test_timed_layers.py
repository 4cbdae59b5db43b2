"""Timed layers: the math is plain ``x * w + b`` (bitwise against PyTorch without the
sleeps), and each part of the step pays its own sleep and no other. Which sleeps an
op pays is checked exactly by recording them; wall-clock checks use generous bounds
(50 ms against 150 ms and more), since the machine may be loaded."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from raypipe.testing import TimedBoundary, TimedLayer, timed_model
from raypipe.testing import timed_layers

WIDTH = 6


class PlainLayer(nn.Module):
    """The reference: the same math and the same weights, no sleeps, no custom nodes."""

    def __init__(self, timed: TimedLayer) -> None:
        super().__init__()
        self.weight = nn.Parameter(timed.weight.detach().clone())
        self.bias = nn.Parameter(timed.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    """Every sleep the timed layers ask for, in order (and none actually taken)."""
    record: list[float] = []
    monkeypatch.setattr(timed_layers, "_sleep", record.append)
    return record


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(5, WIDTH, generator=generator), torch.randn(5, WIDTH, generator=generator)


def test_gradients_equal_plain_pytorch_bitwise(slept):
    torch.manual_seed(0)
    timed = timed_model(3, 0.01, 0.02, 0.03, WIDTH)
    plain = nn.Sequential(*[PlainLayer(layer) for layer in timed])
    inputs, targets = _batch()
    results = []
    for model in (timed, plain):
        x = inputs.clone().requires_grad_()
        out = model(x)
        loss = nn.functional.mse_loss(out, targets)
        loss.backward()
        results.append((out.detach(), loss.detach(), x.grad, [p.grad for p in model.parameters()]))
    (out_t, loss_t, dx_t, grads_t), (out_p, loss_p, dx_p, grads_p) = results
    assert torch.equal(out_t, out_p) and torch.equal(loss_t, loss_p) and torch.equal(dx_t, dx_p)
    assert len(grads_t) == len(grads_p) == 6
    for timed_grad, plain_grad in zip(grads_t, grads_p):
        assert torch.equal(timed_grad, plain_grad)


def test_split_backward_equals_unsplit_bitwise():
    """I then W (two autograd.grad calls, the graph kept for W) gives the unsplit gradients."""
    torch.manual_seed(0)
    layer = TimedLayer(0, 0, 0, WIDTH)
    inputs, targets = _batch()
    x = inputs.clone().requires_grad_()
    loss = nn.functional.mse_loss(layer(x), targets)
    (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
    dw, db = torch.autograd.grad(loss, [layer.weight, layer.bias])
    x2 = inputs.clone().requires_grad_()
    nn.functional.mse_loss(layer(x2), targets).backward()
    assert torch.equal(dx, x2.grad) and torch.equal(dw, layer.weight.grad) and torch.equal(db, layer.bias.grad)


def test_each_op_pays_only_its_own_sleep(slept):
    layer = TimedLayer(forward_s=0.1, input_grad_s=0.2, weight_grad_s=0.3, width=WIDTH)
    x = torch.randn(2, WIDTH, requires_grad=True)
    out = layer(x).sum()
    assert slept == [0.1]
    torch.autograd.grad(out, [x], retain_graph=True)
    assert slept == [0.1, 0.2]
    torch.autograd.grad(out, [layer.weight, layer.bias], retain_graph=True)
    assert slept == [0.1, 0.2, 0.3]
    out.backward()  # unsplit B: both
    assert sorted(slept[3:]) == [0.2, 0.3]


def test_pipelining_split_backward_pays_input_then_weight_per_layer(slept):
    """torch.distributed.pipelining's own I and W helpers (as its zero-bubble schedules call
    them): over a two-layer stage, I pays the input-gradient sleep of each layer, W the weight one."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    stage = timed_model(2, 0.1, 0.2, 0.3, WIDTH)
    x = torch.randn(2, WIDTH, requires_grad=True)
    out = stage(x)
    slept.clear()
    _, param_groups = stage_backward_input([out], [torch.ones_like(out)], [x], stage.parameters())
    assert slept == [0.2, 0.2]
    stage_backward_weight(stage.parameters(), param_groups)
    assert slept == [0.2, 0.2, 0.3, 0.3]


def test_boundary_sleeps_each_way_and_passes_the_gradient(slept):
    boundary = TimedBoundary(0.05)
    x = torch.randn(3, WIDTH, requires_grad=True)
    out = boundary(x)
    assert torch.equal(out, x) and slept == [0.05]
    grad = torch.randn(3, WIDTH)
    out.backward(grad)
    assert torch.equal(x.grad, grad) and slept == [0.05, 0.05]


def test_forward_and_input_gradient_take_their_time():
    layer = TimedLayer(forward_s=0.05, input_grad_s=0.05, weight_grad_s=0.25, width=WIDTH)
    x = torch.randn(2, WIDTH, requires_grad=True)
    start = time.perf_counter()
    out = layer(x).sum()
    forward = time.perf_counter() - start
    start = time.perf_counter()
    torch.autograd.grad(out, [x], retain_graph=True)
    input_grad = time.perf_counter() - start
    start = time.perf_counter()
    torch.autograd.grad(out, [layer.weight])
    weight_grad = time.perf_counter() - start
    assert forward >= 0.05
    assert 0.05 <= input_grad < 0.2, "an input-gradient-only grad must not pay the weight-gradient sleep"
    assert weight_grad >= 0.25


def test_two_threads_overlap():
    """Sleeping uses no core and releases the GIL: two threads stepping timed layers
    take about one's time, not two (what lets p stage processes behave as p devices)."""
    def step() -> None:
        layer = TimedLayer(0.1, 0.1, 0.1, WIDTH)
        layer(torch.randn(2, WIDTH, requires_grad=True)).sum().backward()  # 0.3 s of sleeps

    threads = [threading.Thread(target=step) for _ in range(2)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    assert 0.3 <= wall < 0.5, f"two threads of 0.3 s each took {wall:.3f} s: they did not overlap"


@pytest.mark.parametrize("make", [lambda: TimedLayer(-1, 0, 0), lambda: TimedLayer(0, float("nan"), 0),
                                  lambda: TimedLayer(0, 0, 0, width=0), lambda: TimedBoundary(-0.1),
                                  lambda: timed_model(0, 0, 0, 0)])
def test_bad_arguments_name_the_cause(make):
    with pytest.raises(ValueError, match=r"^(forward_s|input_grad_s|width|seconds|num_layers)="):
        make()


def test_slow_down_scales_every_sleep_of_the_process_and_not_the_math(monkeypatch):
    """A slow worker: each forward, input-gradient and weight-gradient sleep takes ``factor`` times its
    time; the outputs and gradients are those of the unslowed layer, bitwise."""
    taken: list[float] = []
    monkeypatch.setattr(timed_layers.time, "sleep", taken.append)
    monkeypatch.setattr(timed_layers, "_slowdown", 1.0)  # undone after the test, whatever it set
    torch.manual_seed(0)
    layer = TimedLayer(0.01, 0.02, 0.03, WIDTH)
    inputs, targets = _batch()
    grads = []
    for factor in (1.0, 2.5):
        timed_layers.slow_down(factor)
        layer.zero_grad()
        nn.functional.mse_loss(layer(inputs.clone().requires_grad_()), targets).backward()
        grads.append([parameter.grad.clone() for parameter in layer.parameters()])
    # per step: the forward's sleep first, then the two gradients' (in autograd's order)
    assert [taken[0], *sorted(taken[1:3])] == pytest.approx([0.01, 0.02, 0.03])
    assert [taken[3], *sorted(taken[4:])] == pytest.approx([0.025, 0.05, 0.075])
    assert all(torch.equal(unslowed, slowed) for unslowed, slowed in zip(*grads))
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="must be > 0"):
            timed_layers.slow_down(bad)
