"""Waiting under NCCL's rules: NCCL's ``Work.wait()`` neither blocks the host nor
raises, so a wait polls the Work's completion against an abort flag (set from
another thread by :meth:`raypipe.comm.p2p.P2PChannel.abort`) and a deadline
(``p2p_timeout_s``) instead (:func:`poll`). A gloo point-to-point Work on the
control channel says it completed only once waited for, so it is waited for on a
thread of its own when polled (:class:`WaitedOnThread`).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from raypipe.errors import StepAborted

LONGEST_POLL_S = 0.005  # a polled wait sleeps at most this long between looks at its Work
ABORTED = "the step was aborted (a worker of the group failed)"


def poll(work: Any, aborted: threading.Event, timeout_s: float, step_aborted: Callable[[str], StepAborted]) -> None:
    """Return once ``work`` completed; raise ``step_aborted(why)`` once ``aborted``
    is set, or when it did not complete within ``timeout_s``."""
    deadline, pause = time.monotonic() + timeout_s, 1e-4
    while not work.is_completed():
        if aborted.is_set():
            raise step_aborted(ABORTED)
        if time.monotonic() > deadline:
            raise step_aborted(f"it did not complete within p2p_timeout_s={timeout_s:g}s")
        time.sleep(pause)
        pause = min(2 * pause, LONGEST_POLL_S)


class WaitedOnThread:
    """A gloo point-to-point Work, waited for on a thread of its own once first
    polled (gloo's says it completed only once waited for), so that a polled wait
    can give up on it; its error is raised by :meth:`wait`."""

    def __init__(self, work: Any) -> None:
        self._work, self._thread, self._error = work, None, None

    def is_completed(self) -> bool:
        if self._thread is None:
            self._thread = threading.Thread(target=self._wait_in_gloo, name="raypipe-control-wait", daemon=True)
            self._thread.start()
        return not self._thread.is_alive()

    def wait(self, timeout: Any = None) -> bool:
        if self._thread is None:  # not polled: the plain wait
            return self._work.wait()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return True

    def _wait_in_gloo(self) -> None:
        try:
            self._work.wait()
        except RuntimeError as error:
            self._error = error
