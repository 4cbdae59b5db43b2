"""A tensor-parallel stage's state as this rank's local shards, and back.

Split over a stage's tensor-parallel mesh, a parameter (and the optimizer state shaped like it)
is a DTensor bound to that mesh's process group. What a snapshot keeps, and what survives the
groups being re-formed (a failed step, a heal), is each rank's own part: plain local tensors,
no collective to take or give them. Given back, a local tensor becomes a DTensor again with the
placements of the live parameter it belongs to, on whatever mesh that parameter now has.

At t = 1 nothing here changes anything: there are no DTensors (and DTensor's module, seconds of
import, is never imported here)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raypipe.stage.gradients import is_dtensor, local_tensor


def as_local(tree: Any) -> Any:
    """``tree`` (nested dicts, lists and tuples, as state dicts are) with every DTensor
    replaced by its local shard (sharing storage). Dicts keep their kind and attributes
    (a state dict's ``_metadata``)."""
    if isinstance(tree, torch.Tensor):
        return local_tensor(tree)
    if isinstance(tree, dict):
        mapped = type(tree)()
        mapped.update((key, as_local(value)) for key, value in tree.items())
        if hasattr(tree, "_metadata"):
            mapped._metadata = tree._metadata
        return mapped
    if isinstance(tree, (list, tuple)):
        return type(tree)(as_local(item) for item in tree)
    return tree


def local_split_like(local: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part of a tensor shaped like ``parameter``) as a DTensor placed
    as ``parameter`` is, on its mesh; ``local`` itself when ``parameter`` is not split, or when
    ``local`` is not shaped like ``parameter``'s local part (a scalar such as Adam's step)."""
    if not is_dtensor(parameter) or local.shape != parameter.to_local().shape or local.dim() == 0:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, parameter.device_mesh, parameter.placements, run_check=False,
                              shape=parameter.shape, stride=parameter.stride())


def split_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """An ``optimizer.state_dict()`` of local shards (:func:`as_local` of one taken on a rank
    of the same stage and tp_rank) made loadable into ``optimizer``: each state tensor shaped
    like its parameter's local part becomes a DTensor placed as the parameter is (what the
    optimizer makes for a split parameter), every other value left as it is. State of another
    shape than the parameter's (a factored optimizer's) is not split back: such an optimizer
    is not supported with tensor parallelism."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    saved_ids = [saved_id for group in saved["param_groups"] for saved_id in group["params"]]
    by_id = dict(zip(saved_ids, parameters, strict=True))
    state = {saved_id: {key: local_split_like(value, by_id[saved_id]) if isinstance(value, torch.Tensor) else value
                        for key, value in values.items()}
             for saved_id, values in saved["state"].items()}
    return {**saved, "state": state}


def held_tensors(layers: nn.ModuleList) -> list[dict[str, torch.Tensor]]:
    """Per layer, every parameter and buffer (persistent or not) as this rank holds it: local
    shards, sharing storage with the live ones (a tied one under its first name)."""
    return [{name: local_tensor(tensor.detach()) for name, tensor in [*layer.named_parameters(),
                                                                       *layer.named_buffers()]}
            for layer in layers]


def adopt_local_tensors(layers: nn.ModuleList, held: list[dict[str, torch.Tensor]]) -> None:
    """Make :func:`held_tensors`' local tensors the layers' parameters and buffers, by name, in
    place of the (meta) ones they have: each one placed as the layer's own is (a DTensor on its
    mesh, or plain), sharing the held storage -- no copy, so moving a stage's state onto a new
    mesh needs no second copy of it in device memory. A parameter held under two names (tied)
    stays one parameter. Every parameter and buffer of the layers must be held."""
    for layer, saved in zip(layers, held, strict=True):
        adopted: dict[int, torch.Tensor] = {}  # id of the layer's own tensor -> what replaced it
        for kind in ("_parameters", "_buffers"):
            named = (layer.named_parameters(remove_duplicate=False) if kind == "_parameters"
                     else layer.named_buffers(remove_duplicate=False))
            for name, own in list(named):
                if own is None:
                    continue
                if id(own) not in adopted:
                    if name not in saved:
                        raise KeyError(f"{name!r} of the rebuilt layer is not in the state held")
                    local = saved[name]
                    if local.shape != local_tensor(own).shape:
                        raise ValueError(f"{name!r} is {tuple(local.shape)} in the state held, "
                                         f"{tuple(local_tensor(own).shape)} in the rebuilt layer")
                    value = local_split_like(local, own)
                    adopted[id(own)] = (nn.Parameter(value, requires_grad=own.requires_grad)
                                        if kind == "_parameters" else value)
                module_name, _, leaf = name.rpartition(".")
                getattr(layer.get_submodule(module_name), kind)[leaf] = adopted[id(own)]


@torch.no_grad()
def copy_local_state(layers: nn.ModuleList, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (a ``layers.state_dict()`` made local by :func:`as_local`: keys
    ``"<position>.<name>"``) into the layers' parameters and buffers, each into its local shard.
    Every tensor ``state`` names must be in the layers with its local shape."""
    live = {key: local_tensor(tensor) for key, tensor in layers.state_dict(keep_vars=True).items()}
    unknown = sorted(set(state) - set(live))
    if unknown:
        raise KeyError(f"saved state names {unknown[0]!r}, which the layers do not hold")
    for key, tensor in state.items():
        if live[key].shape != tensor.shape:
            raise ValueError(f"{key!r} is {tuple(tensor.shape)} in the saved state, {tuple(live[key].shape)} here")
        live[key].copy_(tensor)
