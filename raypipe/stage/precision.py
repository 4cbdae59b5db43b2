"""Mixed precision inside a stage: the autocast context of its forward."""
from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The forward context of a stage: autocast for bf16/fp16, nothing for fp32.

    Parameters stay fp32 (master weights); only the ops' compute dtype changes.
    """
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
