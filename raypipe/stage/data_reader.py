"""The first and last stages' own view of the dataset (``fit``): data never
passes through the driver."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from raypipe.core.micro_batches import count_samples, loss_weights


class StageData:
    """Reads ``(step, micro_batch)`` from the attached datasets and weights losses."""

    def __init__(self, loss_count_fn: Callable[[torch.Tensor], int] | None) -> None:
        self.count = loss_count_fn or count_samples
        self._datasets: dict[str, Any] = {}
        self._step_targets: dict[tuple[str, int], tuple[list[torch.Tensor], list[float]]] = {}

    def attach(self, train: Any, validation: Any = None) -> None:
        self._datasets = {"train": train, "validation": validation}
        self._step_targets.clear()

    def inputs(self, step: int, micro_batch: int, split: str) -> torch.Tensor:
        return self._dataset(split).get(step, micro_batch)[0]

    def targets_and_weight(self, step: int, micro_batch: int, split: str,
                           num_micro_batches: int) -> tuple[torch.Tensor, float]:
        """The micro-batch's targets and its share of the step's loss count.

        The weights need every micro-batch's count, so the step's targets are
        read once, at its first micro-batch, and kept for the rest of the step.
        """
        key = (split, step)
        if key not in self._step_targets:
            dataset = self._dataset(split)
            targets = [dataset.get(step, mb)[1] for mb in range(num_micro_batches)]
            weights = loss_weights([self.count(t) for t in targets])
            self._step_targets = {key: (targets, weights)}  # only the current step is needed
        targets, weights = self._step_targets[key]
        return targets[micro_batch], weights[micro_batch]

    def _dataset(self, split: str) -> Any:
        dataset = self._datasets.get(split)
        if dataset is None:
            raise RuntimeError(f"no {split} dataset attached to this stage: pass inputs or call fit()")
        return dataset
