"""Mixed precision inside a stage: the autocast context of its forward, and the
weights its layers compute with.

The layers' own parameters are the fp32 main weights: the optimizer, state
dicts, checkpoints and the optimizer-state gather/scatter see them. What a
layer computes with is :func:`compute_weights`' choice, made once per stage
from the precision:

* fp32, fp16: :class:`ModuleWeights`, the parameters themselves (fp16 runs
  under autocast, which casts them per forward).
* bf16: :class:`Bf16ComputeWeights`, as Megatron-LM does: one bf16 copy of
  the weights shared by every micro-batch of a step, gradients added into fp32
  main gradients as autograd finishes each one, the copy refreshed from the
  main weights after every optimizer step and load. With ZeRO-1 a replica
  keeps the fp32 main weight of the parameters it owns only: each other
  parameter of its layers *is* its bf16 compute weight, which the owner's
  all-gather sets after every step (Megatron's distributed optimizer).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

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

    def copies(self) -> list[torch.Tensor]:
        """Weights that are not the layers' parameters: none."""
        return []

    def storages(self) -> set[int]:
        """Storages of :meth:`copies` (static memory, like parameters, not held for backward)."""
        return storage_pointers(self.copies())

    def gradient(self, parameter: nn.Parameter) -> torch.Tensor | None:
        """The fp32 gradient accumulated so far this step for a trainable parameter."""
        return parameter.grad

    def drop_gradients(self) -> None:
        """At the end of a step: gradients kept outside ``.grad``: none."""

    def compute_weight(self, parameter: nn.Parameter) -> torch.Tensor:
        """What the layers compute with for ``parameter`` (what ZeRO-1 owners share after a step)."""
        return parameter

    def without_main(self, position: int) -> frozenset[str]:
        """Names of layer ``position``'s parameters held here only as compute weights
        (no full-precision value: left out of state dicts and checkpoints)."""
        return frozenset()

    def mains_only_here(self, position: int) -> frozenset[str]:
        """Names of layer ``position``'s parameters whose main weight no other replica
        keeps (ZeRO-1's owner, where mains are not the compute weights)."""
        return frozenset()


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

    ``owned`` (ZeRO-1: whether this replica owns a trainable parameter; None:
    unsharded, it owns all): a parameter it does not own becomes its own bf16
    compute weight (2 bytes instead of 4 + 2), and its fp32 gradient accumulates
    outside ``.grad`` (the parameter is bf16), in :meth:`gradient`.
    """

    def __init__(self, layers: nn.ModuleList, device: torch.device,
                 owned: Callable[[nn.Parameter], bool] | None = None) -> None:
        self._copies: list[dict[str, torch.Tensor]] = []
        self._pairs: list[tuple[torch.Tensor, nn.Parameter]] = []  # (bf16 copy, fp32 main)
        self._compute_of: dict[nn.Parameter, torch.Tensor] = {}
        self._main_gradients: dict[nn.Parameter, torch.Tensor] = {}  # of parameters without a main weight
        self._without_main: list[frozenset[str]] = []
        self._mains_only_here: list[frozenset[str]] = []
        for layer in layers:
            copies, without, only_here = {}, set(), set()
            for name, main in layer.named_parameters():
                if not main.is_floating_point():
                    continue
                if main.requires_grad and owned is not None:
                    (only_here if owned(main) else without).add(name)
                copies[name] = self._compute_only(main, device) if name in without else self._copy_of(main, device)
                self._compute_of[main] = copies[name]
            self._copies.append(copies)
            self._without_main.append(frozenset(without))
            self._mains_only_here.append(frozenset(only_here))

    def _copy_of(self, main: nn.Parameter, device: torch.device) -> torch.Tensor:
        copy = main.detach().to(device=device, dtype=torch.bfloat16).requires_grad_(main.requires_grad)
        if main.requires_grad:
            copy.register_post_accumulate_grad_hook(functools.partial(_add_into_main, main))
        self._pairs.append((copy, main))
        return copy

    def _compute_only(self, parameter: nn.Parameter, device: torch.device) -> nn.Parameter:
        parameter.data = parameter.data.to(device=device, dtype=torch.bfloat16)
        parameter.register_post_accumulate_grad_hook(self._accumulate_outside_grad)
        return parameter

    def _accumulate_outside_grad(self, parameter: nn.Parameter) -> None:
        """Add a compute-only parameter's finished bf16 gradient into its fp32 main gradient."""
        main_gradient = self._main_gradients.get(parameter)
        if main_gradient is None:
            self._main_gradients[parameter] = parameter.grad.to(torch.float32)
        else:
            main_gradient.add_(parameter.grad)
        parameter.grad = None

    def run(self, position: int, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return functional_call(layer, self._copies[position], (hidden,), strict=False)

    @torch.no_grad()
    def refresh(self) -> None:
        """Recast the main weights into the copies (after a step or a load)."""
        for copy, main in self._pairs:
            copy.copy_(main)

    def copies(self) -> list[torch.Tensor]:
        """The bf16 copies of the main weights this worker keeps."""
        return [copy for copy, _ in self._pairs]

    def gradient(self, parameter: nn.Parameter) -> torch.Tensor | None:
        main_gradient = self._main_gradients.get(parameter)
        return parameter.grad if main_gradient is None else main_gradient

    def drop_gradients(self) -> None:
        self._main_gradients.clear()

    def compute_weight(self, parameter: nn.Parameter) -> torch.Tensor:
        return self._compute_of[parameter]

    def without_main(self, position: int) -> frozenset[str]:
        return self._without_main[position]

    def mains_only_here(self, position: int) -> frozenset[str]:
        return self._mains_only_here[position]


def _add_into_main(main: nn.Parameter, copy: torch.Tensor) -> None:
    """Add a bf16 copy's finished gradient into the fp32 main gradient, then drop it."""
    if main.grad is None:
        main.grad = copy.grad.to(main.dtype)
    else:
        main.grad.add_(copy.grad)  # computed in fp32: bf16 -> fp32 is exact
    copy.grad = None


_COMPUTE_WEIGHTS = {"bf16": Bf16ComputeWeights}


def compute_weights(precision: str, layers: nn.ModuleList, device: torch.device,
                    owned: Callable[[nn.Parameter], bool] | None = None) -> ModuleWeights:
    """The weights a stage's layers compute with, for ``precision``. ``owned``
    (ZeRO-1): whether this replica owns a trainable parameter, and so keeps its
    main weight where that is not the compute weight; None: unsharded."""
    kind = _COMPUTE_WEIGHTS.get(precision)
    return ModuleWeights() if kind is None else kind(layers, device, owned)
