"""What a stage worker holds of the training step it is running, from the step's first op
to its commit or abort: which step it is, the first op that failed, the backwards that
ran, what each split backward's W still needs, and (last stage) the step's loss sum."""
from __future__ import annotations

from typing import Any

import torch

from raypipe.errors import StageError
from raypipe.stage.chunks import Key


class RunningStep:
    """One worker's state of its running step; :meth:`end` forgets all but the step's number."""

    def __init__(self) -> None:
        self.number = -1  # the step the ops belong to (it seeds their layers)
        self.failure: StageError | None = None  # the first failed op: no optimizer runs after it
        self.backwards_done: set[Key] = set()  # (chunk, micro-batch)s whose backward ran
        self.pending_weight_gradients: dict[Key, Any] = {}  # what each W needs, from its I to it
        self.loss: float | torch.Tensor = 0.0  # the last stage's weighted loss sum, on its device

    def begin(self, step: int) -> bool:
        """Note an op of ``step``; whether it is the first op of a new step."""
        if step == self.number:
            return False
        self.number = step
        return True

    def note_failure(self, error: StageError) -> None:
        """Remember the step's first failed op."""
        self.failure = self.failure or error

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss where it was computed, in fp64 (bitwise a sum of Python
        floats): read once a step, with the gradients' norm, not once a micro-batch (on a
        GPU, each read waits for the device: a host sync)."""
        self.loss = self.loss + loss.detach().double().reshape(())

    def end(self) -> None:
        """Forget the step's failure, backwards, pending weight gradients and loss."""
        self.failure = None
        self.backwards_done.clear()
        self.pending_weight_gradients.clear()
        self.loss = 0.0
