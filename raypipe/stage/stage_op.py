"""A stage op's record: its timed event on the stage's timeline, and its failure
as a :class:`~raypipe.errors.StageError` naming the stage, replica, op and
micro-batch."""
from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from typing import Any

from raypipe.core.result import OpEvent
from raypipe.errors import StageError


def stage_op(op: str, per_micro_batch: bool = True, timed: bool = True, in_step: bool = False) -> Callable:
    """Time the op into the stage's timeline and re-raise failures as StageError.

    ``in_step`` ops (forward, backward of a training step) also remember their
    failure: :meth:`~raypipe.stage.worker.StageWorker.finish_backward` raises it again, so that no
    stage steps its optimizer after a failed op.
    """

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            micro_batch = None
            if per_micro_batch:
                micro_batch = kwargs["micro_batch"] if "micro_batch" in kwargs else (args[0] if args else None)
            start = time.time()
            try:
                return method(self, *args, **kwargs)
            except StageError as error:
                if in_step:
                    self._step_failure = self._step_failure or error
                raise
            except Exception as error:  # noqa: BLE001 - every failure gets the stage's name
                stage_error = StageError(self.stage_index, op, micro_batch, f"{type(error).__name__}: {error}",
                                         replica=self.named_replica,
                                         remote_traceback=traceback.format_exc(), original=error)
                if in_step:
                    self._step_failure = self._step_failure or stage_error
                raise stage_error from error
            finally:
                self.ops_done += 1
                if timed:
                    self._events.append(OpEvent(self.stage_index, op, micro_batch, start, time.time(),
                                                self.replica))

        return wrapper

    return decorate
