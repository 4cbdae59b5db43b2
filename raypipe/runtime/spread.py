"""Spreading pipeline replicas over nodes, softly.

Each replica is one plain PACK placement group: its stages packed (a pipeline's
neighbours talk most). Ray has no anti-affinity between placement groups, and
PACK's scoring puts a second group where the most room is left, often the node
of the first (always, on nodes of unequal size), so one lost node would take out
every replica and leave the run nothing to shrink to.

So while a replica's group is asked for, the free room of the nodes that placed
replicas use is held by a short-lived *hold*: a placement group pinned to those
nodes by Ray's per-bundle label selectors on the default ``ray.io/node-id``
label. The replica's group then lands on another node (PACK prefers one with
room for all of it), and the hold is removed as soon as that group is placed, or
after :data:`SPREAD_WAIT_S` if it is not, when the group is placed wherever Ray
finds room, as without spreading. The replica's own group carries no label
selector: Ray keeps a placement group's selectors when it re-places the bundles
of a lost node, so a group pinned to its node would never be placed again.
Spreading is tried only when some node no replica uses has room for a whole
replica now; otherwise groups are asked for exactly as before.
"""
from __future__ import annotations

import math
from typing import Any

import ray
from ray._private.state import available_resources_per_node  # DeveloperAPI: ray.available_resources() per node
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

NODE_ID_LABEL = "ray.io/node-id"  # every node's default label
SPREAD_WAIT_S = 1.0  # a group that fits somewhere now is placed in milliseconds


def replica_group(bundles: list[dict[str, float]]) -> Any:
    """One replica's placement group: its stages packed, on any nodes."""
    return placement_group(bundles, strategy="PACK")


def reserve_spread(count: int, bundles: list[dict[str, float]]) -> list[Any]:
    """``count`` replicas' placement groups of ``bundles`` each, asked for one after
    another, each kept off the nodes of those placed before it where another node
    has room for it. Groups that find no room stay asked for (pending)."""
    if count == 1:  # nothing to spread: no lookups, no wait
        return [replica_group(bundles)]
    groups: list[Any] = []
    used: set[str] = set()
    try:
        for _ in range(count):
            groups.append(pack_avoiding(bundles, used))
            used |= nodes_of(groups[-1])
    except BaseException:
        for group in groups:
            remove_placement_group(group)
        raise
    return groups


def relocate(group: Any, bundles: list[dict[str, float]], avoid: set[str]) -> Any:
    """A new replica's placed ``group``, or, where it shares a node with ``avoid``
    (the running replicas' nodes) and another node has room for it, a group placed
    there instead (``group`` is then removed)."""
    if not nodes_of(group) & avoid or not nodes_with_room(bundles) - avoid:
        return group
    moved = pack_avoiding(bundles, avoid)
    moved_to = nodes_of(moved)
    if moved_to and not moved_to & avoid:
        remove_placement_group(group)
        return moved
    remove_placement_group(moved)
    return group


def pack_avoiding(bundles: list[dict[str, float]], avoid: set[str]) -> Any:
    """A replica's placement group, asked for while the free room of nodes ``avoid``
    is held (where a node outside them has room for the whole replica now).
    Waits up to :data:`SPREAD_WAIT_S` for it then, so that where it went is known."""
    if not nodes_with_room(bundles) - avoid:
        return replica_group(bundles)
    hold = _hold_free_room(avoid, set().union(*bundles))
    try:
        group = replica_group(bundles)
        ray.wait([group.ready()], timeout=SPREAD_WAIT_S)
    finally:
        if hold is not None:
            remove_placement_group(hold)
    return group


def nodes_with_room(bundles: list[dict[str, float]]) -> set[str]:
    """The live nodes with room for all of ``bundles`` now."""
    need = {kind: sum(bundle.get(kind, 0.0) for bundle in bundles) for kind in set().union(*bundles)}
    return {node for node, free in available_resources_per_node().items()
            if all(free.get(kind, 0.0) >= amount for kind, amount in need.items())}


def nodes_of(group: Any) -> set[str]:
    """The nodes a placement group's bundles are on (none while it is pending)."""
    return {node for node in placement_group_table(group).get("bundles_to_node_id", {}).values() if node}


def _hold_free_room(nodes: set[str], kinds: set[str]) -> Any | None:
    """A placed group holding the free ``kinds`` of resources of ``nodes``; None when
    there is nothing to hold or it is not placed within :data:`SPREAD_WAIT_S` (the
    room changed meanwhile: spreading is given up, not waited for)."""
    free = available_resources_per_node()
    bundles, selectors = [], []
    for node in sorted(nodes):
        # Ray counts resources in units of 1e-4: never ask for more than is free
        room = {kind: math.floor(free.get(node, {}).get(kind, 0.0) * 1e4) / 1e4 for kind in kinds}
        if any(amount > 0 for amount in room.values()):
            bundles.append({kind: amount for kind, amount in room.items() if amount > 0})
            selectors.append({NODE_ID_LABEL: f"in({node})"})
    if not bundles:
        return None
    hold = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors)
    placed, _ = ray.wait([hold.ready()], timeout=SPREAD_WAIT_S)
    if placed:
        return hold
    remove_placement_group(hold)
    return None
