"""The first and last stages' own view of the dataset (``fit``): data never
passes through the driver.

A reading stage reads a whole step at its first micro-batch and, while that
step runs, reads the next training step on a background thread: a shard's
first load (a file read, from object storage on a cluster, its checksum and
decode) happens beside the step's compute instead of in front of it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from raypipe.core.micro_batches import count_samples, loss_weights

StepKey = tuple[str, int, range]  # (split, step, the replica's block of micro-batches)


@dataclass(frozen=True)
class StepRead:
    """What one stage reads of one step."""

    inputs: dict[int, torch.Tensor]  # first stage: its block's micro-batches, by index in the step
    targets: list[torch.Tensor]  # last stage: every micro-batch of the step, since the weights need all counts
    weights: list[float]  # each micro-batch's share of the step's loss count


class StageData:
    """Reads its replica's micro-batches of a step from the attached datasets and
    weights losses over the whole step.

    A step has ``num_micro_batches x num_replicas`` micro-batches; this stage's
    replica runs ``block`` of them. The first stage reads inputs, the last
    targets (a one-stage pipeline both). With ``read_ahead``, reading training
    step ``s`` starts reading step ``s + 1`` in the background; a read that
    fails there raises when step ``s + 1`` asks for its data, as it would have.
    """

    def __init__(self, loss_count_fn: Callable[[torch.Tensor], int] | None, block: range, reads_inputs: bool,
                 reads_targets: bool, read_ahead: bool = True) -> None:
        self.count = loss_count_fn or count_samples
        self.reads_inputs, self.reads_targets = reads_inputs, reads_targets
        self.read_ahead = read_ahead
        self.block = block
        self._datasets: dict[str, Any] = {}
        self._current: tuple[StepKey, StepRead] | None = None
        self._ahead: dict[StepKey, Future] = {}
        self._reading = threading.Lock()  # a TokenDataset's shard cache is not thread-safe
        self._reader: ThreadPoolExecutor | None = None

    def attach(self, train: Any, validation: Any = None) -> None:
        self._datasets = {"train": train, "validation": validation}
        self._current, self._ahead = None, {}

    def take_block(self, block: range) -> None:
        """Read ``block`` of each step's micro-batches from the next step on (an elastic resize)."""
        self.block = block

    def inputs(self, step: int, micro_batch: int, split: str, given: Any = None) -> Any:
        """The inputs of the block's ``micro_batch`` (counted from the block's start): ``given``
        (what the driver passed), else read."""
        if given is not None:
            return given
        return self._step_read(split, step).inputs[self.block[micro_batch]]

    def targets_and_weight(self, step: int, micro_batch: int, split: str, given: torch.Tensor | None = None,
                           weight: float | None = None) -> tuple[torch.Tensor, float]:
        """The block's ``micro_batch``'s targets and its share of the whole step's loss count:
        ``given`` (and ``weight``, 1 when None) as the driver passed them, else read."""
        if given is not None:
            return given, 1.0 if weight is None else weight
        read = self._step_read(split, step)
        index = self.block[micro_batch]
        return read.targets[index], read.weights[index]

    def _step_read(self, split: str, step: int) -> StepRead:
        key = (split, step, self.block)
        if self._current is not None and self._current[0] == key:
            return self._current[1]
        pending = self._ahead.pop(key, None)
        read = pending.result() if pending is not None else self._read(*key)
        self._current = (key, read)
        if self.read_ahead and split == "train":
            following = (split, step + 1, self.block)
            self._ahead = {following: self._background().submit(self._read, *following)}
        return read

    def _read(self, split: str, step: int, block: range) -> StepRead:
        dataset = self._dataset(split)
        read_all = self.reads_targets
        with self._reading:
            batches = {index: dataset.get(step, index)
                       for index in (range(dataset.num_micro_batches) if read_all else block)}
        inputs = {index: batches[index][0] for index in block} if self.reads_inputs else {}
        targets = [target for _, target in batches.values()] if read_all else []
        return StepRead(inputs, targets, loss_weights([self.count(t) for t in targets]) if targets else [])

    def _background(self) -> ThreadPoolExecutor:
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raypipe-read-ahead")
        return self._reader

    def _dataset(self, split: str) -> Any:
        dataset = self._datasets.get(split)
        if dataset is None:
            raise RuntimeError(f"no {split} dataset attached to this stage: pass inputs or call fit()")
        return dataset
