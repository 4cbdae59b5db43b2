"""A stage boundary that carries a tree of values — tuples, lists and dicts whose leaves
are tensors, ``None`` or scalars constant within a step (a LLaMA's hidden states with
the positions and document ids of packed sequences, a mask, an auxiliary loss) — as
one message.

The tree's tensors travel as one byte payload (each leaf's bytes at an offset aligned
to :data:`ALIGNMENT`, so the receiver's leaves are views of the payload, not copies),
and its :class:`TreeLayout` (the structure as :mod:`torch.utils._pytree` writes it,
each leaf's dtype, shape and offset, the constants' values) travels beside it, on the
control channel with the header (:mod:`raypipe.comm.p2p`). A single tensor is not a
tree: it goes as it always has, with no copy.

Gradients flow back for the floating-point leaves only (positions and document ids go
forward only): a tree's gradient is a payload of the same layout, each floating-point
leaf's gradient at that leaf's offset and zeros elsewhere, so a gradient needs no layout
of its own, as a single tensor's needs no header.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from raypipe.comm.headers import DTYPES, MAX_DIMS

ALIGNMENT = 16  # bytes: every leaf's offset, so that a view of any dtype is aligned
CONSTANT_TYPES = (bool, int, float, str)


class TreeLeafError(TypeError):
    """A leaf that cannot cross a stage boundary; the message names the stage and the leaf's path."""


@dataclass(frozen=True)
class LeafLayout:
    """One leaf: a tensor (its dtype code, shape and byte offset in the payload), ``None``,
    or a constant (its value)."""

    kind: str  # "tensor", "none" or "constant"
    dtype: int = -1
    shape: tuple[int, ...] = ()
    offset: int = 0
    value: Any = None

    @property
    def nbytes(self) -> int:
        return 0 if self.kind != "tensor" else torch.Size(self.shape).numel() * DTYPES[self.dtype].itemsize

    @property
    def differentiable(self) -> bool:
        """A floating-point tensor: its gradient flows back."""
        return self.kind == "tensor" and DTYPES[self.dtype].is_floating_point


@dataclass(frozen=True)
class TreeLayout:
    """Where a tree's leaves are in its payload, and the tree's structure."""

    spec: str  # torch.utils._pytree.treespec_dumps of the tree
    leaves: tuple[LeafLayout, ...]
    nbytes: int

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        """The layout as uint8 (JSON), to send on the control channel."""
        leaves = [[leaf.kind, leaf.dtype, list(leaf.shape), leaf.offset, leaf.value] for leaf in self.leaves]
        data = json.dumps({"spec": self.spec, "leaves": leaves, "nbytes": self.nbytes}).encode()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)

    @classmethod
    def from_tensor(cls, described: torch.Tensor) -> TreeLayout:
        """The layout :meth:`to_tensor` made."""
        fields = json.loads(described.cpu().numpy().tobytes().decode())
        leaves = tuple(LeafLayout(kind, dtype, tuple(shape), offset, value)
                       for kind, dtype, shape, offset, value in fields["leaves"])
        return cls(fields["spec"], leaves, fields["nbytes"])


def is_tree(value: Any) -> bool:
    """Whether ``value`` crosses a boundary as a tree (anything but a single tensor)."""
    return not isinstance(value, torch.Tensor)


def layout_of(tree: Any, stage: int, device: torch.device) -> TreeLayout:
    """The layout of ``tree`` sent from ``stage``, after checking every leaf (a clear
    :class:`TreeLeafError` names the stage and the leaf's path)."""
    with_paths, spec = pytree.tree_flatten_with_path(tree)
    leaves, offset = [], 0
    for path, leaf in with_paths:
        where = f"stage {stage} output{pytree.keystr(path)}"
        if leaf is None:
            leaves.append(LeafLayout("none"))
        elif isinstance(leaf, CONSTANT_TYPES):
            leaves.append(LeafLayout("constant", value=leaf))
        elif isinstance(leaf, torch.Tensor):
            if leaf.dtype not in DTYPES or leaf.dim() > MAX_DIMS:
                raise TreeLeafError(f"{where} is a {leaf.dtype} tensor of {leaf.dim()} dimensions: a stage "
                                    f"boundary carries {', '.join(map(str, DTYPES))} of at most {MAX_DIMS}")
            if leaf.device.type != device.type:
                raise TreeLeafError(f"{where} is on {leaf.device}, but this stage sends from {device}: move it "
                                    f"there in the layer that makes it")
            leaves.append(LeafLayout("tensor", DTYPES.index(leaf.dtype), tuple(leaf.shape), offset))
            offset += -(-leaves[-1].nbytes // ALIGNMENT) * ALIGNMENT
        else:
            raise TreeLeafError(f"{where} is an object of type {type(leaf).__name__}: a stage boundary carries "
                                f"tensors, None, and bool/int/float/str constants, in tuples, lists and dicts")
    return TreeLayout(pytree.treespec_dumps(spec), tuple(leaves), offset)


def outgoing(value: Any, stage: int, device: torch.device) -> tuple[torch.Tensor, TreeLayout | None]:
    """The one tensor an activation travels as, and for a tree its layout (None for a single
    tensor, which is checked against what a header can describe)."""
    if is_tree(value):
        layout = layout_of(value, stage, device)
        return pack(value, layout, device), layout
    if value.dim() > MAX_DIMS or value.dtype not in DTYPES:
        raise ValueError(f"cannot send a {value.dtype} tensor of shape {tuple(value.shape)} between stages")
    return value.detach().contiguous(), None


def pack(tree: Any, layout: TreeLayout, device: torch.device) -> torch.Tensor:
    """The payload of ``tree``: every tensor leaf's bytes at its offset."""
    payload = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    for leaf, value in zip(layout.leaves, pytree.tree_leaves(tree)):
        if leaf.kind == "tensor":
            _bytes(payload, leaf).copy_(_as_bytes(value.detach()))
    return payload


def unpack(payload: torch.Tensor, layout: TreeLayout) -> Any:
    """The tree a payload holds; its tensors are views of the payload."""
    values = [_view(payload, leaf) if leaf.kind == "tensor" else leaf.value for leaf in layout.leaves]
    return pytree.tree_unflatten(values, pytree.treespec_loads(layout.spec))


def pack_gradient(gradient: Any, layout: TreeLayout, device: torch.device) -> torch.Tensor:
    """The gradient payload of a received tree: each floating-point leaf's gradient (a tree
    of the received tree's structure; ``None`` or a non-floating leaf counts as zero)."""
    payload = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    # matched by path, not by order: a dict built in another order flattens in another order
    given = {pytree.keystr(path): value for path, value in pytree.tree_flatten_with_path(gradient)[0]}
    for leaf, path in zip(layout.leaves, _paths(layout)):
        value = given.get(path)
        if leaf.differentiable and isinstance(value, torch.Tensor):
            _bytes(payload, leaf).copy_(_as_bytes(value.detach().to(DTYPES[leaf.dtype])))
    return payload


def unpack_gradient(payload: torch.Tensor, layout: TreeLayout) -> Any:
    """The gradient of a sent tree, as a tree of its structure: the floating-point leaves'
    gradients (views of the payload), ``None`` in every other leaf's place."""
    values = [_view(payload, leaf) if leaf.differentiable else None for leaf in layout.leaves]
    return pytree.tree_unflatten(values, pytree.treespec_loads(layout.spec))


def _paths(layout: TreeLayout) -> list[str]:
    """Each leaf's path in the tree, in the layout's order."""
    placeholder = pytree.tree_unflatten(list(range(len(layout.leaves))), pytree.treespec_loads(layout.spec))
    return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(placeholder)[0]]


def _bytes(payload: torch.Tensor, leaf: LeafLayout) -> torch.Tensor:
    return payload[leaf.offset:leaf.offset + leaf.nbytes]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _view(payload: torch.Tensor, leaf: LeafLayout) -> torch.Tensor:
    return _bytes(payload, leaf).view(DTYPES[leaf.dtype]).reshape(leaf.shape)
