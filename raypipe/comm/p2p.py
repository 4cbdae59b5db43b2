"""Point-to-point sends between neighbouring stages over ``torch.distributed``
(gloo on CPU, NCCL on GPU): the per-step executor's transport.

An activation travels as a fixed-size header (its dtype and shape) and a
payload, so micro-batches of any shape flow without a fixed-shape agreement. A
gradient has the shape and dtype of the activation sent for the same
micro-batch, so it needs no header.

Gloo hands a message over only once its receive is posted, so with gloo every
receive is posted as early as the schedule allows (:class:`_ByTag`): a stage's
activation headers at the start of its step, each payload too when its shape is
predicted (the shape this micro-batch had last step, which both sides remember
the same way), and a gradient's receive as soon as its activation is sent. A
payload whose shape changed goes under another tag, and the stale prediction is
consumed by a filler of the predicted size, so no posted receive is ever left
unmatched. NCCL matches point-to-point messages in stream order and ignores
tags (:class:`_InOrder`): there each message is received when it is reached.

With data parallelism the group holds every replica's stages (rank =
:meth:`~raypipe.core.topology.Topology.rank`, replica-major, so a stage's
neighbours are the ranks next to it); the workers of one stage across
replicas also form a subgroup, :attr:`P2PChannel.replicas`
(:mod:`raypipe.comm.replicas`).

A peer that leaves the group (see :meth:`P2PChannel.leave`) makes every receive
from it, and every collective with it, fail at once: :class:`~raypipe.errors.StepAborted`.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raypipe.comm.replicas import StageReplicas
from raypipe.core.topology import Topology
from raypipe.errors import StepAborted

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool]
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # ndim, dtype code, shape

# what a message is, for its tag
HEADER, PREDICTED, UNPREDICTED, GRADIENT = range(4)

Signature = tuple[int, tuple[int, ...]]  # dtype code, shape


def rendezvous_address() -> tuple[str, int]:
    """An address and free port on this node for the group's rendezvous."""
    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]


class _ByTag:
    """Gloo: messages match by (peer, tag), so receives are posted ahead and
    payload shapes are predicted."""

    predicts = True

    @staticmethod
    def tag(kind: int, micro_batch: int) -> int:
        return 4 * micro_batch + kind + 1

    def post(self, buffer: torch.Tensor, peer: int, kind: int, micro_batch: int) -> Any:
        return dist.irecv(buffer, peer, tag=self.tag(kind, micro_batch))


class _InOrder:
    """NCCL: messages match in stream order and tags are ignored, so nothing is
    posted ahead (None) and nothing is predicted."""

    predicts = False

    @staticmethod
    def tag(kind: int, micro_batch: int) -> int:
        return 0

    def post(self, buffer: torch.Tensor, peer: int, kind: int, micro_batch: int) -> None:
        return None


class P2PChannel:
    """One worker's links to its neighbours in the run's process group, and to
    the other replicas of its stage."""

    def __init__(self, topology: Topology, replica: int, stage: int, device: torch.device) -> None:
        self.topology, self.replica, self.stage, self.device = topology, replica, stage, device
        self.rank = topology.rank(replica, stage)
        self.replicas = StageReplicas(topology, replica, stage,
                                      wait=lambda work, what: self._wait(work, None, None, what))
        self._matching = _InOrder() if self.backend == "nccl" else _ByTag()
        # the running step's unfinished sends and posted receives, per micro-batch:
        # a pending operation keeps the group's connections open, so leaving drops them all
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._headers: dict[int, tuple[Any, torch.Tensor]] = {}
        self._payloads: dict[int, tuple[Any, torch.Tensor]] = {}
        self._gradients: dict[int, tuple[Any, torch.Tensor]] = {}
        # the shape each micro-batch had last step, as sent to the next stage and as
        # received from the previous one: the same on both ends of a link
        self._sent: dict[int, Signature] = {}
        self._received: dict[int, Signature] = {}

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def join(self, address: str, port: int, timeout_s: float) -> None:
        """Join the group at ``address:port``, and this stage's replica subgroup."""
        topology = self.topology
        dist.init_process_group(self.backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=topology.world_size, timeout=timedelta(seconds=timeout_s))
        self.replicas.join()

    def leave(self) -> None:
        """Drop pending operations and leave the group, closing its connections;
        forget the predicted shapes (every member leaves before a group re-forms)."""
        for pending in (self._sends, self._headers, self._payloads, self._gradients, self._sent, self._received):
            pending.clear()
        self.replicas.leave()
        if dist.is_initialized():
            dist.destroy_process_group()

    def expect_activations(self, micro_batches: list[int]) -> None:
        """Post the receives of this step's activations from the previous stage
        (headers, and payloads of predicted shape), before they are needed."""
        peer = self.rank - 1
        for micro_batch in micro_batches:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            self._headers[micro_batch] = self._matching.post(header, peer, HEADER, micro_batch), header
            predicted = self._received.get(micro_batch)
            if predicted is not None:
                payload = _empty(predicted, self.device)
                self._payloads[micro_batch] = self._matching.post(payload, peer, PREDICTED, micro_batch), payload

    def send_activation(self, tensor: torch.Tensor, micro_batch: int) -> None:
        """Start sending an activation (header, then payload) to the next stage,
        and post the receive of its gradient."""
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(f"cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)} between stages")
        payload, peer = tensor.detach().contiguous(), self.rank + 1
        signature, predicted = _signature(payload), self._sent.get(micro_batch)
        self._send(_encode(signature, self.device), peer, HEADER, micro_batch)
        if predicted is not None and predicted != signature:  # consume the receive posted on the prediction
            self._send(_empty(predicted, self.device), peer, PREDICTED, micro_batch)
        self._send(payload, peer, PREDICTED if predicted == signature else UNPREDICTED, micro_batch)
        if self._matching.predicts:
            self._sent[micro_batch] = signature
        gradient = torch.empty_like(payload)
        self._gradients[micro_batch] = self._matching.post(gradient, peer, GRADIENT, micro_batch), gradient

    def recv_activation(self, micro_batch: int) -> torch.Tensor:
        """The activation of ``micro_batch`` from the previous stage, whatever its shape and dtype."""
        peer = self.rank - 1
        signature = _decode(self._receive(self._headers.pop(micro_batch, None), _HEADER_SIGNATURE, peer, HEADER,
                                          micro_batch))
        if self._matching.predicts:
            self._received[micro_batch] = signature
        posted = self._payloads.pop(micro_batch, None)
        if posted is not None:
            predicted = self._receive(posted, None, peer, PREDICTED, micro_batch)
            if _signature(predicted) == signature:
                return predicted
        return self._receive(None, signature, peer, UNPREDICTED, micro_batch)

    def recv_gradient(self, micro_batch: int) -> torch.Tensor:
        """The gradient of the activation sent for ``micro_batch``."""
        work, gradient = self._gradients.pop(micro_batch)
        return self._receive((work, gradient), None, self.rank + 1, GRADIENT, micro_batch)

    def send_gradient(self, gradient: torch.Tensor | None, micro_batch: int) -> None:
        """Start sending the gradient of this stage's input to the previous stage."""
        if gradient is None:
            raise RuntimeError(f"stage {self.stage} has no gradient for its input of micro-batch "
                               f"{micro_batch}: the stage does not use its input")
        self._send(gradient.detach().contiguous(), self.rank - 1, GRADIENT, micro_batch)

    def finish_sends(self) -> None:
        """Wait until every started send has completed (the buffers live until then)."""
        for work, _buffer in self._sends:
            self._wait(work, None, None, "send")
        self._sends.clear()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over every worker (float64: adding the
        zeros of the other workers' slots is exact, so every worker gets the same)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._wait(dist.all_reduce(tensor, async_op=True), None, None, "reduction")
        return tensor.tolist()

    def _send(self, tensor: torch.Tensor, peer: int, kind: int, micro_batch: int) -> None:
        self._sends.append((dist.isend(tensor, peer, tag=self._matching.tag(kind, micro_batch)), tensor))

    def _receive(self, posted: tuple[Any, torch.Tensor] | None, signature: Signature | None, peer: int,
                 kind: int, micro_batch: int) -> torch.Tensor:
        """Wait for a posted receive, or post one into a new buffer of ``signature`` and wait."""
        work, buffer = posted if posted is not None else (None, _empty(signature, self.device))
        if work is None:
            work = dist.irecv(buffer, peer, tag=self._matching.tag(kind, micro_batch))
        self._wait(work, peer, micro_batch, "gradient" if kind == GRADIENT else "activation")
        return buffer

    def _wait(self, work: Any, peer: int | None, micro_batch: int | None, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            source = "a worker" if peer is None else f"stage {self.topology.coordinates(peer).stage}"
            raise StepAborted(self.stage, "recv" if what in ("activation", "gradient") else what, micro_batch,
                              f"{source} left the step before this {what} completed ({error})",
                              replica=self.replica if self.topology.num_replicas > 1 else None) from None


_HEADER_SIGNATURE: Signature = (_DTYPES.index(torch.int64), (_HEADER,))


def _empty(signature: Signature, device: torch.device) -> torch.Tensor:
    code, shape = signature
    return torch.empty(shape, dtype=_DTYPES[code], device=device)


def _signature(tensor: torch.Tensor) -> Signature:
    return _DTYPES.index(tensor.dtype), tuple(tensor.shape)


def _encode(signature: Signature, device: torch.device) -> torch.Tensor:
    code, shape = signature
    return torch.tensor([len(shape), code, *shape, *[0] * (_MAX_DIMS - len(shape))], dtype=torch.int64,
                        device=device)


def _decode(header: torch.Tensor) -> Signature:
    ndim, code, *shape = header.tolist()
    return code, tuple(shape[:ndim])
