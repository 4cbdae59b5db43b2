"""An in-memory transport for the step runner (:class:`~raypipe.stage.step_runner.StepChannel`):
every worker of an in-process run in one thread of its own, tensors handed over as they
are, so the harness (:mod:`raypipe.testing.op_interpreter`) runs the runner that trains.

The workers take turns: a worker runs until it waits (for a message, or for the others
in a collective), and only then does another run. One runs at a time, so nothing two
workers share (the global random generator, which each layer seeds before it runs) is
touched by two at once, and the results do not depend on the order the threads happen
to run in.

Messages between two workers match in issue order, as on NCCL: one FIFO queue per
(sender, receiver), and each receive checks that the message it takes is the one it
expects (activation or gradient, and the message key). The collectives are barriers
among their members that combine what each gave in rank order: the replicas' gradient
sum in replica order, onto every replica or only onto each gradient's owner (ZeRO-1's
reduce-scatter); ZeRO-1's gather from each parameter's owner; the float all-reduce, a
sum in rank order.

A worker that fails leaves the group, which releases every waiting worker, one at a
time, with :class:`~raypipe.errors.StepAborted`. When every worker still running waits and none
can go on, the step is stuck (a schedule whose messages never pair): every worker is
released the same way, and :attr:`MemoryGroup.stuck` says what each one waited for.
"""
from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from raypipe.comm.replicas import Owners
from raypipe.core import ops
from raypipe.core.topology import Topology
from raypipe.errors import StepAborted

_ACTIVATION, _GRADIENT = "activation", "gradient"


class _Collective:
    """One collective among ``size`` members: each gives its part; the last to give combines them all."""

    def __init__(self, size: int) -> None:
        self.parts: list[Any] = [None] * size
        self.given = self.taken = 0
        self.result: Any = None
        self.done = False


@dataclass
class _Waiting:
    """A worker's thread waiting for its turn: what for (named in errors), whether it can go on, and its wake-up."""

    what: str
    ready: Callable[[], bool]
    wake: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))


class MemoryGroup:
    """The workers of one in-process step: their message queues, collectives and turns.
    :meth:`begin` before each step; each worker's thread runs inside :meth:`turn`.

    The turn passes from the worker that waits (or ends) straight to one that can go
    on, which alone is woken: no thread wakes only to find it must wait again."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._lock = threading.Lock()  # over whose turn it is and who waits; the rest is the turn's
        self.begin()

    def begin(self) -> None:
        """A new step: no message, no collective, every worker to run."""
        self._queues: dict[tuple[int, int], deque] = defaultdict(deque)  # (sender, receiver) rank: messages
        self._collectives: dict[Any, _Collective] = {}
        self._running = self.topology.num_replicas * self.topology.num_stages  # not yet ended
        self._holder: int | None = None  # the thread whose turn it is
        self._waiting: dict[int, _Waiting] = {}  # by thread
        self._left: str | None = None  # who left, once a worker did
        self.stuck: str | None = None  # what each worker waited for, when none could go on

    @contextmanager
    def turn(self) -> Iterator[None]:
        """A worker's thread runs its step in here: alone, but while it waits."""
        me = threading.get_ident()
        with self._lock:
            waiting = None
            if self._holder is None:
                self._holder = me
            else:
                waiting = self._waiting[me] = _Waiting("its start", lambda: True)
        if waiting is not None:
            waiting.wake.acquire()
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._pass_turn()

    def leave(self, why: str) -> None:
        """A worker failed (``why``): every waiting worker is released, one by one."""
        with self._lock:
            if self._left is None:
                self._left = why

    @property
    def left(self) -> bool:
        return self._left is not None

    def send(self, sender: int, receiver: int, kind: str, key: int, tensor: Any) -> None:
        self._queues[sender, receiver].append((kind, key, tensor))

    def receive(self, sender: int, receiver: int, kind: str, key: int, waiter: Waiter) -> Any:
        """The next message from ``sender`` to ``receiver``, once there: the ``kind`` of message ``key``."""
        queue = self._queues[sender, receiver]
        self.wait(lambda: bool(queue), waiter)
        got_kind, got_key, tensor = queue.popleft()
        if (got_kind, got_key) != (kind, key):
            raise RuntimeError(f"{waiter.place}: {waiter.what} got the {got_kind} of message key {got_key} "
                               "instead (the messages are mis-paired)")
        return tensor

    def give(self, name: Any, size: int, member: int, part: Any, combine: Callable[[list[Any]], Any]) -> None:
        """Give ``part`` to collective ``name`` of ``size`` members as member ``member``; the
        last to give runs ``combine`` over every part, in member order."""
        collective = self._collectives.setdefault(name, _Collective(size))
        collective.parts[member] = part
        collective.given += 1
        if collective.given == size:
            collective.result, collective.done = combine(collective.parts), True

    def result(self, name: Any, waiter: Waiter) -> Any:
        """Collective ``name``'s combined result, once every member gave its part."""
        collective = self._collectives[name]
        self.wait(lambda: collective.done, waiter)
        collective.taken += 1
        if collective.taken == len(collective.parts):  # every member has it: the parts are let go
            del self._collectives[name]
        return collective.result

    def wait(self, ready: Callable[[], bool], waiter: Waiter) -> None:
        """Let the other workers run until ``ready()``; :class:`StepAborted` once a worker left
        or none can go on."""
        me = threading.get_ident()
        while True:
            if self._left is not None:
                raise StepAborted(waiter.stage, "step", None, f"released at {waiter.what}: {self._left}",
                                  replica=waiter.replica)
            if ready():
                return
            with self._lock:
                waiting = self._waiting[me] = _Waiting(f"{waiter.place} at {waiter.what}", ready)
                self._pass_turn()
            waiting.wake.acquire()

    def _pass_turn(self) -> None:
        """The turn to a waiting worker that can go on (every one, once a worker left); when each
        worker still running waits and none can go on, the step is stuck and they are released.
        Under the lock."""
        for thread, waiting in self._waiting.items():
            if self._left is not None or waiting.ready():
                del self._waiting[thread]
                self._holder = thread
                waiting.wake.release()
                return
        self._holder = None  # a worker yet to start takes it
        if self._waiting and len(self._waiting) == self._running:
            self.stuck = ("the lowered schedule is stuck: no worker can go on ("
                          + "; ".join(sorted(waiting.what for waiting in self._waiting.values())) + ")")
            self._left = "the step is stuck"
            self._pass_turn()


@dataclass(frozen=True)
class Waiter:
    """A worker waiting (stage, and replica where there are several) and what for, to name them."""

    stage: int
    replica: int | None
    what: str

    @property
    def place(self) -> str:
        return f"stage {self.stage}" + ("" if self.replica is None else f" of replica {self.replica}")


class MemoryChannel:
    """Worker ``stage`` of ``replica``'s link to the others in ``group`` (the step runner's
    :class:`~raypipe.stage.step_runner.StepChannel`); ``num_virtual_stages`` names a
    message's micro-batch from its key."""

    def __init__(self, group: MemoryGroup, replica: int, stage: int, num_virtual_stages: int) -> None:
        self.group, self.replica, self.stage = group, replica, stage
        self.rank = group.topology.rank(replica, stage)
        self.num_virtual_stages = num_virtual_stages
        self.replicas = _MemoryReplicas(self)
        self.sent_bytes = 0  # the bytes of the tensors handed over, as a transport would send them

    @property
    def aborted(self) -> bool:
        return self.group.left

    def expect_activations(self, expected: list[tuple[int, int]]) -> None:
        """Nothing to post ahead: a message waits in its queue until it is received."""

    def send_activation(self, tensor: Any, key: int, peer: int) -> None:
        self.sent_bytes += _tensor_bytes(tensor)
        self.group.send(self.rank, self._peer_rank(peer), _ACTIVATION, key, tensor)

    def recv_activation(self, key: int, peer: int) -> Any:
        return self.group.receive(self._peer_rank(peer), self.rank, _ACTIVATION, key,
                                  self._receiving(ops.RECV_ACT, key, peer))

    def send_gradient(self, gradient: Any, key: int, peer: int) -> None:
        self.sent_bytes += _tensor_bytes(gradient)
        self.group.send(self.rank, self._peer_rank(peer), _GRADIENT, key, gradient)

    def recv_gradient(self, key: int, peer: int) -> Any:
        return self.group.receive(self._peer_rank(peer), self.rank, _GRADIENT, key,
                                  self._receiving(ops.RECV_GRAD, key, peer))

    def exchange(self, sends: list[tuple[ops.LoweredOp, Any]], receives: list[ops.LoweredOp],
                 key_of: Callable[[ops.LoweredOp], int], header_first: Collection[ops.LoweredOp] = ()) -> list[Any]:
        """Every send first (a queued message needs no receive posted), then each receive in order."""
        for part, tensor in sends:
            (self.send_activation if part.kind == ops.SEND_ACT else self.send_gradient)(tensor, key_of(part), part.peer)
        return [(self.recv_activation if part.kind == ops.RECV_ACT else self.recv_gradient)(key_of(part), part.peer)
                for part in receives]

    def finish_sends(self) -> None:
        """Nothing to wait for: a send is queued at once."""

    def expect_statistics(self, length: int) -> None:
        """Nothing to post ahead: the all-reduce combines what every worker gives."""

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """The element-wise sum over every worker, in rank order."""
        topology = self.group.topology
        self.group.give("all-reduce", topology.num_replicas * topology.num_stages, self.rank, list(values),
                        lambda parts: [sum(column) for column in zip(*parts)])
        return list(self.group.result("all-reduce", self.waiter("the all-reduce of the gradient statistics")))

    def leave(self) -> None:
        self.group.leave(f"{self.waiter('').place} failed")

    def waiter(self, what: str) -> Waiter:
        """This worker, waiting for ``what``."""
        return Waiter(self.stage, self.replica if self.group.topology.num_replicas > 1 else None, what)

    def _peer_rank(self, peer: int) -> int:
        return self.group.topology.rank(self.replica, peer)

    def _receiving(self, kind: str, key: int, peer: int) -> Waiter:
        micro_batch = ops.micro_batch_of_key(key, self.num_virtual_stages)
        return self.waiter(f"{kind} of micro-batch {micro_batch} (message key {key}) from stage {peer}")


class _MemoryReplicas:
    """The replicas of ``channel``'s stage (:class:`~raypipe.stage.step_runner.ReplicaChannel`):
    collectives combined in replica order."""

    def __init__(self, channel: MemoryChannel) -> None:
        self.channel, self.group = channel, channel.group

    def start_gradient_reduction(self, gradients: list[torch.Tensor], owners: Owners = None) -> Any:
        count = self.group.topology.num_replicas
        if count == 1:
            return None
        name = ("gradient reduction", self.channel.stage)
        self.group.give(name, count, self.channel.replica, (gradients, owners), _sum_onto_owners)
        return name

    def finish_gradient_reduction(self, pending: Any) -> None:
        if pending is not None:
            self.group.result(pending, self.channel.waiter("the gradient reduction"))

    def gather_parameters(self, tensors: list[torch.Tensor], owners: Owners) -> None:
        count = self.group.topology.num_replicas
        if count == 1 or owners is None:
            return
        name = ("parameter gather", self.channel.stage)
        self.group.give(name, count, self.channel.replica, (tensors, owners), _gather_from_owners)
        self.group.result(name, self.channel.waiter("the parameter gather"))


@torch.no_grad()
def _sum_onto_owners(parts: list[tuple[list[torch.Tensor], Owners]]) -> None:
    """Each gradient summed over the replicas in replica order, written onto every replica
    (all-reduce) or onto its owner only (ZeRO-1's reduce-scatter)."""
    owners = parts[0][1]
    for index, gradients in enumerate(zip(*(gradients for gradients, _ in parts))):
        total = gradients[0].clone()
        for gradient in gradients[1:]:
            total += gradient
        for replica, gradient in enumerate(gradients):
            if owners is None or owners[index] == replica:
                gradient.copy_(total)


@torch.no_grad()
def _gather_from_owners(parts: list[tuple[list[torch.Tensor], Owners]]) -> None:
    """ZeRO-1's all-gather: every replica's tensors take their owner's values."""
    owners = parts[0][1]
    for index, owner in enumerate(owners):
        for replica, (tensors, _) in enumerate(parts):
            if replica != owner:
                tensors[index].copy_(parts[owner][0][index])


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (a tensor, or a tree of them)."""
    return sum(leaf.numel() * leaf.element_size() for leaf in pytree.tree_leaves(value)
               if isinstance(leaf, torch.Tensor))
