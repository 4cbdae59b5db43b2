"""A worker's membership of the run's process group (:mod:`raypipe.comm.p2p`'s
:class:`~raypipe.comm.p2p.P2PChannel` holds one): joining it, leaving it, and
aborting it from another thread.

With data parallelism the group holds every replica's stages (rank =
:meth:`~raypipe.core.topology.Topology.rank`, replica-major); the workers of one
stage across replicas also form a subgroup, :attr:`GroupMembership.replicas`
(:mod:`raypipe.comm.replicas`). Headers, structures and the step's all-reduce of
gradient statistics go over a control channel of CPU tensors on gloo
(:attr:`GroupMembership.control`) even when the tensors go over NCCL, so decoding a
header never waits on a GPU stream; on a gloo-only run it is the group itself.

On gloo a peer that leaves the group fails every receive from it at once; on NCCL (and its
emulation) waits poll against an abort flag and ``p2p_timeout_s``, and :meth:`GroupMembership.abort`
releases a blocked step (:mod:`raypipe.comm.polled_wait`): :class:`~raypipe.errors.StepAborted`.
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch.distributed.device_mesh import DeviceMesh

from raypipe.comm.matching import ByTag, InOrder
from raypipe.comm.nccl_emulation import EmulatedStream, SilentCollective
from raypipe.comm.polled_wait import StepWaits
from raypipe.comm.rendezvous import group_store, wait_for_every_rank
from raypipe.comm.replicas import StageReplicas
from raypipe.comm.step_messages import StepMessages
from raypipe.core.topology import Topology


class GroupMembership:
    """One worker's place in the run's process group: its rank, the group's control
    channel, this stage's replica subgroup, how messages match (by tag on gloo, in
    issue order on NCCL and its emulation) and the step's waits with their abort flag."""

    def __init__(self, topology: Topology, replica: int, stage: int, device: torch.device, tp_rank: int = 0) -> None:
        self.topology, self.device = topology, device
        self.replica, self.stage = replica, stage
        self.rank = topology.rank(replica, stage, tp_rank)
        waits = self.waits = StepWaits(topology, replica, stage)
        self.replicas = StageReplicas(topology, replica, stage,
                                      wait=lambda work, what: waits.wait(self.collective(work), None, None, what),
                                      tp_rank=tp_rank)
        # the stage's tensor-parallel group as a 1-D mesh (DTensor's collectives run on it); None with t = 1
        self.tensor_mesh: DeviceMesh | None = None
        self.matching: ByTag | InOrder = InOrder() if self.backend == "nccl" else ByTag()
        # the group of headers and the step's all-reduce (gloo, CPU tensors); None: the group itself
        self.control: Any = None
        # an abort (on another thread) against leaving: both tear the group down. Issuing an operation
        # takes no lock: NCCL's abort exists to release a call stuck in the communicator, and an
        # operation that fails because the group was just aborted ends the step all the same
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def join(self, address: str, port: int, timeout_s: float, emulate_nccl: bool = False,
             store: dist.TCPStore | None = None, abandoned: Callable[[], bool] = lambda: False) -> None:
        """Join the group at ``address:port``, its control channel, and this stage's
        replica subgroup. ``emulate_nccl``: on gloo, under NCCL's rules
        (:mod:`raypipe.comm.nccl_emulation`). ``store``: the group's store, already open
        (rank 0's, from :class:`~raypipe.comm.rendezvous.Rendezvous`); without it rank 0 opens
        one at ``port`` and the others connect to it. Until every rank has come, the join ends
        (:class:`~raypipe.errors.RaypipeError`) as soon as ``abandoned()``
        (:func:`~raypipe.comm.rendezvous.wait_for_every_rank`)."""
        topology, nccl = self.topology, self.backend == "nccl"
        if emulate_nccl and nccl:
            raise ValueError("cannot emulate NCCL on a CUDA device: NCCL itself runs there")
        if nccl:  # a failed peer's operations are ours to abort (abort()): NCCL's watchdog must not end the process
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        # on NCCL, device_id makes the group's communicator now, with every rank: a batch of sends and
        # receives between two ranks may not be the first use of a group (``dist.batch_isend_irecv``)
        if store is None:
            store = group_store(address, port, self.rank, topology.world_size, timeout_s)
        wait_for_every_rank(store, topology.world_size, timeout_s, abandoned)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=topology.world_size,
                                timeout=timedelta(seconds=timeout_s), device_id=self.device if nccl else None)
        self.waits.aborted.clear()
        self.waits.timeout_s, self.waits.polls = timeout_s, nccl or emulate_nccl
        if self.waits.polls:  # every rank makes the control group first, then the replicas' subgroups
            self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            stream = EmulatedStream(dist.distributed_c10d._get_default_group()) if emulate_nccl else None
            self.matching = InOrder(stream)
        else:
            self.control, self.matching = None, ByTag()
        self.replicas.join()
        self._join_tensor_groups(timeout_s)

    def _join_tensor_groups(self, timeout_s: float) -> None:
        """Every stage's tensor-parallel subgroup (each member creates all, in the same order, after
        the replicas' subgroups), this one's kept as a 1-D mesh. Its collectives are DTensor's, issued
        by the t ranks of a stage in the same order (they run the same ops); under NCCL emulation they
        run on gloo as they are (DTensor waits for each at once, so no rendezvous rule is at stake)."""
        topology = self.topology
        if topology.tensor_parallel == 1:
            return
        forget_mesh_placements()
        own = None
        for replica in range(topology.num_replicas):
            for stage in range(topology.num_stages):
                group = dist.new_group(topology.tensor_ranks(replica, stage), timeout=timedelta(seconds=timeout_s))
                if (replica, stage) == (self.replica, self.stage):
                    own = group
        self.tensor_mesh = DeviceMesh.from_group(own, self.device.type)

    def leave(self, messages: StepMessages) -> None:
        """Drop ``messages``' pending operations and leave the group, closing its connections
        (the tensor-parallel group's too, though the split parameters keep their mesh:
        :func:`release_mesh_group`); forget the predicted shapes (every member leaves before a
        group re-forms). On NCCL, with operations pending or after an abort, the communicators
        are aborted: a destroy would wait for the pending work."""
        with self._lock:
            pending = messages.pending
            messages.clear()
            self.stop_stream()
            self.replicas.leave()
            if self.tensor_mesh is not None:
                release_mesh_group(self.tensor_mesh)
            self.control = self.tensor_mesh = None
            if dist.is_initialized():
                if self.backend == "nccl" and (pending or self.waits.aborted.is_set()):
                    dist.distributed_c10d._abort_process_group()
                else:
                    dist.destroy_process_group()

    def abort(self) -> None:
        """Release a step blocked on the group; callable from any thread. Sets the abort
        flag, which every polled wait checks, and on NCCL aborts every communicator of the
        group (never a destroy: it would wait for the blocked work)."""
        self.waits.aborted.set()  # first: a polling wait sees it at once
        with self._lock:
            self.stop_stream()
            if self.backend == "nccl" and dist.is_initialized():
                dist.distributed_c10d._abort_process_group()

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called since the group was last joined."""
        return self.waits.aborted.is_set()

    @property
    def in_order(self) -> bool:
        """Whether messages match in issue order (NCCL, and its emulation), not by tag (gloo)."""
        return isinstance(self.matching, InOrder)

    def collective(self, work: Any) -> Any:
        """A data-group collective's Work, under NCCL's rules when they are emulated."""
        return SilentCollective(work, self.waits.pool) if self.in_order and self.matching.stream else work

    def stop_stream(self) -> None:
        if self.in_order and self.matching.stream is not None:
            self.matching.stream.stop()


def release_mesh_group(mesh: DeviceMesh) -> None:
    """Let ``mesh``'s process group go when the group is destroyed.

    A DeviceMesh holds its process group (in ``_pg_registry``, torch's private field: the mesh
    has no public way to drop it), and every parameter split over the mesh, and its optimizer
    state, holds the mesh. While they live (a worker keeps its layers across a heal, and moves
    them onto the next group's mesh only when it joins) the group object outlives
    ``destroy_process_group`` and gloo keeps its connections open: a tensor-parallel peer
    blocked in a collective with this rank -- it went on into the collective while this rank
    stopped at the abort, or failed before it -- is released only by the group's timeout
    (``p2p_timeout_s``), not at once, as a peer that leaves releases it. Without the mesh's
    reference the destroy closes the connections and the peer's collective fails at once."""
    mesh._pg_registry.clear()


def forget_mesh_placements() -> None:
    """Drop DTensor's caches of where each op's output is placed (its sharding propagation, in
    Python and in its C++ fast path). They key a placement by its mesh, and meshes compare equal
    by their ranks, not their process groups: once the groups re-form, a cached placement would
    carry the old mesh, whose group is gone (or, named alike, another group of the new ones).
    Nothing to drop before DTensor is imported."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
