"""A compiled graph over a group of actors (runtime/compiled_graph.py) and the
heartbeat watch beside a wait that cannot poll (runtime/health.py), with real
actors: a returned failure, a SIGKILLed actor, a SIGSTOPped one."""
import os
import signal
import threading
import time

import pytest
import ray

from raypipe.runtime.compiled_graph import CompiledCalls, GraphBroken
from raypipe.runtime.health import HUNG, BackgroundWatch, Watchdog, worker_actor_class


class Echo:
    """Answers heartbeats on a thread of its own, like a stage worker."""

    def step(self, arguments: tuple):
        value, fail, *seconds = arguments
        time.sleep(sum(seconds))
        if fail:
            return ValueError(f"failed on {value}")
        return value * 2, threading.current_thread().name

    def thread(self) -> str:
        return threading.current_thread().name

    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="health")
    def heartbeat(self) -> None:
        return None


@pytest.fixture
def actors(ray_cluster):
    started = [worker_actor_class(Echo).options(num_cpus=0).remote() for _ in range(2)]
    ray.get([actor.pid.remote() for actor in started])
    yield started
    for actor in started:
        ray.kill(actor)


def test_each_actor_gets_its_own_argument_and_other_calls_run_beside_the_graph(actors):
    calls = CompiledCalls(actors, "step")
    try:
        assert calls.over(list(actors)) and not calls.over(actors[:1])
        results = calls.results(calls.call([(1, False), (2, False)]))
        assert [value for value, _ in results] == [2, 4]
        graph_thread = results[0][1]
        assert ray.get(actors[0].thread.remote()) != graph_thread  # plain calls keep the default thread
        failed, fine = calls.results(calls.call([(3, True), (4, False)]))
        assert isinstance(failed, ValueError) and "failed on 3" in str(failed) and fine[0] == 8
        assert [value for value, _ in calls.results(calls.call([(5, False), (6, False)]))] == [10, 12]
    finally:
        calls.teardown()


def test_a_killed_actor_breaks_the_graph_and_the_survivor_can_join_a_new_one(actors):
    calls = CompiledCalls(actors, "step")
    os.kill(ray.get(actors[1].pid.remote()), signal.SIGKILL)
    broken, deadline = False, time.monotonic() + 30
    while not broken and time.monotonic() < deadline:  # Ray tears the graph down once it sees the death
        try:
            broken = any(isinstance(result, GraphBroken) for result in calls.results(calls.call([(1, False),
                                                                                                 (2, False)])))
        except ray.exceptions.RayError:  # torn down before this execution started
            broken = True
        time.sleep(0.1)
    assert broken
    calls.teardown()
    survivor = CompiledCalls(actors[:1], "step")
    try:
        assert survivor.results(survivor.call([(7, False)]))[0][0] == 14
    finally:
        survivor.teardown()


def test_the_watch_finds_a_stopped_actor_and_its_callback_ends_the_wait(actors):
    calls = CompiledCalls(actors, "step")
    pid = ray.get(actors[1].pid.remote())
    watch, found = BackgroundWatch(), []

    def end_wait(failed):
        found.append(failed)
        ray.kill(actors[1])
        calls.teardown()

    with watch.watching(Watchdog(hang_timeout_s=1.5), actors, lambda failed: None) as watched:
        assert calls.results(calls.call([(1, False), (2, False)]))[1][0] == 4  # a quick wait: nothing found
    assert watched.failed == {}
    try:
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with watch.watching(Watchdog(hang_timeout_s=1.5), actors, end_wait) as watched:
            references = calls.call([(1, False), (2, False)])
            results = calls.results(references)
        assert watched.failed == {1: HUNG} and found == [{1: HUNG}]
        assert isinstance(results[1], GraphBroken)
        assert 1.5 <= time.monotonic() - start < 20
    finally:
        os.kill(pid, signal.SIGKILL)
        calls.teardown()


def test_a_call_longer_than_rays_default_read_timeout_is_waited_for(actors):
    calls = CompiledCalls(actors, "step")
    try:
        start = time.monotonic()
        results = calls.results(calls.call([(1, False, 11.0), (2, False)]))  # RAY_CGRAPH_get_timeout: 10 s
        assert [value for value, _ in results] == [2, 4] and time.monotonic() - start >= 11.0
    finally:
        calls.teardown()
