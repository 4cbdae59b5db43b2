"""What a stage receives and sends at its boundaries: a tensor, or a tree of them
(tuples, lists, dicts; leaves tensors, ``None`` or constants; see
:mod:`raypipe.comm.tree_messages`). The stage's ops handle both through these
functions, so a single tensor takes exactly the path it always has.

Gradients flow back through the floating-point tensors only: a received tree's
floating-point leaves become autograd leaves that require grad, integer leaves
(positions, document ids) and masks go forward only, and the gradient sent back is a
tree of the input's structure with ``None`` where there is none. A stage's output tree
is checked where it is made (:func:`check_sendable`), so a leaf no boundary carries fails
alike under every executor, named by stage and path.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from raypipe.comm.tree_messages import structure_of

Boundary = Any  # a tensor, or a tree of them


def is_tree(value: Boundary) -> bool:
    """Whether ``value`` is a tree (not a single tensor, nor ``None``)."""
    return value is not None and not isinstance(value, torch.Tensor)


def check_sendable(value: Boundary, stage: int, device: torch.device) -> None:
    """Raise :class:`~raypipe.comm.tree_messages.TreeLeafError`, naming ``stage`` and the
    leaf's path, when a leaf of the tree ``value`` cannot cross a stage boundary. Checked
    where the value is made, so every executor refuses it alike (the object store would
    pickle anything, and the failure would come later, elsewhere, or not at all)."""
    if is_tree(value):
        structure_of(value, stage, device)


def describe(value: Boundary) -> str:
    """A short account of a boundary value for messages: each leaf's path and kind."""
    if not is_tree(value):
        return "a tensor" if value is not None else "None"
    parts = []
    for path, leaf in pytree.tree_flatten_with_path(value)[0]:
        kind = (f"{leaf.dtype} {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__)
        parts.append(f"{pytree.keystr(path)}: {kind}")
    return ", ".join(parts)


def to_device(value: Boundary, device: torch.device) -> Boundary:
    """The boundary value with its tensors on ``device``, copied without blocking: a blocking copy
    from pageable host memory would wait for the device's queue (a host sync on a GPU)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    return pytree.tree_map_only(torch.Tensor, lambda tensor: tensor.to(device, non_blocking=True), value)


def as_autograd_leaves(value: Boundary) -> Boundary:
    """A received value whose floating-point tensors are autograd leaves requiring grad
    (the stage's input gradient is theirs); other leaves as they are."""
    def leaf(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().requires_grad_(True) if tensor.is_floating_point() else tensor

    return leaf(value) if isinstance(value, torch.Tensor) else pytree.tree_map_only(torch.Tensor, leaf, value)


def detached(value: Boundary) -> Boundary:
    """The value to send on: its tensors detached from this stage's graph; a tree's also
    contiguous (a packed row's positions are a strided view of the batch, and Ray Direct
    Transport hands each tensor as it is to a collective send, which takes contiguous ones)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    return pytree.tree_map_only(torch.Tensor, lambda tensor: tensor.detach().contiguous(), value)


def tensors(value: Boundary) -> list[torch.Tensor]:
    """The value's tensors, in tree order."""
    return [value] if isinstance(value, torch.Tensor) else [
        leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def nbytes(value: Boundary) -> int:
    """Bytes of the value's tensors' own elements."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors(value)) if value is not None else 0


def backward_roots(outputs: Boundary, gradient: Boundary) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (roots, gradients) a backward starts from: for a tree, each output leaf that
    requires grad, with the received gradient at the same path (a leaf without one, or
    whose gradient is ``None``, starts nothing)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs], [gradient.to(outputs.device).to(outputs.dtype)]
    given = {pytree.keystr(path): leaf for path, leaf in pytree.tree_flatten_with_path(gradient)[0]}
    roots, gradients = [], []
    for path, output in pytree.tree_flatten_with_path(outputs)[0]:
        received = given.get(pytree.keystr(path))
        if isinstance(output, torch.Tensor) and output.requires_grad and isinstance(received, torch.Tensor):
            roots.append(output)
            gradients.append(received.to(output.device).to(output.dtype))
    return roots, gradients


def input_gradient(inputs: Boundary) -> Boundary:
    """The gradient to send back for a received value: its ``.grad`` (a tree of its
    structure, ``None`` where a leaf has none); ``None`` when no gradient reached it."""
    if isinstance(inputs, torch.Tensor):
        return inputs.grad
    # contiguous, as detached()'s tensors are: each may travel alone by a collective send
    gradients = pytree.tree_map(
        lambda leaf: leaf.grad.contiguous() if isinstance(leaf, torch.Tensor) and leaf.grad is not None else None,
        inputs)
    return gradients if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(gradients)) else None


def differentiable_leaves(value: Boundary) -> list[tuple[str, torch.Tensor]]:
    """The (path, tensor) of each of the value's tensors that requires grad, in tree order
    (a single tensor's path is ``""``)."""
    if isinstance(value, torch.Tensor):
        return [("", value)] if value.requires_grad else []
    return [(pytree.keystr(path), leaf) for path, leaf in pytree.tree_flatten_with_path(value)[0]
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad]


def gradients_at(value: Boundary, gradients: dict[str, torch.Tensor]) -> Boundary:
    """A gradient of ``value``'s structure: ``gradients[path]`` at each path it names, ``None``
    at every other leaf (for a single tensor, the gradient at path ``""``)."""
    if isinstance(value, torch.Tensor):
        return gradients.get("")
    return pytree.tree_map_with_path(lambda at, _: gradients.get(pytree.keystr(at)), value)
