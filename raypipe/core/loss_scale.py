"""The pipeline-wide dynamic loss scale of fp16 training (owned by the driver)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    """Dynamic loss scale for fp16, owned by the driver and shared by all stages.

    The scale multiplies the loss once, on the last stage. After backward the
    driver combines every stage's found-inf flag: on overflow no stage steps and
    the scale is multiplied by ``backoff_factor`` (not below ``min_scale``);
    after ``growth_interval`` clean steps in a row it is multiplied by
    ``growth_factor``. Same rule as ``torch.amp.GradScaler``, plus the floor.
    """

    scale: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    clean_steps: int = 0

    def __post_init__(self) -> None:
        self._validate()

    def update(self, found_inf: bool) -> None:
        """Advance the scale after one step's global overflow check."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            grown = self.scale * self.growth_factor
            # as GradScaler: never grow into inf (the next step would overflow for sure)
            if math.isfinite(grown):
                self.scale = grown
            self.clean_steps = 0

    def state_dict(self) -> dict:
        """Plain floats and ints (JSON-serializable, for checkpoint manifests)."""
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output; unknown keys or bad values raise ``ValueError``."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(state) - known)
        if unknown:
            raise ValueError(f"LossScaler state has unknown keys {unknown}; known: {sorted(known)}")
        previous = asdict(self)
        for key, value in state.items():
            setattr(self, key, value)
        try:
            self._validate()
        except ValueError:
            for key, value in previous.items():
                setattr(self, key, value)
            raise

    def _validate(self) -> None:
        checks = {
            "scale": _is_number(self.scale) and self.scale > 0 and math.isfinite(self.scale),
            "growth_interval": isinstance(self.growth_interval, int) and not isinstance(self.growth_interval, bool)
            and self.growth_interval >= 1,
            "growth_factor": _is_number(self.growth_factor) and self.growth_factor >= 1,
            "backoff_factor": _is_number(self.backoff_factor) and 0 < self.backoff_factor < 1,
            "min_scale": _is_number(self.min_scale) and self.min_scale > 0,
            "clean_steps": isinstance(self.clean_steps, int) and not isinstance(self.clean_steps, bool)
            and self.clean_steps >= 0,
        }
        allowed = {"scale": "a finite number > 0", "growth_interval": "an int >= 1", "growth_factor": "a number >= 1",
                   "backoff_factor": "a number in (0, 1)", "min_scale": "a number > 0",
                   "clean_steps": "an int >= 0"}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"LossScaler.{name}={getattr(self, name)!r}: must be {allowed[name]}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
