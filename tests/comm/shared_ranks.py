"""Ranks of the communication tests' process groups: processes forked from the tests' forkserver
(tests/forked.py) that the test modules of one pytest process start once and reuse
(:func:`shared_ranks`), each test running a module-level function on some of them
(:meth:`SharedRanks.run`) as ``torch.multiprocessing.start_processes`` would on fresh ones.

A rank is forked with torch and raypipe imported, and reused: the modules pay a rank's start (a
fork, a fraction of a second) once per rank, not once per rank per test. Every run joins its groups
afresh on ports of its own and leaves them at the end, and puts back any setting it changed, as the
functions did in processes of their own. A rank that
fails, or a run that outlasts its timeout, ends every rank (a peer left blocked on it would never
serve another run): the next run starts them afresh."""
from __future__ import annotations

import io
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.forked import CONTEXT


def _serve(rank: int, tasks: mp.Queue, answers: mp.Queue, shared: mp.Queue) -> None:
    """Rank ``rank``: run each task from ``tasks`` until killed, answering with what it returned
    (through torch.save: tensors as bytes, not shared with a process that may be gone) or its
    traceback; after a failure the rank ends."""
    torch.set_num_threads(1)
    while True:
        function, args, with_shared = tasks.get()
        try:
            result = function(rank, *args, *((shared,) if with_shared else ()))
            buffer = io.BytesIO()
            torch.save(result, buffer)
            answers.put((rank, None, buffer.getvalue()))
        except BaseException:  # noqa: BLE001 - reported to the test, which ends every rank
            answers.put((rank, traceback.format_exc(), None))
            return


class SharedRanks:
    """Forked processes, each started at the first :meth:`run` that needs it (and again after a
    failure)."""

    def __init__(self) -> None:
        self._processes: list = []
        self._tasks: list = []

    def run(self, function: Callable[..., Any], *args: Any, nprocs: int, shared_queue: bool = False,
            timeout_s: float = 300.0) -> list[Any]:
        """``function(rank, *args)`` on ranks ``0..nprocs - 1``, each rank's call in its
        process; what each returned, rank 0 first. ``shared_queue``: a queue every rank can reach is
        passed as the last argument (what ranks tell each other outside their group). A rank's failure
        is raised here with its traceback."""
        if nprocs < 1:
            raise ValueError(f"a run needs a rank, not {nprocs}")
        self._start(nprocs)
        for rank in range(nprocs):
            self._tasks[rank].put((function, args, shared_queue))
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(answers) < nprocs:
                try:
                    rank, error, data = self._answers.get(timeout=1.0)
                except queue.Empty:
                    gone = [rank for rank in range(nprocs) if not self._processes[rank].is_alive()]
                    if gone:
                        raise RuntimeError(f"{function.__name__}: rank(s) {gone} ended without an answer") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{function.__name__}: no answer from rank(s) "
                                           f"{sorted(set(range(nprocs)) - set(answers))} in {timeout_s:g} s") from None
                    continue
                if error is not None:
                    raise RuntimeError(f"{function.__name__} failed on rank {rank}:\n{error}")
                answers[rank] = torch.load(io.BytesIO(data), weights_only=False)
        except BaseException:
            self.close()
            raise
        return [answers[rank] for rank in range(nprocs)]

    def _start(self, nprocs: int) -> None:
        """Ranks up to ``nprocs - 1`` running."""
        if not self._processes:
            self._answers, self._shared = CONTEXT.Queue(), CONTEXT.Queue()
        for rank in range(len(self._processes), nprocs):
            self._tasks.append(CONTEXT.Queue())
            self._processes.append(CONTEXT.Process(
                target=_serve, args=(rank, self._tasks[rank], self._answers, self._shared), daemon=True))
            self._processes[rank].start()

    def close(self) -> None:
        """Stop every rank. Killed: an idle rank holds nothing to keep (a clean exit of one that has
        used a group takes seconds), and one blocked on a failed peer would never end by itself."""
        processes, self._processes, self._tasks = self._processes, [], []
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join()


_SHARED = SharedRanks()


def shared_ranks() -> SharedRanks:
    """This pytest process's ranks: idle between runs, and ended with the process (daemons, which
    multiprocessing stops at exit)."""
    return _SHARED
