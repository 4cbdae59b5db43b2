"""An activation's header: the fixed-size int64 tensor that tells the receiving
stage the dtype and shape of the payload that follows (its :data:`Signature`),
so that micro-batches of any shape flow without a fixed-shape agreement.
"""
from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool]
MAX_DIMS = 8
HEADER_LENGTH = 2 + MAX_DIMS  # ndim, dtype code, shape

Signature = tuple[int, tuple[int, ...]]  # dtype code, shape
# the code of a tree's header (:mod:`raypipe.comm.tree_messages`): its "shape" is (payload bytes,
# layout bytes); the payload is uint8 and the layout follows the header on the control channel
TREE = len(DTYPES)
PAYLOAD_OF_TREE = DTYPES.index(torch.uint8)


def tree_signature(payload_bytes: int, layout_bytes: int) -> Signature:
    """The header's signature of a tree whose payload and layout have these sizes."""
    return TREE, (payload_bytes, layout_bytes)


def empty_buffer(signature: Signature, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``signature``: a receive's buffer."""
    code, shape = signature
    return torch.empty(shape, dtype=DTYPES[code], device=device)


def signature_of(tensor: torch.Tensor) -> Signature:
    return DTYPES.index(tensor.dtype), tuple(tensor.shape)


def encode(signature: Signature, device: torch.device) -> torch.Tensor:
    code, shape = signature
    return torch.tensor([len(shape), code, *shape, *[0] * (MAX_DIMS - len(shape))], dtype=torch.int64,
                        device=device)


def decode(header: torch.Tensor) -> Signature:
    ndim, code, *shape = header.tolist()
    return code, tuple(shape[:ndim])
