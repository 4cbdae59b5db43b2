"""The backward of a micro-batch split in two: the input gradient (I), which the
previous stage waits for, and the weight gradient (W), which nobody waits for, so
a schedule may run it later, in a bubble (zero-bubble pipelining, arXiv 2401.10241).

I runs the autograd graph from the stage's output (or loss) down to the stage input
only, with the graph retained. On its way it notes the gradient arriving at each
node where a weight's branch leaves that path (a matrix multiply whose other operand
is a weight, say); W later restarts autograd from those nodes, with those gradients,
towards the weights alone, and accumulates into ``.grad`` as a whole backward does.
Each node computes what it computed in the whole backward, from the same gradients,
so I followed at once by W gives bitwise the gradients of B. This is the idea of
``torch.distributed.pipelining``'s ``stage_backward_input`` / ``stage_backward_weight``.

A stage whose input is not differentiable (the first stage: token ids) has no input
gradient to send: its I only replays the forward where activations were not kept,
and its W runs the whole backward. A recomputed forward runs once, in I; W uses the
graph I kept. A stage input that is a tree may have several tensors that take a gradient
(:func:`input_gradients`): the weights' branches then join the union of their paths. The
worker's I and W ops (:class:`~raypipe.stage.worker.StageWorker`) call these.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from raypipe.stage import boundary


def _node_of(tensor: torch.Tensor) -> Node | None:
    """The autograd node a gradient for ``tensor`` flows into: its grad_fn, or for a
    leaf its gradient accumulator (made on demand, through a view)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if not tensor.requires_grad:
        return None
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """For every node reachable from ``root``, the nodes whose backward feeds it."""
    consumers: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                queue.append(child)
            consumers[child].append(node)
    return consumers


def _upwards(start: Node, consumers: dict[Node, list[Node]], stop: set[Node] = frozenset()) -> tuple[set, set]:
    """The nodes above ``start`` (towards the output), not going past nodes in ``stop``:
    (the nodes visited, the ``stop`` nodes met)."""
    seen, met = {start}, set()
    queue = deque([start])
    while queue:
        for consumer in consumers.get(queue.popleft(), ()):
            if consumer in stop:
                met.add(consumer)
            elif consumer not in seen:
                seen.add(consumer)
                queue.append(consumer)
    return seen, met


@dataclass
class _WeightGroup:
    """Weights whose branches join the input path at the same nodes (``junctions``), and the
    gradients I saw arrive at each junction (per forward output of the junction node)."""

    weights: list[torch.Tensor]
    junctions: list[Node]
    gradients: dict[Node, tuple] = field(default_factory=dict)


@dataclass
class PendingWeightGradient:
    """What a micro-batch's W needs once its I ran: either the junctions' gradients (a
    differentiable stage input) or the whole graph's output and seed (no input gradient)."""

    groups: list[_WeightGroup]
    outputs: torch.Tensor | list[torch.Tensor] | None = None  # set when W runs the whole backward
    seed: torch.Tensor | list[torch.Tensor] | None = None

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` (through the weights' gradient
        accumulators, so their hooks run as in a whole backward)."""
        if self.outputs is not None:
            torch.autograd.backward(self.outputs, self.seed)
            return
        for group in self.groups:
            edges, seeds = [], []
            for junction in group.junctions:
                for index, gradient in enumerate(group.gradients.get(junction, ())):
                    if gradient is not None:
                        edges.append(GradientEdge(junction, index))
                        seeds.append(gradient)
            if not edges:
                continue
            # a junction below another would also get the gradient the upper one passes
            # down: each gets exactly what it got in the whole backward
            handles = [junction.register_prehook(lambda _, saved=group.gradients.get(junction): saved)
                       for junction in group.junctions if len(group.junctions) > 1]
            try:
                torch.autograd.backward(edges, seeds, inputs=group.weights, retain_graph=True)
            finally:
                for handle in handles:
                    handle.remove()


def input_gradient(outputs: torch.Tensor, seed: torch.Tensor, stage_input: torch.Tensor | None,
                   weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, PendingWeightGradient]:
    """The gradient of ``stage_input`` from ``outputs`` seeded with ``seed`` (None where the
    input is not differentiable), and what the weights' gradient later needs."""
    gradients, pending = input_gradients(outputs, seed, [] if stage_input is None else [stage_input], weights)
    return (None if gradients is None else gradients[0]), pending


def input_gradients(outputs: torch.Tensor, seed: torch.Tensor, stage_inputs: Sequence[torch.Tensor],
                    weights: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None] | None,
                                                              PendingWeightGradient]:
    """The gradients of ``stage_inputs`` (a tree input's tensors that require grad) from
    ``outputs`` seeded with ``seed``, None for an input the output does not depend on (None
    in all when it depends on none), and what the weights' gradient later needs. Every weight
    joins the union of the inputs' paths on its way to the one output, so W finds each."""
    root = _node_of(outputs)
    if root is None:
        return None, PendingWeightGradient([], outputs, seed)
    consumers = _consumers(root)
    nodes = [_node_of(stage_input) for stage_input in stage_inputs]
    reached = [index for index, node in enumerate(nodes) if node is not None and node in consumers]
    if not reached:  # the output does not depend on the input
        return None, PendingWeightGradient([], outputs, seed)
    input_path: set[Node] = set()
    for index in reached:
        input_path |= _upwards(nodes[index], consumers)[0]
    groups = _weight_groups(weights, consumers, input_path)
    handles = []
    for group in groups:
        for junction in group.junctions:
            def note(gradients, group=group, junction=junction):
                group.gradients[junction] = tuple(gradients)
            handles.append(junction.register_prehook(note))
    try:
        found = torch.autograd.grad(outputs, [stage_inputs[index] for index in reached], seed, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    gradients: list[torch.Tensor | None] = [None] * len(stage_inputs)
    for index, gradient in zip(reached, found):
        gradients[index] = gradient
    return gradients, PendingWeightGradient(groups)


def _weight_groups(weights: Sequence[torch.Tensor], consumers: dict[Node, list[Node]],
                   input_path: set[Node]) -> list[_WeightGroup]:
    """The weights in the graph, grouped by the input-path nodes their branches join
    (weights sharing a junction are one group: one autograd call computes them)."""
    groups: list[_WeightGroup] = []
    group_of: dict[Node, _WeightGroup] = {}
    for weight in weights:
        node = _node_of(weight)
        if node is None or node not in consumers:
            continue  # unused by this micro-batch's graph: no gradient, as in a whole backward
        _, junctions = _upwards(node, consumers, input_path)
        merged = {id(group_of[j]): group_of[j] for j in junctions if j in group_of}
        group = _WeightGroup([weight], sorted(junctions, key=id))
        for other in merged.values():
            group.weights = other.weights + group.weights
            group.junctions = list({*other.junctions, *group.junctions})
            groups.remove(other)
        groups.append(group)
        for junction in group.junctions:
            group_of[junction] = group
    return groups


def boundary_input_gradient(inputs: boundary.Boundary, outputs: boundary.Boundary, roots: list[torch.Tensor],
                            seeds: list[torch.Tensor], weights: Sequence[torch.Tensor], input_takes_gradient: bool,
                            stage: int, schedule: str) -> tuple[boundary.Boundary, PendingWeightGradient]:
    """A stage's I on its boundary values (a tensor, or a tree of them): the input gradient (a
    tree of the input's structure, ``None`` where no gradient flows; None when none does) and
    what W needs. ``roots``/``seeds``: :func:`raypipe.stage.boundary.backward_roots`. A tree
    output may have one tensor that requires grad (a LLaMA's hidden states beside positions
    and document ids), or several where the input takes no gradient (the first stage)."""
    if isinstance(inputs, torch.Tensor) and isinstance(outputs, torch.Tensor):  # the single-tensor path
        differentiable = input_takes_gradient and inputs.requires_grad
        return input_gradient(roots[0], seeds[0], inputs if differentiable else None, weights)
    leaves = boundary.differentiable_leaves(inputs) if input_takes_gradient and inputs is not None else []
    if not leaves:  # no input gradient: W runs the whole backward from every root
        return None, PendingWeightGradient([], roots, seeds)
    if len(roots) != 1:
        raise ValueError(
            f"stage {stage}: schedule {schedule!r} splits the backward of a stage whose output has one tensor "
            f"that requires grad; this stage's output has {len(roots)} and its input takes a gradient\n"
            f"  output: {boundary.describe(outputs)}\n  input: {boundary.describe(inputs)}\n"
            "  use a schedule without the split backward (e.g. '1f1b'), or pass one floating-point tensor "
            "that requires grad out of this stage")
    gradients, pending = input_gradients(roots[0], seeds[0], [tensor for _, tensor in leaves], weights)
    if gradients is None:
        return None, pending
    by_path = {path: gradient.contiguous() for (path, _), gradient in zip(leaves, gradients)
               if gradient is not None}  # contiguous as in B (boundary.input_gradient)
    return boundary.gradients_at(inputs, by_path), pending
