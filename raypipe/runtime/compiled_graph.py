"""One method called on every actor of a group, each with its own argument, as a
Ray compiled graph (``experimental_compile``).

A plain actor call costs the driver about a millisecond here (a task spec, a
scheduling round trip, a reply through the owner); a compiled graph's
execution writes each argument into a channel the actor's loop already reads
(about 0.3 ms for two actors). Ray's rules for compiled graphs shape this class:

- a result can be read once, and ``ray.wait`` does not apply to it, so
  :meth:`CompiledCalls.results` reads every result and turns a read that fails
  into the error itself;
- a graph over a dead actor is torn down by Ray, and a new graph on the same
  actors needs the old one torn down first: the owner recompiles when the
  actors change (:meth:`CompiledCalls.over`);
- the graph's loop runs on a thread of each actor's own; the actor's other
  methods still run on its default thread while the loop waits for input.
"""
from __future__ import annotations

from typing import Any


class GraphBroken(Exception):
    """Reading an actor's result failed: the graph was torn down (an actor died,
    or the graph was torn down while this execution ran)."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"worker {rank}: {error}")
        self.rank, self.error = rank, error


class CompiledCalls:
    """``method`` on every one of ``actors`` (in rank order) per :meth:`call`,
    through one compiled graph."""

    def __init__(self, actors: list[Any], method: str) -> None:
        from ray.dag import InputNode, MultiOutputNode

        self.actors = list(actors)
        with InputNode() as arguments:
            graph = MultiOutputNode([getattr(actor, method).bind(arguments[rank])
                                     for rank, actor in enumerate(self.actors)])
        self._graph = graph.experimental_compile()

    def over(self, actors: list[Any]) -> bool:
        """Whether this graph calls exactly ``actors``."""
        return list(actors) == self.actors  # handles compare by actor id

    def call(self, arguments: list[Any]) -> list[Any]:
        """Start one execution (``arguments[rank]`` to rank's actor); its result references."""
        return self._graph.execute(*arguments)

    @staticmethod
    def results(references: list[Any]) -> list[Any]:
        """Every result of one execution, waiting for each as long as it takes (Ray's
        default read timeout, ``RAY_CGRAPH_get_timeout``, is 10 s: shorter than a
        large model's step; whoever waits watches for hangs); a read that fails
        gives :class:`GraphBroken` in that rank's place."""
        values = []
        for rank, reference in enumerate(references):
            try:
                values.append(reference.get(timeout=-1))
            except Exception as error:  # noqa: BLE001 - a torn-down graph raises Ray's channel or actor errors
                values.append(GraphBroken(rank, error))
        return values

    def teardown(self) -> None:
        """Stop the actors' loops (after the running execution ends); idempotent."""
        self._graph.teardown()
