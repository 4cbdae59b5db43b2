"""The training loop over a dataset: stages read their own micro-batches,
the driver keeps the data position, evaluates and checkpoints."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from raypipe.core.result import StepResult
from raypipe.errors import NonFiniteError, StageError

logger = logging.getLogger(__name__)


def fit(trainer: Any, dataset: Any, steps: int, *, validation: Any = None, eval_every: int = 0,
        eval_steps: int = 1, checkpoint_dir: str | None = None, checkpoint_every: int = 0,
        keep_last: int | None = None, progress: bool = True,
        callback: Callable[[StepResult], None] | None = None,
        ship_data_limit_bytes: int | None = None) -> list[StepResult]:
    """Train ``steps`` optimizer steps from the dataset's current position.

    ``dataset`` (and ``validation``) follow :class:`raypipe.data.TokenDataset`:
    ``get(step, micro_batch)``, ``next_step``, ``advance()``, ``state_dict()``,
    ``tokens_per_step``. The first and last stages get a copy and read
    ``(step, micro_batch)`` themselves, so no data passes through the driver.
    Every ``eval_every`` steps (and at the end) the mean loss of ``eval_steps``
    validation steps is recorded in ``result.eval_loss``; checkpoints go
    to ``checkpoint_dir`` every ``checkpoint_every`` steps and at the end, with
    the data position, so a restart resumes exactly (``keep_last``: only the
    newest that many are kept). Both count the trainer's steps (``step_count``,
    which a loaded checkpoint restores), not this call's: a resumed run
    evaluates and checkpoints at the same steps as an uninterrupted one.
    Checkpoints are saved in the background
    (``save_checkpoint(..., wait=False)``): training stalls only for each
    worker's copy of its state to host memory, a save waits for the one before,
    and the final one is complete when ``fit`` returns (unless a worker was lost
    while writing it: a warning says so, and the one before stays the newest).

    A step that raises :class:`~raypipe.StageError` (a bad shard, an error in
    the model's code) or :class:`~raypipe.NonFiniteError` changes nothing, so
    before the error propagates ``fit`` checkpoints the steps before it (with
    ``checkpoint_dir``, when this call trained any since its last checkpoint): a
    rerun after fixing what the error names redoes no step.

    Before step 0 each reading stage opens the dataset where it runs; a stage on
    a node that cannot open a local dataset gets its shards through Ray's object
    store, if they come to at most ``ship_data_limit_bytes`` (default 1 GiB);
    otherwise, and for a URI a stage cannot open, a DataAccessError stops the run.
    """
    per_step = trainer.micro_batches_per_step
    _check_dataset(dataset, per_step, "dataset")
    if validation is not None:
        _check_dataset(validation, per_step, "validation")
    limit = {} if ship_data_limit_bytes is None else {"ship_data_limit_bytes": ship_data_limit_bytes}
    trainer.attach_datasets(dataset, validation, **limit)
    samples_per_step = dataset.micro_batch_size * dataset.num_micro_batches
    results: list[StepResult] = []
    bar = _progress_bar(steps, progress)
    saved_step = trainer.step_count  # the newest state on disk, as far as this call knows
    try:
        for done in range(1, steps + 1):
            try:
                result = trainer.step_from_datasets(dataset.next_step, samples_per_step, dataset.tokens_per_step)
                dataset.advance()
                trained = result.step + 1  # the run's steps so far: a resumed run keeps the same cadence
                if validation is not None and eval_every and (trained % eval_every == 0 or done == steps):
                    result.eval_loss = evaluate(trainer, eval_steps)
            except (StageError, NonFiniteError) as error:
                if checkpoint_dir and trainer.step_count != saved_step:
                    _save_before_raising(trainer, dataset, checkpoint_dir, keep_last, error)
                raise
            results.append(result)
            _show(bar, result)
            if checkpoint_dir and ((checkpoint_every and trained % checkpoint_every == 0) or done == steps):
                trainer.save_checkpoint(checkpoint_dir, extra={"dataset": dataset.state_dict()}, keep_last=keep_last,
                                        wait=False)
                saved_step = trainer.step_count
            if callback is not None:
                callback(result)
    finally:
        if bar is not None:
            bar.close()
    if checkpoint_dir:
        trainer.wait_for_checkpoint()  # the final checkpoint is complete when fit returns
    return results


def _save_before_raising(trainer: Any, dataset: Any, checkpoint_dir: str, keep_last: int | None,
                         error: Exception) -> None:
    """Checkpoint the steps done before ``error`` (raised by a step that changed nothing, or by
    an evaluation); a failed save is logged, and ``error`` is the one that propagates."""
    stopped = f"training stopped at step {dataset.next_step} ({type(error).__name__})"
    try:
        trainer.save_checkpoint(checkpoint_dir, extra={"dataset": dataset.state_dict()}, keep_last=keep_last)
    except Exception as save_error:  # noqa: BLE001 - the step's error matters more; the save's is logged
        logger.warning("raypipe: %s, and checkpointing the steps before it failed: %s", stopped, save_error)
    else:
        logger.warning("raypipe: %s; the steps before it are checkpointed under %s, so a rerun redoes none",
                       stopped, checkpoint_dir)


def evaluate(trainer: Any, eval_steps: int) -> float:
    """Mean validation loss over the validation dataset's first ``eval_steps`` steps."""
    losses = [trainer.evaluate_from_datasets(step) for step in range(eval_steps)]
    return sum(losses) / len(losses)


def _check_dataset(dataset: Any, per_step: int, name: str) -> None:
    for attribute in ("get", "advance", "state_dict", "next_step", "tokens_per_step", "micro_batch_size",
                      "num_micro_batches"):
        if not hasattr(dataset, attribute):
            raise TypeError(f"{name} has no {attribute!r}: fit() needs a raypipe.data.TokenDataset-like reader")
    if dataset.num_micro_batches != per_step:
        raise ValueError(f"{name} yields {dataset.num_micro_batches} micro-batches per step but a step of the "
                         f"pipeline has {per_step} (num_micro_batches x the most replicas)")


def _progress_bar(steps: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=steps, desc="train", unit="step", dynamic_ncols=True)


def _show(bar: Any, result: StepResult) -> None:
    if bar is None:
        return
    postfix = {"step": result.step, "loss": f"{result.loss:.4f}", "tok/s": f"{result.tokens_per_second:,.0f}"}
    if result.eval_loss is not None and not math.isnan(result.eval_loss):
        postfix["eval"] = f"{result.eval_loss:.4f}"
    if result.skipped:
        postfix["skipped"] = result.skip_reason
    bar.set_postfix(postfix, refresh=False)
    bar.update(1)
