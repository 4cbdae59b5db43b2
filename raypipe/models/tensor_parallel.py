"""Tensor parallelism inside a stage: a layer's plan applied with PyTorch's DTensor.

A stage's ``t`` tensor-parallel ranks (one :class:`~torch.distributed.device_mesh.DeviceMesh`
of ``t`` devices) each hold a shard of every layer that has a plan
(``LayerSpec(..., tp_plan=...)``, :data:`~raypipe.models.layers.TensorParallelPlan`: the
dict ``torch.distributed.tensor.parallel.parallelize_module`` takes, or a function of
``sequence_parallel`` giving one) and a whole copy of every layer that has none. What this
module gives the stage:

- :func:`parallelize_layer`: the plan applied to one built layer, after the stage's
  tensor-parallel group exists. ``src_data_rank=None``: every rank built the same full
  initial weights (the per-layer seeding of :func:`~raypipe.models.layers.build_layer`)
  and keeps its own shard of them, so nothing is scattered.
- :func:`check_tensor_parallel`: whether ``t`` can split a model (run before any actor).
- :func:`loss_parallel_scope` and :func:`local_loss`: vocabulary-parallel cross entropy
  over ``Shard(-1)`` logits, whose fp32 logits are never gathered whole.
- :func:`redistribute_gradients`: each gradient put into its parameter's layout, before
  the step reduces, clips or steps on them.
- :func:`full_state_dict`: whole tensors, keys as without tensor parallelism.

The layout between layers: every layer takes and returns *local* tensors. With sequence
parallelism the floating-point activations are sharded along the sequence (dimension 1:
rank ``i`` holds the ``i``-th ``T/t`` positions, so ``T`` must divide by ``t``); without it
they are whole and identical on every rank. Across a stage boundary they are sharded either
way, so each rank sends ``1/t`` of the floating-point bytes: without sequence parallelism
the layer before the boundary cuts the rank's slice of the whole activation and the layer
after it gathers the slices over the stage's mesh (Megatron's scatter-gather; the gradient
crossing back is a slice too, gathered by the cut's backward), and ``T`` must divide by
``t`` where there is a boundary. Integer leaves of a tuple (a packed micro-batch's positions
and document ids) always travel whole.
The model's input (the micro-batch) reaches its first layer whole on every rank, and the
loss reads its last layer's output as that layer returns it: the LLaMA's embedding takes
the token ids whole and its head returns the logits as a ``Shard(-1)`` DTensor (the
vocabulary split over the ranks) for loss parallelism.

A layer without a plan is replicated: under sequence parallelism its floating-point
inputs are gathered along the sequence before it (not before the model's first layer,
whose input is whole) and its outputs sharded after it (not after the model's last
layer, whose output the loss reads whole), so it sees the whole
sequence (a layer that mixes positions would be wrong on a shard) and its gradients are
the same on every rank. This is done with DTensor redistributions in forward hooks on
the layer, not ``PrepareModuleInput``/``PrepareModuleOutput``: those take a module's
positional inputs one by one, and a pipeline layer's one input may be a tuple.

Checks: ``t`` must divide every count a planned layer's modules declare with a
``tensor_parallel_divisors()`` method (the LLaMA's attention: its heads and KV heads),
the sharded width of every planned ``nn.Linear`` whose output is used as a local tensor
(the LLaMA's FFN width, ``dim``), and, under sequence parallelism, the sequence length.
The vocabulary may shard unevenly (the tiny preset's 259 at ``t = 2`` is 130 + 129 rows):
the embedding's row-parallel lookup and the head's ``Shard(-1)`` logits are DTensors,
which keep their global shape, and vocabulary-parallel cross entropy takes uneven
shards, so nothing is padded.

Dropout under tensor parallelism on CPU cannot match one process: DTensor's random-number
coordination (``torch.distributed.tensor._random``) runs on CUDA only, so each rank draws
its own masks; and without sequence parallelism a dropout after a replicated activation
must draw the same mask on every rank (the same seed per stage), or the ranks' copies
drift apart. The exactness tests are dropout-free.
"""
from __future__ import annotations

import contextlib
import fnmatch
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from raypipe.errors import ConfigError
from raypipe.models.layers import LayerSpec, TensorParallelPlan, check_tp_plan, model_layers

SEQUENCE_DIM = 1  # activations are (batch, seq_len, ...): sequence parallelism shards dimension 1

# a recent torch's parallelize_module takes src_data_rank; None: each rank keeps its own shard of its
# own full tensor
_TAKES_SRC_DATA_RANK = "src_data_rank" in inspect.signature(parallelize_module).parameters


def resolve_tp_plan(plan: TensorParallelPlan | None, sequence_parallel: bool) -> dict[str, ParallelStyle] | None:
    """The ``parallelize_module`` dict of ``plan`` for this run (a function of
    ``sequence_parallel`` is called); None when the layer has no plan (or an empty one)."""
    if plan is None:
        return None
    styles = plan(sequence_parallel) if callable(plan) else plan
    check_tp_plan(styles)
    if callable(styles):
        raise TypeError(f"a tp_plan function must return a dict of submodule name -> ParallelStyle, got {styles!r}")
    return dict(styles) or None


def parallelize_layer(module: nn.Module, plan: TensorParallelPlan | None, mesh: DeviceMesh, *,
                      sequence_parallel: bool, first_layer: bool = False, final_layer: bool = False,
                      after_boundary: bool = False, before_boundary: bool = False) -> nn.Module:
    """Split ``module`` (one built pipeline layer, its full initial weights on every rank)
    over the tensor-parallel ``mesh`` (1-D: the stage's ``t`` ranks), in place; returns it.

    With a plan: ``parallelize_module(module, mesh, plan, src_data_rank=None)``, each rank
    keeping its shard of its own (identical) weights. Without one: the layer stays whole on
    every rank; under ``sequence_parallel`` its floating-point inputs are gathered along the
    sequence before it, unless it is the model's ``first_layer`` (the micro-batch comes
    whole), and its outputs sharded after it, unless it is the model's ``final_layer`` (the
    loss reads its output whole). ``first_layer`` and ``final_layer`` are the model's ends,
    not a stage's.

    ``after_boundary``: the layer's input comes from another worker (it starts its stage, or
    a chunk whose previous virtual stage is elsewhere); ``before_boundary``: its output goes
    to another worker. Without ``sequence_parallel`` the activation there is whole on every
    rank, and each rank sends only its ``1/t`` slice along the sequence (Megatron's
    scatter-gather): the output is cut to the rank's slice after a ``before_boundary`` layer
    (not after the model's ``final_layer``) and gathered over ``mesh`` before an
    ``after_boundary`` one (not before the model's ``first_layer``); the gradient crossing
    back is a slice too, gathered on the sending side by the cut's backward. Under
    ``sequence_parallel`` the activation there is a shard already, and nothing is added.

    Every rank of ``mesh`` must call this for the same layers in the same order (it may
    issue collectives).
    """
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_layer needs the stage's 1-D tensor-parallel mesh, got {mesh.ndim} dimensions")
    styles = resolve_tp_plan(plan, sequence_parallel)
    if styles is not None:
        if _TAKES_SRC_DATA_RANK:
            parallelize_module(module, mesh, styles, src_data_rank=None)
        else:  # an older torch scatters rank 0's weights, which equal every rank's
            parallelize_module(module, mesh, styles)
    elif sequence_parallel and mesh.size() > 1:
        if not first_layer:
            module.register_forward_pre_hook(lambda _module, args: _map_activations(args, _gather_sequence, mesh))
        if not final_layer:
            module.register_forward_hook(
                lambda _module, _args, output: _map_activations(output, _shard_sequence, mesh))
    scatter_gather = not sequence_parallel and mesh.size() > 1
    if scatter_gather and after_boundary and not first_layer:
        module.register_forward_pre_hook(lambda _module, args: _map_activations(args, _gather_sequence, mesh))
    # registered after the hooks above: the layer returns plain tensors
    module.register_forward_hook(lambda _module, _args, output: _completed(output))
    if scatter_gather and before_boundary and not final_layer:
        module.register_forward_hook(lambda _module, _args, output: _map_activations(output, _boundary_slice, mesh))
    return module


class _AwaitCollective(torch.autograd.Function):
    """The identity, returning an AsyncCollectiveTensor's waited-for plain tensor."""

    @staticmethod
    def forward(ctx, tensor: AsyncCollectiveTensor) -> torch.Tensor:
        return tensor.trigger_wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _completed(tree: Any) -> Any:
    """``tree`` with each AsyncCollectiveTensor replaced by its plain tensor, waited for.

    The parallel styles redistribute outputs asynchronously, so a layer whose output is
    a collective's (the embedding's lookup, reduce-scattered) would return a tensor
    subclass that waits on first use; a stage sends its output with p2p calls that need
    a plain tensor's storage."""
    if isinstance(tree, AsyncCollectiveTensor):
        return _AwaitCollective.apply(tree) if tree.requires_grad else tree.trigger_wait()
    if isinstance(tree, (tuple, list)):
        return type(tree)(_completed(item) for item in tree)
    if isinstance(tree, dict):
        return {key: _completed(value) for key, value in tree.items()}
    return tree


def _map_activations(tree: Any, function, mesh: DeviceMesh) -> Any:
    """``function(tensor, mesh)`` on each floating-point local tensor of a tuple/list/dict tree."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and not isinstance(tree, DTensor) and tree.dim() > SEQUENCE_DIM:
            return function(tree, mesh)
        return tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_activations(item, function, mesh) for item in tree)
    if isinstance(tree, dict):
        return {key: _map_activations(value, function, mesh) for key, value in tree.items()}
    return tree


def _gather_sequence(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    # autograd: the gradient (the same on every rank) comes back as this rank's slice
    whole = DTensor.from_local(local, mesh, (Shard(SEQUENCE_DIM),), run_check=False)
    return whole.redistribute(mesh, (Replicate(),)).to_local()


def _shard_sequence(whole: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    # autograd: the shards' gradients are gathered, so the layer's backward sees the whole one
    replicated = DTensor.from_local(whole, mesh, (Replicate(),), run_check=False)
    return replicated.redistribute(mesh, (Shard(SEQUENCE_DIM),)).to_local()


def _boundary_slice(whole: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's slice of a whole (replicated) activation that crosses a stage boundary."""
    length, t = whole.shape[SEQUENCE_DIM], mesh.size()
    if length % t:  # the receiving ranks could not tell the slices' lengths apart to gather them
        raise ConfigError("tensor_parallel", t, f"each tensor-parallel rank sends its 1/{t} of a stage boundary's "
                          f"activation, sliced along the sequence (dimension {SEQUENCE_DIM}), and its length "
                          f"{length} does not divide by it (use a sequence length that divides)")
    # contiguous: a p2p send takes the slice's own storage
    return _shard_sequence(whole, mesh).contiguous()


# -- checks -----------------------------------------------------------------------------

def check_tensor_parallel(model: Any, tensor_parallel: int, *, sequence_parallel: bool | None = None,
                          seq_len: int | None = None) -> None:
    """Raise :class:`~raypipe.errors.ConfigError` unless ``tensor_parallel`` ranks can split ``model``.

    ``model``: what the trainer takes (a list of ``LayerSpec``/``nn.Module``, or an
    ``nn.Sequential``); planned specs are built on the meta device (nothing allocated).
    ``sequence_parallel`` None: on when ``tensor_parallel > 1``. ``seq_len``: the run's
    sequence length, which sequence parallelism shards (not checked when None).
    """
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ConfigError("tensor_parallel", tensor_parallel, "must be an int >= 1")
    if tensor_parallel == 1:
        return
    if sequence_parallel is None:
        sequence_parallel = True
    layers, _ = model_layers(model)
    plans = [resolve_tp_plan(layer.tp_plan, sequence_parallel) if isinstance(layer, LayerSpec) else None
             for layer in layers]
    if all(plan is None for plan in plans):
        raise ConfigError("tensor_parallel", tensor_parallel,
                          "no layer of the model has a tensor-parallel plan, so there is nothing to split; "
                          "use tensor_parallel=1, or give layers plans with LayerSpec(..., tp_plan=...)")
    if sequence_parallel and seq_len is not None and seq_len % tensor_parallel:
        raise ConfigError("tensor_parallel", tensor_parallel,
                          f"sequence parallelism shards the sequence, and seq_len={seq_len} does not divide by it")
    for index, (layer, plan) in enumerate(zip(layers, plans)):
        if plan is not None:
            _check_layer(layer.build("meta"), plan, tensor_parallel, f"layer {index} ({layer.cls.__name__})")


def _check_layer(module: nn.Module, plan: dict[str, ParallelStyle], t: int, where: str) -> None:
    for name, submodule in module.named_modules():
        declared = getattr(submodule, "tensor_parallel_divisors", None)
        for what, count in (declared() if callable(declared) else {}).items():
            if count % t:
                raise ConfigError("tensor_parallel", t, f"must divide {where}'s {what} ({count})")
    for pattern, style in plan.items():
        matched = [(name, sub) for name, sub in module.named_modules() if name and _fqn_matches(pattern, name)]
        if not matched:
            raise ConfigError("tensor_parallel", t, f"{where}'s tp_plan names {pattern!r}, which is no submodule "
                                                    f"of it (it has {[n for n, _ in module.named_children()]})")
        for name, submodule in matched:
            width = _sharded_width(submodule, style)
            if width is not None and width % t:
                raise ConfigError("tensor_parallel", t, f"must divide the width {name} of {where} is split along "
                                                        f"({width}, by {type(style).__name__})")


def _fqn_matches(pattern: str, name: str) -> bool:
    """``parallelize_module``'s matching: dot-separated atoms, each may hold ``fnmatch`` wildcards."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatch(part, atom) for atom, part in zip(atoms, parts))


def _sharded_width(module: nn.Module, style: ParallelStyle) -> int | None:
    """The width ``style`` splits ``module`` along, where an uneven split would break a local
    shape; None where uneven shards are fine (they stay DTensors) or the style splits nothing."""
    if isinstance(style, ColwiseParallel):
        if isinstance(module, nn.Linear):
            return module.out_features if style.use_local_output else None  # a kept DTensor knows its shape
        if isinstance(module, nn.Embedding):
            return module.embedding_dim
    if isinstance(style, RowwiseParallel) and isinstance(module, nn.Linear):
        return module.in_features  # its input is the local Shard(-1) of a column-parallel output
    return None  # a row-parallel embedding's Partial output is whole-width: the vocabulary may split unevenly


# -- loss parallelism ---------------------------------------------------------------------

_loss_parallel_lock = threading.Lock()
_loss_parallel_depth = 0
_loss_parallel_context: contextlib.AbstractContextManager | None = None


@contextlib.contextmanager
def loss_parallel_scope() -> Iterator[None]:
    """Loss parallelism (``torch.distributed.tensor.parallel.loss_parallel``) while inside.

    Cross entropy over ``Shard(-1)`` DTensor logits then runs vocabulary-parallel: each
    rank's fp32 logits stay a shard and only per-token maxima and sums cross the group.
    Its backward must run inside too, and raypipe runs a loss's forward, its backward
    (B, or I and W), and recomputed forwards as separate ops: the last stage enters
    this scope around its whole step (forwards, loss, backwards), not around the loss.

    torch's switch is process-global (it registers DTensor op handlers) and does not
    restore itself when the body raises; this scope does, and counts entries, so
    nested scopes and several threads' stages in one process (the thread-per-worker
    step runner) share it: it is on while any of them is inside. It changes only how
    DTensor log-softmax and NLL ops run, so other stages' ops are untouched.
    """
    global _loss_parallel_depth, _loss_parallel_context
    with _loss_parallel_lock:
        if _loss_parallel_depth == 0:
            context = loss_parallel()
            context.__enter__()
            _loss_parallel_context = context
        _loss_parallel_depth += 1
    try:
        yield
    finally:
        with _loss_parallel_lock:
            _loss_parallel_depth -= 1
            if _loss_parallel_depth == 0:
                context, _loss_parallel_context = _loss_parallel_context, None
                context.__exit__(None, None, None)  # a clean exit: torch's generator restores only then


def loss_parallel_active() -> bool:
    """Whether some :func:`loss_parallel_scope` is open in this process."""
    return _loss_parallel_depth > 0


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor, whole on every rank (a DTensor one, as vocabulary-parallel
    cross entropy returns, is replicated first; its gradient flows back through this).

    Every tensor-parallel rank holds the same value: a step that adds up the stage's
    losses over ranks counts it on tensor-parallel rank 0 only, or it counts ``t`` times.
    """
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


# -- gradients and state ------------------------------------------------------------------

@torch.no_grad()
def redistribute_gradients(module: nn.Module) -> None:
    """Put each DTensor parameter's gradient into the parameter's own layout, in place.

    DTensor leaves some gradients in another layout than their parameter's: a replicated
    weight that saw sequence-sharded activations (the RMSNorms under sequence parallelism)
    gets a ``Partial`` gradient, summed here over the tensor-parallel ranks; a row-parallel
    embedding's comes back whole and replicated (torch 2.13 has no row-sharded strategy for
    the embedding's backward) and is cut here to the rank's rows.
    Afterwards ``grad.to_local()`` has the shape of ``param.to_local()``, which flat
    gradient buffers, clipping and optimizers need. A collective: every rank calls it
    for the same module, after the backward and before the step reads the gradients.
    """
    for parameter in module.parameters():
        grad = parameter.grad
        if isinstance(parameter, DTensor) and isinstance(grad, DTensor) and grad.placements != parameter.placements:
            parameter.grad = grad.redistribute(parameter.device_mesh, parameter.placements)


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every DTensor gathered whole: keys and shapes as without
    tensor parallelism. A collective: every rank of the mesh calls it."""
    return {key: value.full_tensor() if isinstance(value, DTensor) else value
            for key, value in module.state_dict().items()}


def split_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as the DTensor ``like`` is (its mesh and placements; on ``like``'s
    device, in ``whole``'s dtype): each rank keeps its own part of the ``whole`` it holds, with
    no communication. ``whole`` itself when ``like`` is no DTensor or ``whole`` is not of its
    shape (an optimizer's scalar step)."""
    if not isinstance(like, DTensor) or whole.shape != like.shape:
        return whole
    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def load_split_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """``module.load_state_dict`` of whole tensors (:func:`full_state_dict`'s) into a module whose
    parameters and buffers may be split over a mesh: each rank copies in its own part."""
    current = module.state_dict()
    module.load_state_dict({name: split_like(value, current[name]) for name, value in state.items()})


def local_region(tensor: DTensor) -> tuple[slice, ...]:
    """The part of ``tensor``'s whole value this rank holds, one slice per dimension (what a rank
    reads of a checkpoint's whole tensor to fill its shard)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def local_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape on this rank (its shard's, for a DTensor)."""
    return {name: tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape)
            for name, p in module.named_parameters()}


__all__ = ["SEQUENCE_DIM", "check_tensor_parallel", "full_state_dict", "load_split_state", "local_loss",
           "local_region", "local_shapes", "loss_parallel_active", "loss_parallel_scope", "parallelize_layer",
           "redistribute_gradients", "resolve_tp_plan", "split_like"]
