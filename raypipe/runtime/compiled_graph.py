"""One method called on every actor of a group, each with its own argument, as a
Ray compiled graph (``experimental_compile``): ``step_calls="compiled"``.

A compiled graph's execution writes each argument into a channel the actor's
loop already reads (about 0.3 ms for two actors here, against ~2 ms for two
actor tasks), but Ray's channels are polled: every actor waiting in the graph,
and the driver waiting on a result, spins a core. Ray's rules for compiled
graphs shape this class:

- a result can be read once, and ``ray.wait`` does not apply to it, so
  :meth:`CompiledCalls.results` reads every result and turns a read that fails
  into the error itself;
- a graph over a dead actor is torn down by Ray, and a new graph on the same
  actors needs the old one torn down first: the owner recompiles when the
  actors change (:meth:`WorkerCalls.over`);
- the graph's loop runs on a thread of each actor's own; the actor's other
  methods still run on its default thread while the loop waits for input.
"""
from __future__ import annotations

from typing import Any

from raypipe.runtime.worker_calls import CallsBroken, WorkerCalls


class CompiledCalls(WorkerCalls):
    """``method`` on every one of ``actors`` (in rank order) per :meth:`call`,
    through one compiled graph."""

    def __init__(self, actors: list[Any], method: str) -> None:
        from ray.dag import InputNode, MultiOutputNode

        self.actors = list(actors)
        with InputNode() as arguments:
            graph = MultiOutputNode([getattr(actor, method).bind(arguments[rank])
                                     for rank, actor in enumerate(self.actors)])
        self._graph = graph.experimental_compile()

    def call(self, arguments: list[Any]) -> list[Any]:
        return self._graph.execute(*arguments)

    def results(self, pending: list[Any]) -> list[Any]:
        """Every result of one execution, each read with no timeout (Ray's default,
        ``RAY_CGRAPH_get_timeout``, is 10 s: shorter than a large model's step)."""
        values = []
        for rank, reference in enumerate(pending):
            try:
                values.append(reference.get(timeout=-1))
            except Exception as error:  # noqa: BLE001 - a torn-down graph raises Ray's channel or actor errors
                values.append(CallsBroken(rank, error))
        return values

    def interrupt(self) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Stop the actors' loops (after the running execution ends)."""
        self._graph.teardown()
