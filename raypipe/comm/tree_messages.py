"""A stage boundary that carries a tree of values — tuples, lists and dicts whose leaves
are tensors, ``None`` or scalars constant within a step (a LLaMA's hidden states with
the positions and document ids of packed sequences, a mask, an auxiliary loss) — as
one message of a few parts, each part one point-to-point transfer.

A tensor leaf of at least :data:`ALONE_BYTES` bytes is a part of its own, sent as it is
(no copy: the receiver's leaf is the buffer its receive was posted with); the smaller
leaves travel together as one byte payload, the last part (each leaf's bytes at an offset
aligned to :data:`ALIGNMENT`, so the receiver's leaves are views of the payload), because
below that size one message more costs more than the copy (docs/guide.md gives the
measurement). Which leaves go alone is decided by the
sender and written in the tree's :class:`TreeStructure` (the structure as
:mod:`torch.utils._pytree` writes it, each leaf's dtype, shape and payload offset, or
:data:`ALONE`, the constants' values), which travels in the header on the control channel
(:mod:`raypipe.comm.headers`; a structure too large for it follows the header), or not at
all once learned (:mod:`raypipe.comm.boundary_signatures`): both ends make the same parts
from it (:func:`part_signatures`). A single tensor is not a tree: it is a message of one
part, itself.

Gradients flow back for the floating-point leaves only (positions and document ids go
forward only): a tree's gradient is a message of the floating-point leaves' gradients
alone, each large one a part of its own as its leaf was, the small ones packed together
(:func:`gradient_parts`), so a gradient needs no structure of its own, as a single
tensor's needs no header.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from raypipe.comm.headers import DTYPES, MAX_DIMS, MessageSignature, Signature

ALIGNMENT = 16  # bytes: every packed leaf's offset, so that a view of any dtype is aligned
# a tensor leaf this large is a part of its own, sent as it is; smaller ones share one packed part: on gloo a
# message more costs about what copying half a megabyte does (about 20 us; docs/guide.md, "Boundary shapes")
ALONE_BYTES = 512 * 1024
ALONE = -1  # the offset of a leaf that is a part of its own
CONSTANT_TYPES = (bool, int, float, str)


class TreeLeafError(TypeError):
    """A leaf that cannot cross a stage boundary; the message names the stage and the leaf's path."""


@dataclass(frozen=True)
class LeafStructure:
    """One leaf: a tensor (its dtype code, shape and byte offset in the packed part, or
    :data:`ALONE`), ``None``, or a constant (its value)."""

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

    @property
    def alone(self) -> bool:
        """A tensor that is a part of its own (not packed)."""
        return self.kind == "tensor" and self.offset == ALONE

    @property
    def signature(self) -> Signature:
        return self.dtype, self.shape


@dataclass(frozen=True)
class TreeStructure:
    """The tree's structure, and where its leaves travel: alone, or in the packed part of ``nbytes`` bytes."""

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
    leaves = []
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
            leaves.append(LeafStructure("tensor", DTYPES.index(leaf.dtype), tuple(leaf.shape)))
        else:
            raise TreeLeafError(f"{where} is an object of type {type(leaf).__name__}: a stage boundary carries "
                                f"tensors, None, and bool/int/float/str constants, in tuples, lists and dicts")
    return _placed(pytree.treespec_dumps(spec), leaves, [leaf.nbytes < ALONE_BYTES for leaf in leaves])


def _placed(spec: str, leaves: list[LeafStructure], packed: list[bool]) -> TreeStructure:
    """The structure of ``leaves`` whose tensors go in the packed part where ``packed`` says so
    (each at the next aligned offset), alone elsewhere; a packed part of one leaf would be a copy
    of it for nothing, so that leaf goes alone (unless it has no bytes: then there is no part)."""
    tensors = [leaf.kind == "tensor" and packs for leaf, packs in zip(leaves, packed)]
    if sum(tensors) == 1 and leaves[tensors.index(True)].nbytes:
        packed = [False] * len(leaves)
    placed, offset = [], 0
    for leaf, packs in zip(leaves, packed):
        if leaf.kind == "tensor":
            placed.append(LeafStructure(leaf.kind, leaf.dtype, leaf.shape, offset if packs else ALONE))
            offset += -(-leaf.nbytes // ALIGNMENT) * ALIGNMENT if packs else 0
        else:
            placed.append(leaf)
    return TreeStructure(spec, tuple(placed), offset)


def outgoing(value: Any, stage: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], TreeStructure | None]:
    """The parts an activation travels as, and for a tree its structure (None for a single
    tensor, which is checked against what a header can describe, and is its one part)."""
    if is_tree(value):
        structure = structure_of(value, stage, device)
        return parts_of(value, structure, device), structure
    if value.dim() > MAX_DIMS or value.dtype not in DTYPES:
        raise ValueError(f"cannot send a {value.dtype} tensor of shape {tuple(value.shape)} between stages")
    return (value.detach().contiguous(),), None


def parts_of(tree: Any, structure: TreeStructure, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The parts of ``tree``: each leaf that goes alone as it is (copied only where it is not
    contiguous), then the packed part."""
    values = pytree.tree_leaves(tree)
    alone = [value.detach().contiguous() for leaf, value in zip(structure.leaves, values) if leaf.alone]
    return _message(alone, structure, values, device)


def part_signatures(structure: TreeStructure) -> MessageSignature:
    """The dtype and shape of each part of a tree of ``structure`` (what its receives are posted with)."""
    packed = ((DTYPES.index(torch.uint8), (structure.nbytes,)),) if structure.nbytes else ()
    return tuple(leaf.signature for leaf in structure.leaves if leaf.alone) + packed


def tree_of(parts: tuple[torch.Tensor, ...], structure: TreeStructure, device: torch.device) -> Any:
    """The tree received as ``parts``: a leaf that went alone is its part, a packed one a view of the
    packed part (one of no elements, with no packed part, a new empty tensor on ``device``)."""
    alone = iter(parts)
    packed = parts[-1] if structure.nbytes else torch.empty(0, dtype=torch.uint8, device=device)
    values = [next(alone) if leaf.alone else _view(packed, leaf) if leaf.kind == "tensor" else leaf.value
              for leaf in structure.leaves]
    return pytree.tree_unflatten(values, pytree.treespec_loads(structure.spec))


def gradient_structure(structure: TreeStructure) -> TreeStructure:
    """Where a gradient of a tree of ``structure`` travels: the floating-point leaves only, each
    one that went alone alone again, the others packed (in a part of their own offsets); every
    other leaf ``None``."""
    leaves = [leaf if leaf.differentiable else LeafStructure("none") for leaf in structure.leaves]
    return _placed(structure.spec, leaves, [not leaf.alone for leaf in structure.leaves])


def gradient_parts(gradient: Any, structure: TreeStructure, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The parts of the gradient of a received tree of ``structure`` (its :func:`gradient_structure`'s): each
    floating-point leaf's gradient (``gradient`` is a tree of the received tree's structure; ``None``, a
    missing or a non-floating leaf counts as zero)."""
    structure = gradient_structure(structure)
    # matched by path, not by order: a dict built in another order flattens in another order
    given = {pytree.keystr(path): value for path, value in pytree.tree_flatten_with_path(gradient)[0]}
    values = []
    for leaf, path in zip(structure.leaves, _paths(structure)):
        value = given.get(path)
        if leaf.kind != "tensor":
            values.append(None)
        elif isinstance(value, torch.Tensor):
            if tuple(value.shape) != leaf.shape:  # its part would not fit the receive posted for it
                raise ValueError(f"the gradient at {path or 'the input'} has shape {tuple(value.shape)}, but the "
                                 f"input there has shape {leaf.shape}")
            values.append(value.detach().to(DTYPES[leaf.dtype]))
        else:
            values.append(torch.zeros(leaf.shape, dtype=DTYPES[leaf.dtype], device=device))
    alone = [value.contiguous() for leaf, value in zip(structure.leaves, values) if leaf.alone]
    return _message(alone, structure, values, device)


def _message(alone: list[torch.Tensor], structure: TreeStructure, values: list[Any],
             device: torch.device) -> tuple[torch.Tensor, ...]:
    """``alone``, then the packed part of ``values`` (the structure's packed leaves' bytes at their offsets), if any."""
    if not structure.nbytes:
        return tuple(alone)
    return (*alone, pack(values, structure, device))


def pack(values: list[Any], structure: TreeStructure, device: torch.device) -> torch.Tensor:
    """The packed part: each packed leaf's value (of ``values``, in the structure's order) at its offset."""
    payload = torch.zeros(structure.nbytes, dtype=torch.uint8, device=device)
    for leaf, value in zip(structure.leaves, values):
        if leaf.kind == "tensor" and not leaf.alone:
            _bytes(payload, leaf).copy_(_as_bytes(value.detach()))
    return payload


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
