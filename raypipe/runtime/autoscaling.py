"""Asking Ray's autoscaler for the nodes an elastic run wants.

Ray 2.60 findings this module rests on (read in the installed ``ray`` package and
in Ray's GCS source, ``gcs_autoscaler_state_manager.cc``):

- ``ray.autoscaler.sdk.request_resources(num_cpus=None, bundles=None,
  bundle_label_selectors=None)`` (a ``@DeveloperAPI``) stores ONE cluster-wide
  request: each call replaces the previous one, whoever made it. The autoscaler
  keeps enough nodes for all of its bundles to fit at once -- a floor on the
  cluster's size, counted together with what is running, not added to it.
  ``request_resources(bundles=[])`` (or ``num_cpus=0``: both end as an empty
  list) clears it, for the v1 autoscaler (a JSON list in the GCS key-value store
  that the monitor reads every few seconds) and for v2 (a resource constraint
  held by the GCS).
- The request is not tied to the job or the driver: nothing in the GCS clears
  it when the job ends, so it stands after the driver is gone until a later call
  replaces it (v2's constraint is held in GCS memory, so a GCS restart drops it;
  v1's key-value entry survives one where the GCS is backed by Redis).
- On a cluster without an autoscaler (a plain ``ray.init()``) it is stored and
  never read: harmless.
- No public API reads the standing request back; ``ray status`` prints the
  autoscaler's view of it under "From request_resources:".

Why nothing here watches for draining nodes: in Ray 2.60 the v2 autoscaler (idle
or preemption) and a SIGTERM to ``ray start`` (30 s by default) drain a node
through the GCS autoscaler ``DrainNode`` RPC, which leaves a window before the
node goes (v1's idle scale-down shuts the raylet down at once), but a driver can
see that window only through private or unannotated APIs
(``ray._raylet.GcsClient.get_draining_nodes``,
``ray._private.state.state.get_draining_nodes``,
``ray.autoscaler.v2.sdk.get_cluster_status``); ``ray.nodes()`` and
``ray.util.state.list_nodes`` show a draining node as plain alive, and
``ray drain-node`` is a hidden CLI without stability guarantees. What is public
comes after the fact: an actor whose node was drained for preemption dies with
``ActorDiedError.preempted`` set.
"""
from __future__ import annotations

import atexit
import logging
import math
import time
import uuid
from typing import Any

import ray
from ray.autoscaler.sdk import request_resources
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger(__name__)
GUARD_PERIOD_S = 1.0  # how often the guard checks that the driver is alive
GUARD_NAMESPACE = "raypipe"


class ResourceRequest:
    """The standing autoscaler request of one elastic run: ``num_replicas`` copies
    of one replica's bundles.

    Why: an autoscaling cluster (the cluster launcher, KubeRay's in-tree
    autoscaler) only adds nodes for demand it sees. The placement groups of
    replicas that do not fit yet are such demand only while they are pending;
    asking for ``max`` replicas' bundles up front keeps the nodes coming (and
    keeps them from being scaled down as idle) for as long as the run wants them.

    The request is cluster-wide and last-writer-wins: two runs, or two
    ``ResourceRequest`` objects, on one cluster replace each other's requests, and
    a withdrawal clears whatever stands.

    While a request stands an ``atexit`` hook withdraws it, so a driver that ends
    with an uncaught exception, ``sys.exit`` or SIGTERM (``ray.init`` turns
    SIGTERM into ``sys.exit``; ``ray job stop`` sends SIGTERM first) does not leave
    the cluster scaled up. A driver that ends without running it (SIGKILL: ``ray
    job stop`` after its grace period, an OOM kill; ``os._exit``; a crash of the
    interpreter; a ``ray.shutdown()`` before the withdrawal) is covered by a
    :class:`RequestGuard` on the driver's node, since Ray does not withdraw a
    request when its job ends. Only the loss of the driver's node itself (guard
    and all) leaves the request standing, until another ``request_resources``
    call replaces it.
    """

    def __init__(self, bundles_per_replica: list[dict[str, float]]):
        self._bundles_per_replica = _checked_bundles(bundles_per_replica)
        self._standing = False
        self._guard: Any = None  # (guard, sentinel) actor handles while a request stands

    @property
    def standing(self) -> bool:
        """Whether this object made a request it has not withdrawn (another may have replaced it since)."""
        return self._standing

    def request(self, num_replicas: int) -> None:
        """Ask for ``num_replicas`` replicas' bundles, replacing any standing request;
        0 withdraws."""
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 0:
            raise ValueError(f"num_replicas must be an int >= 0, got {num_replicas!r}")
        if num_replicas == 0:
            self.withdraw()
            return
        # Each bundle is a separate shape to the autoscaler: request_resources has
        # no placement strategy (only per-bundle label selectors), so "one
        # replica's bundles on one node", the PACK of a replica's placement group,
        # cannot be asked for. PACK is soft, so nodes that fit all the bundles can
        # place the replicas; only their locality is not part of the request.
        request_resources(bundles=[dict(bundle) for bundle in self._bundles_per_replica] * num_replicas)
        if not self._standing:
            atexit.register(self.withdraw)
            self._guard = start_guard()
            self._standing = True

    def withdraw(self) -> None:
        """Clear the standing request; idempotent."""
        if not self._standing:
            return
        atexit.unregister(self.withdraw)
        self._standing = False
        guard, self._guard = self._guard, None
        if not ray.is_initialized():
            logger.warning("Ray was shut down before the autoscaler request was withdrawn; the guard on this "
                           "node withdraws it once it finds this driver gone")
            return
        for actor in guard:  # first: a guard left running would clear a later run's request when this job ends
            ray.kill(actor)
        request_resources(bundles=[])


class DriverSentinel:
    """An actor that lives exactly as long as the driver that created it: Ray kills an
    actor whose owner has died."""

    def alive(self) -> bool:
        return True


class RequestGuard:
    """A detached actor that withdraws the standing request once the driver that made
    it is gone without withdrawing it (its :class:`DriverSentinel` died), then exits.
    The driver kills it when it withdraws the request itself."""

    def __init__(self, sentinel: Any) -> None:
        self._sentinel = sentinel
        # the guard starts its own watch: a call the driver queued would wait in the driver until this
        # actor runs, and go with a driver killed before then
        ray.get_runtime_context().current_actor.watch.remote()

    def watch(self, period_s: float = GUARD_PERIOD_S) -> None:
        while _answers(self._sentinel, timeout_s=max(10 * period_s, 30.0)):
            time.sleep(period_s)
        request_resources(bundles=[])
        ray.actor.exit_actor()


def start_guard() -> tuple[Any, Any]:
    """A :class:`RequestGuard` (detached) and the driver's :class:`DriverSentinel` it watches,
    both on this (the driver's) node and without CPUs; returns both handles."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    sentinel = ray.remote(DriverSentinel).options(num_cpus=0, max_restarts=0, scheduling_strategy=here).remote()
    # named: Ray registers a named actor with the GCS before .remote() returns (an unnamed one only after,
    # from the driver), so the guard starts even when the driver is killed the moment after; in a namespace
    # of its own, as Ray asks of a named detached actor (else it warns on the driver's output)
    guard = ray.remote(RequestGuard).options(num_cpus=0, max_restarts=0, lifetime="detached",
                                             name=f"request-guard-{uuid.uuid4().hex}", namespace=GUARD_NAMESPACE,
                                             scheduling_strategy=here).remote(sentinel)
    return guard, sentinel


def _answers(actor: Any, timeout_s: float) -> bool:
    """False once ``actor`` has died; True while it answers (or is merely slow to)."""
    try:
        ray.get(actor.alive.remote(), timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):  # slow or unreachable for now
        return True
    except ray.exceptions.ActorDiedError:
        return False
    return True


def _checked_bundles(bundles: list[dict[str, float]]) -> list[dict[str, float]]:
    if not isinstance(bundles, list) or not bundles:
        raise ValueError(f"bundles_per_replica must be a non-empty list of resource dicts, got {bundles!r}")
    for index, bundle in enumerate(bundles):
        if not isinstance(bundle, dict) or not bundle:
            raise ValueError(f"bundles_per_replica[{index}] must be a non-empty dict of resources, got {bundle!r}")
        for name, amount in bundle.items():
            if not isinstance(name, str):
                raise ValueError(f"bundles_per_replica[{index}] has a resource name that is not a str: {name!r}")
            valid = isinstance(amount, (int, float)) and not isinstance(amount, bool)
            if not valid or not math.isfinite(amount) or amount < 0:
                raise ValueError(f"bundles_per_replica[{index}][{name!r}] must be a finite number >= 0, "
                                 f"got {amount!r}")
    return [dict(bundle) for bundle in bundles]
