"""An activation's header: the fixed-size int64 tensor that tells the receiving
stage the dtype and shape of the payload that follows (its :data:`Signature`),
so that micro-batches of any shape flow without a fixed-shape agreement. A tree's
header carries the tree's structure too (:mod:`raypipe.comm.tree_messages`), in its
last :data:`INLINE_STRUCTURE_BYTES` bytes, when the structure fits there (compressed, the
structure of a few leaves does); a larger structure follows the header as a message of
its own. With ``boundary_shapes="learned"`` a key's header goes only the first time
it crosses (:mod:`raypipe.comm.boundary_signatures`).
"""
from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool]
MAX_DIMS = 8
HEADER_LENGTH = 64  # ndim, dtype code, shape (MAX_DIMS), then a tree's structure when it fits
INLINE_STRUCTURE_BYTES = (HEADER_LENGTH - 2 - MAX_DIMS) * 8

Signature = tuple[int, tuple[int, ...]]  # dtype code, shape
# each part's signature, of a message that travels as several parts (a tree: raypipe.comm.tree_messages)
MessageSignature = tuple[Signature, ...]
# the code of a tree's header (:mod:`raypipe.comm.tree_messages`): its "shape" is (packed part's bytes,
# structure bytes); the parts follow from the structure, which is in the header (at most INLINE_STRUCTURE_BYTES)
# or follows it on the control channel
TREE = len(DTYPES)


def tree_signature(packed_bytes: int, structure_bytes: int) -> Signature:
    """The header's signature of a tree whose packed part and structure have these sizes."""
    return TREE, (packed_bytes, structure_bytes)


def empty_buffer(signature: Signature, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``signature``: a receive's buffer."""
    code, shape = signature
    return torch.empty(shape, dtype=DTYPES[code], device=device)


def empty_buffers(signature: MessageSignature, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Uninitialised tensors of each part's ``signature``: the receives' buffers of a message."""
    return tuple(empty_buffer(part, device) for part in signature)


def signature_of(tensor: torch.Tensor) -> Signature:
    return DTYPES.index(tensor.dtype), tuple(tensor.shape)


def message_signature(parts: tuple[torch.Tensor, ...]) -> MessageSignature:
    """Each part's signature."""
    return tuple(signature_of(part) for part in parts)


def structure_inline(structure_bytes: int) -> bool:
    """Whether a tree's structure of ``structure_bytes`` bytes goes in its header (else after it)."""
    return structure_bytes <= INLINE_STRUCTURE_BYTES


def encode(signature: Signature, device: torch.device, structure: bytes = b"") -> torch.Tensor:
    """The header of ``signature``, with a tree's ``structure`` inside (one that fits: :func:`structure_inline`)."""
    code, shape = signature
    header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
    header[:2 + len(shape)] = torch.tensor([len(shape), code, *shape], dtype=torch.int64)
    if structure:
        inline = header[2 + MAX_DIMS:].view(torch.uint8)
        inline[:len(structure)] = torch.frombuffer(bytearray(structure), dtype=torch.uint8)
    return header.to(device)


def decode(header: torch.Tensor) -> Signature:
    ndim, code, *shape = header[:2 + MAX_DIMS].tolist()
    return code, tuple(shape[:ndim])


def inline_structure(header: torch.Tensor, structure_bytes: int) -> bytes:
    """The structure bytes a tree's header holds (:func:`encode`)."""
    return header.cpu()[2 + MAX_DIMS:].view(torch.uint8)[:structure_bytes].numpy().tobytes()
