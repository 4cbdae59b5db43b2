"""An independent reference: one process, plain PyTorch, gradient accumulation; and the two
ways a test trains the pipeline it compares with it: on Ray (:func:`on_ray`), or in one process
through the step runner that trains (:func:`in_process`, :class:`InterpretedTrainer`)."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

import raypipe
from raypipe.checkpoint.store import latest_checkpoint, read_layer, read_manifest, write_manifest
from raypipe.core.loss_scale import LossScaler
from raypipe.core.result import StepResult
from raypipe.core.step_decision import OVERFLOW
from raypipe.observability.step_report import build_step_result
from raypipe.testing.op_interpreter import OpInterpreter


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


def adamw(params) -> torch.optim.AdamW:
    """The optimizer of the equivalence tests: AdamW with weight decay (state that must carry over)."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def random_batches(batch_size: int, steps: int = 3, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``make_mlp``'s shapes: inputs (batch_size, 8), targets (batch_size, 4)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, 8, generator=generator), torch.randn(batch_size, 4, generator=generator))
            for _ in range(steps)]


def assert_mlp_run_matches_one_process(losses: list, state: dict, batch_size: int, num_micro_batches: int,
                                       clip_grad_norm: float | None = None) -> None:
    """A run of ``make_mlp()`` with ``adamw`` and MSE on ``random_batches(batch_size)``, one
    step per loss, against one process on the same global batches: every step's loss and
    the final parameters (``state`` tensors or, from JSON, lists), to rtol 1e-5."""
    model = make_mlp()
    optimizer = adamw(model.parameters())
    expected = [reference_step(model, optimizer, nn.functional.mse_loss, x, y, num_micro_batches, clip_grad_norm)[0]
                for x, y in random_batches(batch_size, len(losses))]
    torch.testing.assert_close(list(losses), expected, rtol=1e-5, atol=1e-7)
    assert_parameters_match({key: torch.as_tensor(value) for key, value in state.items()}, model.state_dict())


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


def bf16_compute_copy(main: nn.Module) -> nn.Module:
    """A copy of ``main`` whose parameters are bf16 (buffers stay as they are): the
    compute weights of :func:`bf16_main_weights_step`."""
    import copy

    compute = copy.deepcopy(main)
    for parameter in compute.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    return compute


def bf16_main_weights_step(main: nn.Module, compute: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, inputs,
                           targets, num_micro_batches: int, backward_order=None,
                           clip_grad_norm: float | None = None) -> tuple[float, float]:
    """One step of bf16 with fp32 main weights (as Megatron-LM does), in one process.

    ``optimizer`` steps ``main``'s fp32 parameters; ``compute`` (:func:`bf16_compute_copy`)
    gets them cast to bf16 once, at the start of the step. Every micro-batch runs its
    forward with ``compute`` under ``torch.autocast`` (bf16) and its loss in fp32,
    weighted by its share of the batch; the backwards run in ``backward_order``
    (default: first to last; GPipe runs the last micro-batch's first), each adding its
    bf16 gradients into the fp32 main gradients. Then clip (optional) and step.
    Returns (loss, grad norm before clipping).
    """
    pairs = list(zip(compute.parameters(), main.parameters()))
    with torch.no_grad():
        for low, full in pairs:
            low.copy_(full)
    batch = inputs.shape[0]
    losses = []
    for x, y in zip(torch.tensor_split(inputs, num_micro_batches), torch.tensor_split(targets, num_micro_batches)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = compute(x)
        losses.append(loss_fn(outputs.float(), y) * (x.shape[0] / batch))
    for index in range(num_micro_batches) if backward_order is None else backward_order:
        losses[index].backward()
        for low, full in pairs:
            full.grad = low.grad.float() if full.grad is None else full.grad.add_(low.grad.float())
            low.grad = None
    grads = [p.grad for p in main.parameters() if p.grad is not None]
    norm = (torch.nn.utils.clip_grad_norm_(main.parameters(), clip_grad_norm) if clip_grad_norm is not None
            else torch.nn.utils.get_total_norm(grads))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sum(loss.item() for loss in losses), float(norm)


# -- every bit of a trainer's state ----------------------------------------------


def checkpoint_state(trainer, root, num_layers):
    trainer.save_checkpoint(root)
    return [read_layer(root, trainer.step_count, index) for index in range(num_layers)]


def assert_bitwise_equal(before, after, where="state"):
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor) and after.dtype == before.dtype and torch.equal(before, after), where
    elif isinstance(before, dict):
        assert isinstance(after, dict) and before.keys() == after.keys(), where
        for key in before:
            assert_bitwise_equal(before[key], after[key], f"{where}.{key}")
    elif isinstance(before, (list, tuple)):
        assert len(before) == len(after), where
        for index, (a, b) in enumerate(zip(before, after)):
            assert_bitwise_equal(a, b, f"{where}[{index}]")
    else:
        assert before == after, where


def executor_options(name: str) -> dict:
    """The config fields of an executor a test names: a transport, or "p2p-tasks" (the
    per-step executor with its calls sent as actor tasks instead of over a
    connection to each worker)."""
    transport, _, step_calls = name.partition("-")
    return {"transport": transport, **({"step_calls": step_calls} if step_calls else {})}


def trainer_loss_scaler(config: raypipe.PipelineConfig) -> LossScaler | None:
    """fp16: the trainer's dynamic loss scale, lowered on an overflow and grown after clean steps; else None."""
    return LossScaler(config.initial_loss_scale, config.growth_interval,
                      min_scale=config.min_loss_scale) if config.precision == "fp16" else None


def trainer_step_result(step: int, decision, config: raypipe.PipelineConfig, loss_scale: float | None,
                        reports: list) -> StepResult:
    """The :class:`StepResult` the driver builds from the workers' ``reports`` and their ``decision``
    (timings and throughput aside)."""
    return build_step_result(
        step=step, loss=decision.loss, grad_norm=decision.grad_norm, max_norm=config.clip_grad_norm,
        skip_reason=decision.skip_reason, loss_scale=loss_scale, step_time=1.0, num_samples=0, num_tokens=0,
        reports=reports, num_parameters=0, peak_flops=None, num_devices=1)


class InterpretedTrainer:
    """The trainer's step on :class:`OpInterpreter` (the step runner that trains, over the in-memory
    channel): what a Ray run adds no arithmetic to. Its steps give the trainer's :class:`StepResult`
    (built from the workers' reports and decision as the driver builds it), so a cell moved off Ray
    keeps its assertions."""

    def __init__(self, layers, loss_fn, optimizer_factory, config: raypipe.PipelineConfig, **options) -> None:
        self.pipeline = OpInterpreter(list(layers), loss_fn, optimizer_factory, config, **options)
        self.config, self.step_count = config, 0
        self.scaler = trainer_loss_scaler(config)

    def step(self, inputs, targets) -> StepResult:
        if self.scaler is not None:
            self.pipeline.loss_scale = self.scaler.scale
        decision = self.pipeline.step(self.step_count, inputs, targets)
        if self.scaler is not None:
            self.scaler.update(decision.skip_reason == OVERFLOW)
        self.step_count += 1
        return trainer_step_result(self.step_count - 1, decision, self.config, self.pipeline.loss_scale,
                                   self.pipeline.reports)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.pipeline.state_dict()

    def save_checkpoint(self, root_uri) -> int:
        """The first replica's layer files (with ZeRO-1 every other replica's optimizer parts too),
        each written by its worker as on Ray, and the manifest with the trainer's state (what
        :func:`checkpoint_state` and :meth:`load_checkpoint` read); returns the step saved."""
        parts = self.config.num_replicas if self.config.shard_optimizer else 1
        writers = self.pipeline.workers if parts > 1 else self.pipeline.replicas[0].workers
        layer_files, blobs = {}, []
        for worker in writers:
            started = worker.start_checkpoint(str(root_uri), self.step_count)
            written = worker.checkpoint_files(self.step_count, started)
            layer_files.update(written.layers)
            blobs.extend(written.blobs)
        extra = {"step_count": self.step_count, "scaler": self.scaler.state_dict() if self.scaler else None,
                 "optimizer_parts": parts}
        write_manifest(root_uri, self.step_count, layer_files, extra, blobs)
        return self.step_count

    def load_checkpoint(self, root_uri, step: int | None = None) -> dict:
        """Checkpoint ``step`` (default: the newest), whatever partition and replicas saved it (on Ray
        or here), loaded by every worker as on Ray, with the trainer's step count and loss scale;
        returns its extra state."""
        step = latest_checkpoint(str(root_uri)) if step is None else step
        extra = read_manifest(str(root_uri), step).get("extra", {})
        for worker in self.pipeline.workers:
            worker.load_checkpoint(str(root_uri), step, extra.get("optimizer_parts", 1))
        self.step_count = extra.get("step_count", step)
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        return extra


def on_ray(layers, loss_fn, optimizer_factory, config: raypipe.PipelineConfig, **options):
    """A trainer on Ray (a context manager, as the in-process one below)."""
    return raypipe.PipelineTrainer(layers, loss_fn, optimizer_factory, config, **options)


def in_process(layers, loss_fn, optimizer_factory, config: raypipe.PipelineConfig, **options):
    """An :class:`InterpretedTrainer`, as a context manager."""
    return contextlib.nullcontext(InterpretedTrainer(layers, loss_fn, optimizer_factory, config, **options))
