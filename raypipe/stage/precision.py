"""Mixed precision inside a stage: the autocast context of its forward, and the
weights its layers compute with.

The layers' own parameters are always the fp32 main weights: the optimizer,
state dicts, checkpoints and the optimizer-state gather/scatter see only them.
What a layer computes with is :func:`compute_weights`' choice, made once per
stage from the precision:

* fp32, fp16: :class:`ModuleWeights`, the parameters themselves (fp16 runs
  under autocast, which casts them per forward).
* bf16: :class:`Bf16ComputeWeights`, as Megatron-LM does: one bf16 copy of
  the weights shared by every micro-batch of a step, gradients added into fp32
  main gradients as autograd finishes each one, the copy refreshed from the
  main weights after every optimizer step and load.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.func import functional_call

from raypipe.stage.measure import storage_pointers

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The forward context of a stage: autocast for bf16/fp16, nothing for fp32.

    Ops whose inputs are fp32 (activations, buffers such as rotary tables)
    still run in the low-precision dtype.
    """
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


class ModuleWeights:
    """The layers compute with their own parameters (fp32, and fp16 under autocast)."""

    def run(self, position: int, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Layer ``position`` of the stage on ``hidden``."""
        return layer(hidden)

    def refresh(self) -> None:
        """After an optimizer step or a load: nothing to recast."""

    def storages(self) -> set[int]:
        """Storages of weights that are not the layers' parameters: none."""
        return set()


class Bf16ComputeWeights(ModuleWeights):
    """bf16 compute weights over the layers' fp32 main weights.

    Per layer, a bf16 copy of every floating-point parameter, made once and
    refreshed (copied in place) from the main weights after every optimizer
    step and every load. Every micro-batch's forward uses the same copies, so
    a kept graph holds no weight copy of its own (autocast, by contrast, casts
    fp32 weights again in every forward). Buffers stay the module's own.

    A copy's gradient is added into its main parameter's ``.grad`` in fp32 as
    soon as autograd has finished it (a post-accumulate-grad hook) and then
    dropped: bf16 gradients never sum across micro-batches, at most one lives
    at a time, and a backward that fails half-way leaves none behind (the
    partial main gradients are dropped with the step).
    """

    def __init__(self, layers: nn.ModuleList, device: torch.device) -> None:
        self._copies: list[dict[str, torch.Tensor]] = []
        self._pairs: list[tuple[torch.Tensor, nn.Parameter]] = []  # (bf16 copy, fp32 main)
        for layer in layers:
            copies = {}
            for name, main in layer.named_parameters():
                if not main.is_floating_point():
                    continue
                copy = main.detach().to(device=device, dtype=torch.bfloat16).requires_grad_(main.requires_grad)
                if main.requires_grad:
                    copy.register_post_accumulate_grad_hook(functools.partial(_add_into_main, main))
                copies[name] = copy
                self._pairs.append((copy, main))
            self._copies.append(copies)

    def run(self, position: int, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return functional_call(layer, self._copies[position], (hidden,), strict=False)

    @torch.no_grad()
    def refresh(self) -> None:
        """Recast the main weights into the copies (after a step or a load)."""
        for copy, main in self._pairs:
            copy.copy_(main)

    def storages(self) -> set[int]:
        """The copies' storages: static memory, like parameters, not held for backward."""
        return storage_pointers(copy for copy, _ in self._pairs)


def _add_into_main(main: nn.Parameter, copy: torch.Tensor) -> None:
    """Add a bf16 copy's finished gradient into the fp32 main gradient, then drop it."""
    if main.grad is None:
        main.grad = copy.grad.to(main.dtype)
    else:
        main.grad.add_(copy.grad)  # computed in fp32: bf16 -> fp32 is exact
    copy.grad = None


_COMPUTE_WEIGHTS = {"bf16": Bf16ComputeWeights}


def compute_weights(precision: str, layers: nn.ModuleList, device: torch.device) -> ModuleWeights:
    """The weights a stage's layers compute with, for ``precision``."""
    kind = _COMPUTE_WEIGHTS.get(precision)
    return ModuleWeights() if kind is None else kind(layers, device)
