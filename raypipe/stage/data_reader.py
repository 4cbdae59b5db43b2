"""The first and last stages' own view of the dataset (``fit``): data never
passes through the driver."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from raypipe.core.micro_batches import count_samples, loss_weights


class StageData:
    """Reads its replica's micro-batches of a step from the attached datasets and
    weights losses over the whole step.

    A step has ``num_micro_batches x num_replicas`` micro-batches; this stage's
    replica runs the block that starts at ``first_micro_batch``.
    """

    def __init__(self, loss_count_fn: Callable[[torch.Tensor], int] | None, first_micro_batch: int = 0) -> None:
        self.count = loss_count_fn or count_samples
        self.first_micro_batch = first_micro_batch
        self._datasets: dict[str, Any] = {}
        self._step_targets: dict[tuple[str, int], tuple[list[torch.Tensor], list[float]]] = {}

    def attach(self, train: Any, validation: Any = None) -> None:
        self._datasets = {"train": train, "validation": validation}
        self._step_targets.clear()

    def inputs(self, step: int, micro_batch: int, split: str) -> torch.Tensor:
        return self._dataset(split).get(step, self.first_micro_batch + micro_batch)[0]

    def targets_and_weight(self, step: int, micro_batch: int, split: str) -> tuple[torch.Tensor, float]:
        """The micro-batch's targets and its share of the whole step's loss count.

        The weights need every micro-batch's count (every replica's), so the
        step's targets are read once, at its first micro-batch, and kept for the
        rest of the step.
        """
        key = (split, step)
        if key not in self._step_targets:
            dataset = self._dataset(split)
            targets = [dataset.get(step, index)[1] for index in range(dataset.num_micro_batches)]
            weights = loss_weights([self.count(t) for t in targets])
            self._step_targets = {key: (targets, weights)}  # only the current step is needed
        targets, weights = self._step_targets[key]
        index = self.first_micro_batch + micro_batch
        return targets[index], weights[index]

    def _dataset(self, split: str) -> Any:
        dataset = self._datasets.get(split)
        if dataset is None:
            raise RuntimeError(f"no {split} dataset attached to this stage: pass inputs or call fit()")
        return dataset
