"""LayerSpec: a layer described on the driver and built inside its stage actor."""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn

from raypipe.errors import ConfigError

if TYPE_CHECKING:  # DTensor's import takes half a second: only runs that split layers pay it
    from torch.distributed.tensor.parallel import ParallelStyle


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs for ONE SEQUENCE of the run's length (a micro-batch of b
    sequences costs b times as much), which ``PipelineConfig(balance="time")`` and
    ``raypipe plan`` balance stages by.

    Flops: the forward; the backward's gradient of the input (``bwd_input_flops``: what
    the previous stage waits for) and of the weights (``bwd_weight_flops``). A
    recomputed forward (activation checkpointing) adds ``fwd_flops`` again. Only the
    ratios between layers matter to the balance, so measured seconds (times a
    constant) do as well as flops. Bytes: ``saved_bytes`` what autograd keeps for the
    backward; ``param_bytes`` the weights as the forward uses them; ``output_bytes``
    the output the next layer (or stage) receives.
    """

    fwd_flops: float
    bwd_input_flops: float
    bwd_weight_flops: float
    saved_bytes: int = 0
    param_bytes: int = 0
    output_bytes: int = 0

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"LayerCost.{item.name}", value, "must be a number >= 0")

    @property
    def train_flops(self) -> float:
        """Forward and both backward halves: one training pass of one sequence."""
        return self.fwd_flops + self.bwd_input_flops + self.bwd_weight_flops


# A layer's tensor-parallel plan: the dict ``parallelize_module`` takes (fully qualified names
# inside the layer -> ParallelStyle), or a function of ``sequence_parallel`` giving it, for a
# layer whose plan differs with sequence parallelism on or off (the LLaMA's do).
TensorParallelPlan: TypeAlias = "dict[str, ParallelStyle] | Callable[[bool], dict[str, ParallelStyle]]"


def check_tp_plan(plan: object) -> None:
    """Raise TypeError unless ``plan`` is None, a callable, or a dict of str -> ParallelStyle."""
    if plan is None or callable(plan):
        return
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(plan, dict) or not all(isinstance(key, str) and isinstance(style, ParallelStyle)
                                             for key, style in plan.items()):
        raise TypeError("LayerSpec's tp_plan must be None, a dict of submodule name -> "
                        "torch.distributed.tensor.parallel.ParallelStyle (what parallelize_module takes), "
                        f"or a function of sequence_parallel giving one; got {plan!r}")


class LayerSpec:
    """A recipe for one pipeline layer: ``LayerSpec(cls, *args, cost=None, tp_plan=None, **kwargs)``.

    The layer is only constructed by :meth:`build`, which a stage actor calls,
    so a model too large for the driver's memory is never materialized there.
    ``cost`` (a :class:`LayerCost`, keyword only and never passed to ``cls``) is
    what ``PipelineConfig(balance="time")`` balances stages by. ``tp_plan``
    (keyword only, never passed to ``cls``) is how the layer is split over a
    stage's tensor-parallel ranks (:data:`TensorParallelPlan`, applied by
    :func:`raypipe.models.tensor_parallel.parallelize_layer`); None: the layer is
    replicated on them.
    """

    tp_plan: TensorParallelPlan | None = None  # also what a spec pickled before plans existed has

    def __init__(self, cls: type[nn.Module], *args: Any, cost: LayerCost | None = None,
                 tp_plan: TensorParallelPlan | None = None, **kwargs: Any) -> None:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {cls!r}")
        if cost is not None and not isinstance(cost, LayerCost):
            raise TypeError(f"LayerSpec's cost must be a raypipe.LayerCost or None, got {cost!r}")
        check_tp_plan(tp_plan)
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.cost = cost
        self.tp_plan = tp_plan

    def with_cost(self, cost: LayerCost | None) -> LayerSpec:
        """A copy of this recipe (of its subclass too, e.g. a pretrained layer) with ``cost``."""
        if cost is not None and not isinstance(cost, LayerCost):
            raise TypeError(f"LayerSpec's cost must be a raypipe.LayerCost or None, got {cost!r}")
        spec = copy.copy(self)
        spec.cost = cost
        return spec

    def with_tp_plan(self, tp_plan: TensorParallelPlan | None) -> LayerSpec:
        """A copy of this recipe (of its subclass too) with the tensor-parallel plan ``tp_plan``."""
        check_tp_plan(tp_plan)
        spec = copy.copy(self)
        spec.tp_plan = tp_plan
        return spec

    def build(self, device: torch.device | str | None = None) -> nn.Module:
        """Construct the layer (on ``device`` when given; "meta" allocates nothing) with the weights
        it is to start from: for a plain spec its class's initial ones (:meth:`construct`)."""
        return self.construct(device)

    def construct(self, device: torch.device | str | None = None) -> nn.Module:
        """The layer as its class constructs it (on ``device`` when given), nothing read into it."""
        if device is None:
            return self.cls(*self.args, **self.kwargs)
        with torch.device(device):
            return self.cls(*self.args, **self.kwargs)

    def load_weights(self, module: nn.Module) -> None:
        """Read the weights this layer starts from into ``module`` (:meth:`construct`'s, possibly
        split over a tensor-parallel mesh since): nothing for a plain spec, whose class's initial
        weights are its own; a pretrained layer reads each parameter's part that ``module`` holds."""

    def num_parameters(self) -> int:
        """Parameter count, computed on the meta device without allocating weights."""
        return sum(p.numel() for p in self.build("meta").parameters())

    def __repr__(self) -> str:
        return f"LayerSpec({self.cls.__name__})"


def layer_parameter_count(layer: nn.Module | LayerSpec) -> int:
    """Parameters of a built module or of a spec (the latter on the meta device)."""
    if isinstance(layer, LayerSpec):
        return layer.num_parameters()
    return sum(p.numel() for p in layer.parameters())


def build_layer(layer: nn.Module | LayerSpec, index: int, seed: int, read_weights: bool = True) -> nn.Module:
    """The module for global layer ``index``; a spec is built with a seed derived
    from ``(seed, "init", index)``, so initial weights do not depend on the partition.
    ``read_weights=False``: a spec's layer is only constructed; its weights are read later
    (:meth:`LayerSpec.load_weights`, e.g. once split over a tensor-parallel mesh)."""
    if not isinstance(layer, LayerSpec):
        return layer
    from raypipe.core.seeding import derive_seed

    torch.manual_seed(derive_seed(seed, "init", index))
    return layer.build() if read_weights else layer.construct()


def model_layers(model: Any) -> tuple[list, list[str]]:
    """The model's layers and their names (the prefixes of their state-dict keys)."""
    if isinstance(model, nn.Sequential):
        names = list(model._modules)
        return [model._modules[name] for name in names], names
    if isinstance(model, nn.Module):
        raise ConfigError("model", type(model).__name__,
                          "must be an nn.Sequential, a list of nn.Module, or a list of raypipe.LayerSpec")
    layers = list(model)
    for index, layer in enumerate(layers):
        if not isinstance(layer, (nn.Module, LayerSpec)):
            raise ConfigError(f"model[{index}]", type(layer).__name__, "must be an nn.Module or a raypipe.LayerSpec")
    return layers, [str(i) for i in range(len(layers))]


def split_state_by_layer(state_dict: dict[str, torch.Tensor], names: list[str]) -> dict[int, dict]:
    index_of = {name: index for index, name in enumerate(names)}
    per_layer: dict[int, dict] = {index: {} for index in range(len(names))}
    for key, value in state_dict.items():
        prefix, _, rest = key.partition(".")
        if prefix not in index_of or not rest:
            raise KeyError(f"unexpected key {key!r} in state_dict: layers are named {names[:5]}...")
        per_layer[index_of[prefix]][rest] = value
    return per_layer
