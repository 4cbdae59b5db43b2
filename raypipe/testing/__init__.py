"""Test and benchmark aids that ship with raypipe, so benchmarks, the planner's
checks and users' own capacity tests can use them: layers whose compute takes a
fixed time without using a core (``timed_layers``)."""
from raypipe.testing.timed_layers import TimedBoundary, TimedLayer, timed_model

__all__ = ["TimedBoundary", "TimedLayer", "timed_model"]
