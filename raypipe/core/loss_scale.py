"""The pipeline-wide dynamic loss scale of fp16 training (owned by the driver)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from raypipe.core.validation import check_int, check_number, check_positive_int, check_positive_number, from_mapping


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
        """Restore :meth:`state_dict` output; unknown keys or bad values raise ``ConfigError``
        (a ``ValueError``) and leave the scaler unchanged."""
        restored = from_mapping(LossScaler, {**asdict(self), **state}, "LossScaler state")
        self.__dict__.update(asdict(restored))

    def _validate(self) -> None:
        check_number("LossScaler.scale", self.scale, lambda scale: 0 < scale < math.inf, "must be a finite number > 0")
        check_positive_int("LossScaler.growth_interval", self.growth_interval)
        check_number("LossScaler.growth_factor", self.growth_factor, lambda factor: factor >= 1,
                     "must be a number >= 1")
        check_number("LossScaler.backoff_factor", self.backoff_factor, lambda factor: 0 < factor < 1,
                     "must be a number in (0, 1)")
        check_positive_number("LossScaler.min_scale", self.min_scale)
        check_int("LossScaler.clean_steps", self.clean_steps, minimum=0)
