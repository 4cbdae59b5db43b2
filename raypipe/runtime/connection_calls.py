"""One method called on every actor of a group over a connection from the driver
to each (``step_calls="connections"``, the default): see :mod:`raypipe.comm.call_socket`.

Each actor must mix in :class:`~raypipe.comm.call_socket.AnswersCalls`. The
connections are set up through actor tasks (an authentication key in, an
address back), then a call is one message each way per actor, answered on a
thread of the actor's own, beside its actor tasks. The driver waits with
:meth:`ConnectionCalls.answered` between heartbeat checks: a worker that dies closes
its connection, which answers at once; a hung or unreachable one is for the
heartbeats.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Collection
from multiprocessing import connection as connections
from typing import Any

import ray

from raypipe.comm import call_socket
from raypipe.runtime.health import Watchdog, get_watched


class CallsBroken(Exception):
    """Reading a worker's result failed: its connection was closed (the worker
    died) or its reply could not be read."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"worker {rank}: {error}")
        self.rank, self.error = rank, error


class ConnectionCalls:
    """``method`` on every one of ``actors`` (in rank order) per :meth:`call`, over
    one connection each; :meth:`teardown` waits up to ``end_timeout_s`` for a call
    still running on a worker. Opening them, or waiting at the teardown, a worker that
    does not answer its heartbeats for ``hang_timeout_s`` (stopped, wedged) is found
    hung: opening raises :class:`~raypipe.errors.WorkersLost` (its ``serve_calls``
    would not return until gRPC's keepalive gave up on it, minutes later)."""

    def __init__(self, actors: list[Any], method: str, end_timeout_s: float = 30.0,
                 hang_timeout_s: float = 30.0) -> None:
        self.actors, self._end_timeout_s, self._hang_timeout_s = list(actors), end_timeout_s, hang_timeout_s
        self._open = True
        authkey = secrets.token_bytes(32)
        addresses = get_watched([actor.serve_calls.remote(method, authkey, end_timeout_s) for actor in self.actors],
                                self.actors, hang_timeout_s)
        self._connections = []
        try:
            for address in addresses:
                self._connections.append(call_socket.connect(tuple(address), authkey))
        except BaseException:
            self.teardown()
            raise

    def over(self, actors: list[Any]) -> bool:
        """Whether these connections go to exactly ``actors``."""
        return list(actors) == self.actors  # handles compare by actor id

    def call(self, arguments: list[Any]) -> list[Any]:
        """Send every actor its argument (``arguments[rank]`` to rank's); what
        :meth:`results` reads. A connection already gone raises ``OSError``."""
        for connection, argument in zip(self._connections, arguments):
            call_socket.send(connection, argument)
        return list(self._connections)

    def answered(self, pending: list[Any], timeout_s: float) -> bool:
        """Whether every worker of ``pending`` answered (or closed its connection)
        within ``timeout_s``."""
        end, waiting = time.monotonic() + timeout_s, list(pending)
        while waiting and time.monotonic() < end:
            readable = connections.wait(waiting, max(0.0, end - time.monotonic()))
            waiting = [connection for connection in waiting if connection not in readable]
        return not waiting

    def results(self, pending: list[Any]) -> list[Any]:
        """Every result of one :meth:`call` (once :meth:`answered`); a read that
        fails (a closed connection, a reply that cannot be unpickled) gives
        :class:`CallsBroken` in that rank's place."""
        values = []
        for rank, connection in enumerate(pending):
            try:
                values.append(call_socket.receive(connection))
            except Exception as error:  # noqa: BLE001 - EOFError, OSError, or an unpicklable reply
                values.append(CallsBroken(rank, error if str(error) else EOFError("the connection was closed")))
        return values

    def teardown(self, wait: bool = True, skip: Collection[int] = ()) -> dict[int, str]:
        """Close every connection, then (with ``wait``) wait for each live worker's call to
        end, but those ``skip`` (ranks known lost): a dead worker's wait fails at once, one
        whose call does not end is given up after ``end_timeout_s``, and one found dead or hung
        by its heartbeats (a stopped worker's call never ends) is not waited for further while
        the others' calls end. Returns those found (rank ->
        :data:`~raypipe.runtime.health.DIED` | ``HUNG`` | ``UNREACHABLE``); idempotent."""
        if not self._open:
            return {}
        self._open = False
        for connection in self._connections:
            connection.close()
        if not wait:
            return {}
        ended = {rank: actor.end_calls.remote(self._end_timeout_s) for rank, actor in enumerate(self.actors)
                 if rank not in skip}
        found: dict[int, str] = {}
        deadline = time.monotonic() + self._end_timeout_s + 5
        while (waiting := [rank for rank in ended if rank not in found]) and time.monotonic() < deadline:
            lost = Watchdog(self._hang_timeout_s).wait([ended[rank] for rank in waiting],
                                                       [self.actors[rank] for rank in waiting],
                                                       deadline_s=deadline - time.monotonic())
            if not lost:  # every call ended, or the deadline passed
                break
            found.update({waiting[index]: why for index, why in lost.items()})
        done, _ = ray.wait(list(ended.values()), num_returns=len(ended), timeout=0, fetch_local=False)
        for reference in done:
            try:
                ray.get(reference)
            except Exception:  # noqa: BLE001 - a dead worker, or a call that did not end (its next step fails)
                pass
        return found
