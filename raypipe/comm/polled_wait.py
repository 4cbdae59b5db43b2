"""Waiting under NCCL's rules: NCCL's ``Work.wait()`` neither blocks the host nor
raises, so a wait polls the Work's completion against an abort flag (set from
another thread by :meth:`raypipe.comm.p2p.P2PChannel.abort`) and a deadline
(``p2p_timeout_s``) instead (:func:`poll`). A gloo point-to-point Work on the
control channel says it completed only once waited for, so it is waited for on a
thread of the channel's own when polled (:class:`WaitedOnThread`), made once and
reused (:class:`WaitingThreads`), not a new OS thread each. A stage's channel waits through
:class:`StepWaits`.

On gloo, a peer that leaves the group makes every receive from it, and every collective
with it, fail at once. NCCL's ``Work.wait()`` neither blocks the host nor raises, and a host
sync on a transfer from a departed peer waits until NCCL's watchdog fires; so on NCCL (and
under its emulation, :mod:`raypipe.comm.nccl_emulation`) every wait polls, and
:meth:`~raypipe.comm.p2p.P2PChannel.abort`, called from the worker's health thread while
the step is blocked, sets the flag and aborts the communicators (never a destroy, which
waits for pending work): the step raises :class:`~raypipe.errors.StepAborted` and the group
is formed afresh.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any

from raypipe.core.topology import Topology
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


class WaitingThreads:
    """A channel's threads that wait in gloo for polled Works (:class:`WaitedOnThread`): made
    only when none is idle and reused after (a step's waits come one or two at a time, so a
    step makes none once the first made its few). Not a ``ThreadPoolExecutor``: its threads
    are joined at interpreter exit, and a wait of an aborted step may hang in gloo until the
    group's timeout; these are daemon threads, and never too few (a hung one is replaced)."""

    def __init__(self) -> None:
        self._jobs: SimpleQueue = SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.started = 0  # threads made so far

    def submit(self, wait: Callable[[], Any]) -> Future:
        """Run ``wait`` on an idle thread, or a new one; its outcome is the Future's."""
        future: Future = Future()
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                self.started += 1
                threading.Thread(target=self._serve, name="raypipe-control-wait", daemon=True).start()
        self._jobs.put((wait, future))
        return future

    def _serve(self) -> None:
        while True:
            wait, future = self._jobs.get()
            try:
                future.set_result(wait())
            except BaseException as error:  # noqa: BLE001 - the waiter's to raise
                future.set_exception(error)
            del wait, future  # a finished Work keeps no connection open while this thread idles
            with self._lock:
                self._idle += 1


class WaitedOnThread:
    """A gloo point-to-point Work, waited for on a thread of ``pool`` once first
    polled (gloo's says it completed only once waited for), so that a polled wait
    can give up on it; its error is raised by :meth:`wait`."""

    def __init__(self, work: Any, pool: WaitingThreads) -> None:
        self._work, self._pool = work, pool
        self._waited: Future | None = None

    def is_completed(self) -> bool:
        if self._waited is None:
            self._waited = self._pool.submit(self._work.wait)
        return self._waited.done()

    def wait(self, timeout: Any = None) -> bool:
        if self._waited is None:  # not polled: the plain wait
            return self._work.wait()
        # the Work is let go first: a failed wait's error refers back to this object (its traceback's frames), so
        # until the garbage collector breaks that cycle the Work would keep the group's connections open after the
        # step left it, and a peer waiting on this worker would not see it leave
        self._work = None
        self._waited.result()  # raises the wait's error
        return True


class StepWaits:
    """How one stage's channel waits for its operations, and the :class:`StepAborted` a wait that
    fails raises: in gloo, which raises when a peer leaves, or under NCCL's rules (``polls``) by
    :func:`poll` against ``aborted`` and ``timeout_s`` (``p2p_timeout_s``). ``aborted`` is set from
    another thread (:meth:`raypipe.comm.p2p.P2PChannel.abort`) and cleared when a group is joined."""

    def __init__(self, topology: Topology, replica: int, stage: int) -> None:
        self.topology, self.replica, self.stage = topology, replica, stage
        self.aborted = threading.Event()
        self.polls = False
        self.timeout_s = 300.0
        # where polled gloo Works are waited for (WaitedOnThread): threads made once and reused
        self.pool = WaitingThreads()

    def wait(self, work: Any, peer_rank: int | None, micro_batch: int | None, what: str) -> None:
        """Wait for ``work`` (a transfer of ``what`` with ``peer_rank``, None: a collective or a send)."""
        if self.polls:
            poll(work, self.aborted, self.timeout_s, lambda why: self.step_aborted(peer_rank, micro_batch, what, why))
        try:
            work.wait()  # completed when polled: returns at once, or raises the transport's error
        except RuntimeError as error:
            source = "a worker" if peer_rank is None else f"stage {self.topology.coordinates(peer_rank).stage}"
            raise self.step_aborted(peer_rank, micro_batch, what,
                                    f"{source} left the step before this {what} completed ({error})") from None

    def refuse_after_abort(self, what: str) -> None:
        """Issue nothing more once aborted (the step is ending)."""
        if self.aborted.is_set():
            raise self.step_aborted(None, None, what, ABORTED)

    def step_aborted(self, peer_rank: int | None, micro_batch: int | None, what: str, why: str) -> StepAborted:
        return StepAborted(self.stage, "recv" if what in ("activation", "gradient") else what, micro_batch, why,
                           replica=self.replica if self.topology.num_replicas > 1 else None)


class WorkOfParts:
    """The Work of a message of several parts (:mod:`raypipe.comm.tree_messages`), one Work each:
    completed once every part's is; :meth:`wait` waits for each (raising the first error)."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait()
        return True


def work_of_parts(works: list[Any]) -> Any:
    """One Work for a message's parts' ``works``: the one Work itself where they are one (a single
    part, or an NCCL batch's one Work for all), else a :class:`WorkOfParts`."""
    distinct = list({id(work): work for work in works}.values())
    return distinct[0] if len(distinct) == 1 else WorkOfParts(distinct)
