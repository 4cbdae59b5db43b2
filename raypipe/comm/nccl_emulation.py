"""An emulation of NCCL's documented point-to-point semantics over gloo, standing
in where NCCL cannot run (a CPU machine: the test suite), so that the code
written for NCCL runs under NCCL's rules there. It is not a transport to train
with: enable it with ``RAYPIPE_EMULATE_NCCL=1`` in the driver's environment
(:func:`requested`, the one place that reads it; the driver passes the choice
to every worker when it joins the group).

What NCCL does, and gloo does not, that the emulation reproduces
(:class:`EmulatedStream`):

- **rendezvous sends**: a send completes only once its receive is posted (the
  receiver acknowledges the posting before the data moves), so two ranks that
  each send before receiving wait on each other forever once the messages
  outgrow NCCL's buffers; the emulation makes every message that large;
- **one stream per rank**: a rank's operations run one batch after another in
  issue order (the operations of one ``batch_isend_irecv`` together), and a
  pair's messages match in issue order (tags are ignored: one tag);
- **asynchronous Work**: ``wait()`` only orders "the stream" and returns at
  once; the host learns that an operation ran only by polling
  ``is_completed()`` at its sync points;
- **a departed peer never raises**: an operation with a peer that left or died
  never completes (NCCL hangs until its watchdog), so a survivor is released
  only by aborting (:meth:`EmulatedStream.stop`, from
  :meth:`raypipe.comm.p2p.P2PChannel.abort`).

Collectives of the data group (the replicas' gradient sums) run on gloo as
they are, waited for beside the host, their errors swallowed likewise
(:class:`SilentCollective`).
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Any

import torch
import torch.distributed as dist

from raypipe.comm.polled_wait import WaitedOnThread, WaitingThreads

ENVIRONMENT_VARIABLE = "RAYPIPE_EMULATE_NCCL"

# the emulated stream's two tags on its gloo group: the data (one tag: a pair's messages match in
# issue order), and the receiver's word that a receive is posted (the rendezvous)
_DATA_TAG, _POSTED_TAG = 1, 2


def requested() -> bool:
    """Whether ``RAYPIPE_EMULATE_NCCL=1`` asks for the emulation (read by the driver only)."""
    return os.environ.get(ENVIRONMENT_VARIABLE, "") == "1"


class EmulatedWork:
    """The Work of one emulated batch: completes when all of its operations ran;
    ``wait()`` never blocks the host (as NCCL's: it only orders the stream)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def complete(self) -> None:
        """Every operation of the batch ran (called by the emulated stream)."""
        self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        return True


class SilentCollective:
    """A gloo collective's Work with NCCL's failure behaviour: one that failed
    (a departed peer) never completes, instead of raising.

    Some of gloo's collectives run, or say they completed, only once waited for
    (``reduce_scatter_single``: ZeRO-1's gradient reduction), where NCCL's
    complete on their own; so the gloo Work is waited for on a thread of ``pool``
    once first polled (:class:`~raypipe.comm.polled_wait.WaitedOnThread`), and
    a polled wait sees it complete as NCCL's would."""

    def __init__(self, work: Any, pool: WaitingThreads) -> None:
        self._work, self._failed = WaitedOnThread(work, pool), False

    def is_completed(self) -> bool:
        if self._failed or not self._work.is_completed():
            return False
        try:
            self._work.wait()
        except RuntimeError:
            self._failed = True
            return False
        return True

    def wait(self, timeout: Any = None) -> bool:
        return True


class EmulatedStream:
    """One rank's emulated NCCL stream over a gloo ``group``: batches of
    point-to-point operations (``(dist.isend | dist.irecv, tensor, peer, tag)``,
    ``peer`` a rank of the group, tags ignored) run in issue order on a thread of
    the stream's own, as a GPU runs them beside the host."""

    def __init__(self, group: Any) -> None:
        self._group = group  # the group itself, not "the default group": that may be a later one
        self._batches: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raypipe-emulated-nccl-stream", daemon=True)
        self._thread.start()

    def start(self, operations: list[tuple[Any, torch.Tensor, int, int]]) -> list[EmulatedWork]:
        """Enqueue one batch; its one Work (as NCCL's coalesced batch has one)."""
        work = EmulatedWork()
        self._batches.put((operations, work))
        return [work]

    def stop(self) -> None:
        """Stop running batches (an abort): every pending Work stays incomplete. A gloo
        wait already in progress cannot be interrupted; it ends with the peer or at
        gloo's timeout, and is ignored."""
        self._stopped.set()
        self._batches.put(None)

    def _run(self) -> None:
        while True:
            batch = self._batches.get()
            if batch is None or self._stopped.is_set():
                return
            operations, work = batch
            if not self._ran(operations):
                return  # a peer departed: like NCCL, this stream never completes another operation
            work.complete()

    def _ran(self, operations: list[tuple[Any, torch.Tensor, int, int]]) -> bool:
        """Run one batch: each peer's operations in order on a thread of their own
        (a batch's operations with different peers progress independently)."""
        by_peer: dict[int, list[tuple[Any, torch.Tensor]]] = {}
        for function, tensor, peer, _tag in operations:
            by_peer.setdefault(peer, []).append((function, tensor))
        outcomes: list[bool] = []
        threads = [threading.Thread(target=lambda p=peer, o=ops: outcomes.append(self._with_peer(p, o)), daemon=True)
                   for peer, ops in by_peer.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return len(outcomes) == len(threads) and all(outcomes) and not self._stopped.is_set()

    def _with_peer(self, peer: int, operations: list[tuple[Any, torch.Tensor]]) -> bool:
        """One peer's operations of a batch: every receive posted first (and the peer told
        so), then each send once the peer said its receive is posted. False when a gloo
        operation failed (the peer left): swallowed, the batch never completes."""
        group, pending = self._group, []
        try:
            for function, tensor in operations:
                if function is dist.irecv:
                    pending.append(dist.irecv(tensor, peer, group=group, tag=_DATA_TAG))
                    pending.append(dist.isend(torch.zeros(1, dtype=torch.uint8), peer, group=group, tag=_POSTED_TAG))
            for function, tensor in operations:
                if function is dist.isend:
                    dist.irecv(torch.empty(1, dtype=torch.uint8), peer, group=group, tag=_POSTED_TAG).wait()
                    if self._stopped.is_set():
                        return False
                    pending.append(dist.isend(tensor, peer, group=group, tag=_DATA_TAG))
            for work in pending:
                work.wait()
        except Exception:  # noqa: BLE001 - a peer that left, or a group already left: never completes
            return False
        return True
