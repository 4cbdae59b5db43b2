"""Keeps a step that reaches a worker over the driver's connection behind the
actor calls the driver submitted before it.

Actor tasks run one at a time in submission order on the worker's default
thread, so a snapshot submitted after step N runs before step N+1's task. A
step sent over the connection runs on a thread of its own, beside those tasks: without
a gate, step N+1 could change the weights while the snapshot of step N is still
being copied out. The driver numbers the calls a step must follow and, after
them, submits :meth:`StepGate.open` with that number (an actor task, so it runs
after them, their results stored). The step waits in :meth:`StepGate.wait`
before its first op that changes what those calls copy (its commit, or its
first forward when the layers' state dict holds buffers, which a forward may
update): a snapshot is copied out while the next step's forward and backward run.

The same numbering runs the other way for a snapshot taken as the next step
starts (:meth:`~raypipe.executor.per_step_worker.PerStepWorker.snapshot_at_first_wait`):
the step opens a second gate with its number when it first waits for a
neighbour, and the snapshot waits for that, so the copy runs in the stage's
share of the pipeline's bubble. That snapshot is a gate call itself: it opens
the step's gate as soon as the state is copied (before the copy is shipped), in
place of a second actor task; the calls submitted before it have run by then,
as they would have before a separate gate call.
"""
from __future__ import annotations

import threading

from raypipe.errors import RaypipeError


class StepGate:
    """How far the calls a step must follow have run on this worker."""

    def __init__(self) -> None:
        self._opened = 0
        self._changed = threading.Condition()

    def open(self, count: int) -> None:
        """The calls up to number ``count`` have run (called by an actor task after them)."""
        with self._changed:
            self._opened = max(self._opened, count)
            self._changed.notify_all()

    def wait(self, count: int, timeout_s: float) -> bool:
        """Return once the calls up to number ``count`` have run (True if that took a
        wait); raise after ``timeout_s``."""
        with self._changed:
            if self._opened >= count:
                return False
            if not self._changed.wait_for(lambda: self._opened >= count, timeout=timeout_s):
                raise RaypipeError(f"the calls this step must follow (up to number {count}) did not run within "
                                   f"{timeout_s:g}s; {self._opened} did")
            return True
