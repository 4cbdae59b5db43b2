"""The threads of a stage worker beside the one its ops run on: Ray concurrency
groups, named here so that the worker's methods (which pick one) and the actor
class (which declares them, :mod:`raypipe.runtime.actor_classes`) agree."""
from __future__ import annotations

HEALTH_GROUP = "health"  # heartbeats: answered even mid-step
CHECKPOINT_GROUP = "checkpoint"  # waits for a worker's background checkpoint files

# every group, with its number of threads
WORKER_CONCURRENCY_GROUPS: dict[str, int] = {HEALTH_GROUP: 1, CHECKPOINT_GROUP: 1}
