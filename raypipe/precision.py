"""Mixed precision: autocast contexts and the pipeline-wide dynamic loss scaler."""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

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


@dataclass
class LossScaler:
    """Dynamic loss scale for fp16, owned by the driver and shared by all stages.

    The scale multiplies the loss once, on the last stage. After backward the
    driver combines every stage's found-inf flag: on overflow no stage steps and
    the scale is multiplied by ``backoff_factor`` (not below ``min_scale``);
    after ``growth_interval`` clean steps in a row it is multiplied by
    ``growth_factor``. Same rule as ``torch.amp.GradScaler``.
    """

    scale: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    clean_steps: int = 0

    def update(self, found_inf: bool) -> None:
        """Advance the scale after one step's global overflow check."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
