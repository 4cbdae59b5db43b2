"""A stage boundary that carries a tree of values — tuples, lists and dicts whose leaves
are tensors, ``None`` or scalars constant within a step (a LLaMA's hidden states with
the positions and document ids of packed sequences, a mask, an auxiliary loss) — as
one message.

The tree's tensors travel as one byte payload (each leaf's bytes at an offset aligned
to :data:`ALIGNMENT`, so the receiver's leaves are views of the payload, not copies),
and its :class:`TreeStructure` (the structure as :mod:`torch.utils._pytree` writes it,
each leaf's dtype, shape and offset, the constants' values) travels in the header on the
control channel (:mod:`raypipe.comm.headers`; a structure too large for it follows the
header), or not at all once learned (:mod:`raypipe.comm.boundary_signatures`). A single tensor is not a
tree: it goes as it always has, with no copy.

Gradients flow back for the floating-point leaves only (positions and document ids go
forward only): a tree's gradient is a payload of the same structure, each floating-point
leaf's gradient at that leaf's offset and zeros elsewhere, so a gradient needs no structure
of its own, as a single tensor's needs no header.
"""
from __future__ import annotations

import json
import zlib
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
class LeafStructure:
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
class TreeStructure:
    """Where a tree's leaves are in its payload, and the tree's structure."""

    spec: str  # torch.utils._pytree.treespec_dumps of the tree
    leaves: tuple[LeafStructure, ...]
    nbytes: int

    def to_bytes(self) -> bytes:
        """The structure as compressed JSON, to send on the control channel (in the header when it fits)."""
        leaves = [[leaf.kind, leaf.dtype, list(leaf.shape), leaf.offset, leaf.value] for leaf in self.leaves]
        return zlib.compress(json.dumps({"spec": self.spec, "leaves": leaves, "nbytes": self.nbytes}).encode())

    @classmethod
    def from_bytes(cls, data: bytes) -> TreeStructure:
        """The structure :meth:`to_bytes` made."""
        fields = json.loads(zlib.decompress(data).decode())
        leaves = tuple(LeafStructure(kind, dtype, tuple(shape), offset, value)
                       for kind, dtype, shape, offset, value in fields["leaves"])
        return cls(fields["spec"], leaves, fields["nbytes"])


def is_tree(value: Any) -> bool:
    """Whether ``value`` crosses a boundary as a tree (anything but a single tensor)."""
    return not isinstance(value, torch.Tensor)


def structure_of(tree: Any, stage: int, device: torch.device) -> TreeStructure:
    """The structure of ``tree`` sent from ``stage``, after checking every leaf (a clear
    :class:`TreeLeafError` names the stage and the leaf's path)."""
    with_paths, spec = pytree.tree_flatten_with_path(tree)
    leaves, offset = [], 0
    for path, leaf in with_paths:
        where = f"stage {stage} output{pytree.keystr(path)}"
        if leaf is None:
            leaves.append(LeafStructure("none"))
        elif isinstance(leaf, CONSTANT_TYPES):
            leaves.append(LeafStructure("constant", value=leaf))
        elif isinstance(leaf, torch.Tensor):
            if leaf.dtype not in DTYPES or leaf.dim() > MAX_DIMS:
                raise TreeLeafError(f"{where} is a {leaf.dtype} tensor of {leaf.dim()} dimensions: a stage "
                                    f"boundary carries {', '.join(map(str, DTYPES))} of at most {MAX_DIMS}")
            if leaf.device.type != device.type:
                raise TreeLeafError(f"{where} is on {leaf.device}, but this stage sends from {device}: move it "
                                    f"there in the layer that makes it")
            leaves.append(LeafStructure("tensor", DTYPES.index(leaf.dtype), tuple(leaf.shape), offset))
            offset += -(-leaves[-1].nbytes // ALIGNMENT) * ALIGNMENT
        else:
            raise TreeLeafError(f"{where} is an object of type {type(leaf).__name__}: a stage boundary carries "
                                f"tensors, None, and bool/int/float/str constants, in tuples, lists and dicts")
    return TreeStructure(pytree.treespec_dumps(spec), tuple(leaves), offset)


def outgoing(value: Any, stage: int, device: torch.device) -> tuple[torch.Tensor, TreeStructure | None]:
    """The one tensor an activation travels as, and for a tree its structure (None for a single
    tensor, which is checked against what a header can describe)."""
    if is_tree(value):
        structure = structure_of(value, stage, device)
        return pack(value, structure, device), structure
    if value.dim() > MAX_DIMS or value.dtype not in DTYPES:
        raise ValueError(f"cannot send a {value.dtype} tensor of shape {tuple(value.shape)} between stages")
    return value.detach().contiguous(), None


def pack(tree: Any, structure: TreeStructure, device: torch.device) -> torch.Tensor:
    """The payload of ``tree``: every tensor leaf's bytes at its offset."""
    payload = torch.zeros(structure.nbytes, dtype=torch.uint8, device=device)
    for leaf, value in zip(structure.leaves, pytree.tree_leaves(tree)):
        if leaf.kind == "tensor":
            _bytes(payload, leaf).copy_(_as_bytes(value.detach()))
    return payload


def unpack(payload: torch.Tensor, structure: TreeStructure) -> Any:
    """The tree a payload holds; its tensors are views of the payload."""
    values = [_view(payload, leaf) if leaf.kind == "tensor" else leaf.value for leaf in structure.leaves]
    return pytree.tree_unflatten(values, pytree.treespec_loads(structure.spec))


def pack_gradient(gradient: Any, structure: TreeStructure, device: torch.device) -> torch.Tensor:
    """The gradient payload of a received tree: each floating-point leaf's gradient (a tree
    of the received tree's structure; ``None`` or a non-floating leaf counts as zero)."""
    payload = torch.zeros(structure.nbytes, dtype=torch.uint8, device=device)
    # matched by path, not by order: a dict built in another order flattens in another order
    given = {pytree.keystr(path): value for path, value in pytree.tree_flatten_with_path(gradient)[0]}
    for leaf, path in zip(structure.leaves, _paths(structure)):
        value = given.get(path)
        if leaf.differentiable and isinstance(value, torch.Tensor):
            _bytes(payload, leaf).copy_(_as_bytes(value.detach().to(DTYPES[leaf.dtype])))
    return payload


def unpack_gradient(payload: torch.Tensor, structure: TreeStructure) -> Any:
    """The gradient of a sent tree, as a tree of its structure: the floating-point leaves'
    gradients (views of the payload), ``None`` in every other leaf's place."""
    values = [_view(payload, leaf) if leaf.differentiable else None for leaf in structure.leaves]
    return pytree.tree_unflatten(values, pytree.treespec_loads(structure.spec))


def _paths(structure: TreeStructure) -> list[str]:
    """Each leaf's path in the tree, in the structure's order."""
    placeholder = pytree.tree_unflatten(list(range(len(structure.leaves))), pytree.treespec_loads(structure.spec))
    return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(placeholder)[0]]


def _bytes(payload: torch.Tensor, leaf: LeafStructure) -> torch.Tensor:
    return payload[leaf.offset:leaf.offset + leaf.nbytes]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _view(payload: torch.Tensor, leaf: LeafStructure) -> torch.Tensor:
    return _bytes(payload, leaf).view(DTYPES[leaf.dtype]).reshape(leaf.shape)
