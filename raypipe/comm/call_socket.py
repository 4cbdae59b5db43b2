"""Calls from the driver straight to a worker, over a TCP connection of their own.

An actor task costs the driver about a millisecond here (a task spec, a
scheduling round trip, a reply through the owner), and a Ray compiled graph,
which avoids that, polls its channels: every waiting worker spins a core (and
Ray 2.60 can abort the driver when a graph's actor dies: see
``benchmarks/RESULTS.md``). A connection kept open from the driver to each
worker costs one send and one receive per call (~0.1 ms for two workers here)
and blocks while it waits, so an idle worker uses no CPU.

The worker's end (:class:`AnswersCalls`, a mixin of the actor class) answers
one method's calls on a thread of its own, beside the actor's tasks, one call
at a time, until the driver closes the connection. The connection is
authenticated with a key the driver hands over through Ray
(``multiprocessing.connection``'s HMAC challenge), and messages are pickled as
Ray pickles task arguments (cloudpickle), never through torch's shared-memory
reductions.
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from ray import cloudpickle

from raypipe.errors import RaypipeError


def connect(address: tuple[str, int], authkey: bytes) -> Connection:
    """The driver's end of the connection to a worker serving at ``address``."""
    return _without_delay(Client(address, authkey=authkey))


def send(connection: Connection, message: Any) -> None:
    """Send one message (raises ``OSError`` once the other end is gone)."""
    connection.send_bytes(cloudpickle.dumps(message, protocol=5))


def receive(connection: Connection) -> Any:
    """The next message (raises ``EOFError`` or ``OSError`` once the other end is gone)."""
    return cloudpickle.loads(connection.recv_bytes())


class CallServer:
    """Answers ``handler(message)`` for each message of the one connection accepted
    on ``host`` (a free port, :attr:`address`), on a thread of its own; ``on_end()``
    runs on that thread once no call will come any more."""

    def __init__(self, handler: Callable[[Any], Any], host: str, authkey: bytes,
                 on_end: Callable[[], None] = lambda: None) -> None:
        self._listener = Listener((host, 0), authkey=authkey)
        self.address: tuple[str, int] = self._listener.address
        self._accepting = True
        self._on_end = on_end
        self._thread = threading.Thread(target=self._serve, args=(handler,), name="raypipe-calls", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait until the driver closed the connection and the call being answered (if
        any) ended; True if it did within ``timeout_s``."""
        if self._accepting:  # never connected: wake the accept with a connection that fails to authenticate
            try:
                Client(self.address, authkey=b"-").close()
            except Exception:  # noqa: BLE001 - the failed authentication is the point
                pass
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _serve(self, handler: Callable[[Any], Any]) -> None:
        try:
            self._answer(handler)
        finally:
            self._on_end()

    def _answer(self, handler: Callable[[Any], Any]) -> None:
        try:
            connection = _without_delay(self._listener.accept())
        except Exception:  # noqa: BLE001 - a connection that failed to authenticate ends the wait
            return
        finally:
            self._accepting = False
            self._listener.close()
        with connection:
            while True:
                try:
                    message = receive(connection)
                except (EOFError, OSError):
                    return
                try:
                    connection.send_bytes(_encoded(handler(message)))
                except OSError:
                    return


class AnswersCalls:
    """A mixin for an actor class: the worker's end of the driver's direct calls."""

    _call_server: CallServer | None = None

    def serve_calls(self, method: str, authkey: bytes, previous_end_s: float = 30.0, *,
                    on_end: Callable[[], None] = lambda: None) -> tuple[str, int]:
        """Answer ``method``'s calls on a new connection (any previous one ended
        first); returns the address the driver connects to. ``on_end()`` runs once
        the connection is over (a subclass's hook, not the driver's)."""
        import ray

        self.end_calls(previous_end_s)
        self._call_server = CallServer(getattr(self, method), ray.util.get_node_ip_address(), authkey, on_end)
        return self._call_server.address

    def end_calls(self, timeout_s: float) -> None:
        """Wait for the connection's thread to end (the driver closes the connection);
        raise if the call being answered did not end within ``timeout_s``."""
        server, self._call_server = self._call_server, None
        if server is not None and not server.join(timeout_s):
            raise RaypipeError(f"the call being answered on the driver's connection did not end within {timeout_s:g}s")


def _encoded(reply: Any) -> bytes:
    """``reply`` pickled, or an error saying why it cannot be (an exception holding an
    unpicklable object): the driver always gets an answer."""
    try:
        return cloudpickle.dumps(reply, protocol=5)
    except Exception as error:  # noqa: BLE001 - any pickling failure
        return cloudpickle.dumps(RaypipeError(f"the worker's reply could not be pickled ({error}): {reply!r:.500}"))


def _without_delay(connection: Connection) -> Connection:
    # a message's length and body go as two writes: with Nagle's algorithm the body
    # waits for the length's ACK, which the receiver delays by up to 40 ms
    sock = socket.socket(fileno=connection.fileno())  # the same socket: detached, or collecting it closes it
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()
    return connection
