"""Calls over a connection from the driver to each actor of a group
(runtime/connection_calls.py over comm/call_socket.py) and the heartbeat checks between
waits on them (runtime/health.py), with real actors: a returned
failure, a SIGKILLed actor, a SIGSTOPped one, the key, what cannot be pickled."""
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import ray

import raypipe
from raypipe.comm.call_socket import AnswersCalls
from raypipe.runtime.actor_classes import worker_actor_class
from raypipe.runtime.connection_calls import CallsBroken, ConnectionCalls
from raypipe.runtime.health import HUNG, Watchdog
from tests.processes import seconds_until_gone, stop


class Echo(AnswersCalls):
    """Answers heartbeats on a thread of its own, like a stage worker."""

    def step(self, arguments: tuple):
        value, fail, *seconds = arguments
        time.sleep(sum(seconds))
        if fail == "unpicklable":
            return ValueError(threading.Lock())
        if fail:
            return ValueError(f"failed on {value}")
        return value * 2, threading.current_thread().name

    def thread(self) -> str:
        return threading.current_thread().name

    def pid(self) -> int:
        return os.getpid()

    def cpu_seconds(self) -> float:
        times = os.times()
        return times.user + times.system

    @ray.method(concurrency_group="health")
    def heartbeat(self) -> None:
        return None


def started_actors() -> list:
    started = [worker_actor_class(Echo).options(num_cpus=0).remote() for _ in range(2)]
    ray.get([actor.pid.remote() for actor in started])
    return started


@pytest.fixture
def actors(ray_cluster):
    """Two fresh actors, for a test that stops or kills one."""
    started = started_actors()
    yield started
    for actor in started:
        ray.kill(actor)


@pytest.fixture(scope="module")
def shared_actors(ray_cluster):
    """Two actors that the tests which neither stop nor kill them share, one after another: each
    tears down the connections it made before the next begins."""
    started = started_actors()
    yield started
    for actor in started:
        ray.kill(actor)


@contextlib.contextmanager
def connected(actors: list) -> Iterator[ConnectionCalls]:
    """Connections to ``actors`` for their ``step``, torn down however the test ends."""
    calls = ConnectionCalls(actors, "step")
    try:
        yield calls
    finally:
        calls.teardown()


def test_each_actor_gets_its_own_argument_and_other_calls_run_beside_the_connection(shared_actors):
    actors = shared_actors
    with connected(actors) as calls:
        assert calls.over(list(actors)) and not calls.over(actors[:1])
        results = calls.results(calls.call([(1, False), (2, False)]))
        assert [value for value, _ in results] == [2, 4]
        call_thread = results[0][1]
        assert ray.get(actors[0].thread.remote()) != call_thread  # plain calls keep the default thread
        failed, fine = calls.results(calls.call([(3, True), (4, False)]))
        assert isinstance(failed, ValueError) and "failed on 3" in str(failed) and fine[0] == 8
        assert [value for value, _ in calls.results(calls.call([(5, False), (6, False)]))] == [10, 12]


@pytest.mark.cluster
def test_a_killed_actor_breaks_its_connection_at_once_and_the_survivor_can_join_a_new_one(actors):
    with connected(actors) as calls:
        killed = ray.get(actors[1].pid.remote())
        os.kill(killed, signal.SIGKILL)
        seconds_until_gone(killed)  # the signal is delivered: the process has exited, its sockets closed
        start = time.monotonic()
        try:
            results = calls.results(calls.call([(1, False), (2, False)]))
            assert results[0][0] == 2 and isinstance(results[1], CallsBroken)
        except OSError:  # the closed connection was seen as the call was sent
            pass
        assert time.monotonic() - start < 5  # no heartbeat timeout needed: the connection closed
    with connected(actors[:1]) as survivor:
        assert survivor.results(survivor.call([(7, False)]))[0][0] == 14


@pytest.mark.cluster
def test_waiting_between_heartbeats_finds_a_stopped_actor_and_its_answer_once_killed(actors):
    pid = ray.get(actors[1].pid.remote())
    watchdog = Watchdog(hang_timeout_s=1.5)
    with connected(actors) as calls:
        pending = calls.call([(1, False), (2, False)])
        assert watchdog.wait_until(lambda timeout_s: calls.answered(pending, timeout_s), actors) == {}  # quick
        assert calls.results(pending)[1][0] == 4
        try:
            stop(pid)  # every thread stopped: none answers the call below
            start = time.monotonic()
            pending = calls.call([(1, False), (2, False)])
            assert watchdog.wait_until(lambda timeout_s: calls.answered(pending, timeout_s), actors) == {1: HUNG}
            assert 1.5 <= time.monotonic() - start < 20
            assert not calls.answered(pending, 0.1)
            os.kill(pid, signal.SIGKILL)  # as recovery kills it: its connection closes, which answers at once
            pid = None
            assert calls.answered(pending, 10)
            results = calls.results(pending)
            assert results[0][0] == 2 and isinstance(results[1], CallsBroken)
        finally:
            if pid is not None:
                os.kill(pid, signal.SIGKILL)


@pytest.mark.cluster
def test_a_teardown_finds_an_actor_stopped_in_its_call_instead_of_waiting_for_the_call(actors):
    """As a failed step ends: the driver closes the connections and waits for each call to end.
    A worker stopped inside its call never ends it; the wait finds it hung by its heartbeats
    (in hang_timeout_s, not end_timeout_s) and still waits for the other worker's call."""
    pid = ray.get(actors[1].pid.remote())
    calls = ConnectionCalls(actors, "step", end_timeout_s=120.0, hang_timeout_s=1.5)
    try:
        start = time.monotonic()
        calls.call([(1, False, 4.0), (2, False, 60.0)])  # worker 0's call ends in 4 s, worker 1's would in 60
        stop(pid)
        assert calls.teardown() == {1: HUNG}
        assert 4.0 <= time.monotonic() - start < 20  # worker 0's call was waited for, worker 1's was not
    finally:
        os.kill(pid, signal.SIGKILL)


def test_actors_waiting_on_connection_calls_use_no_cpu(shared_actors):
    """The point of the connection: a Ray compiled graph's idle actors each spin a
    core (measured here: ~3 s of CPU in 4 s); blocked on a connection, they use
    only what Ray's own threads do."""
    actors = shared_actors
    with connected(actors) as calls:
        assert [value for value, _ in calls.results(calls.call([(1, False), (2, False)]))] == [2, 4]
        before = ray.get([actor.cpu_seconds.remote() for actor in actors])
        time.sleep(2.0)
        used = [after - start for start, after in zip(before, ray.get([a.cpu_seconds.remote() for a in actors]))]
        assert max(used) < 0.5, used


def test_a_direct_connection_needs_the_key_and_every_reply_arrives(shared_actors):
    from multiprocessing import AuthenticationError

    from raypipe.comm import call_socket

    actors = shared_actors

    address = ray.get(actors[0].serve_calls.remote("step", b"the key"))
    with pytest.raises(AuthenticationError):
        call_socket.connect(tuple(address), b"another key")
    address = ray.get(actors[0].serve_calls.remote("step", b"the key"))  # the refused server ended
    connection = call_socket.connect(tuple(address), b"the key")
    try:
        call_socket.send(connection, (3, False))
        assert call_socket.receive(connection)[0] == 6
        call_socket.send(connection, (5, "unpicklable"))  # its failure holds what cannot be pickled
        reply = call_socket.receive(connection)
        assert isinstance(reply, raypipe.RaypipeError) and "could not be pickled" in str(reply)
        call_socket.send(connection, (4, False))  # the connection still serves
        assert call_socket.receive(connection)[0] == 8
    finally:
        connection.close()
        ray.get(actors[0].end_calls.remote(10))
