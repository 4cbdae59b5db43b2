"""Point-to-point sends between neighbouring stages over ``torch.distributed``
(gloo on CPU, NCCL on GPU): the per-step executor's transport.

Activations are preceded by a fixed-size header with their dtype and shape, so
micro-batches of different shapes flow without any fixed-shape agreement. A
gradient has the shape and dtype of the activation sent for the same
micro-batch, so it needs no header; with gloo its receive is posted as soon as
that activation is sent (tagged by micro-batch) and completes in the background.
NCCL matches point-to-point ops in stream order, so there it is received in turn.

A peer that leaves the group (see :meth:`P2PChannel.leave`) makes every receive
from it fail at once: :class:`~raypipe.errors.StepAborted`.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raypipe.errors import StepAborted

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool]
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # ndim, dtype code, shape


def rendezvous_address() -> tuple[str, int]:
    """An address and free port on this node for the group's rendezvous."""
    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]


class P2PChannel:
    """One stage's links to its neighbours in a pipeline's process group."""

    def __init__(self, stage: int, num_stages: int, device: torch.device) -> None:
        self.stage, self.num_stages, self.device = stage, num_stages, device
        # the running step's unfinished sends and posted gradient receives: a pending
        # operation keeps the group's connections open, so leaving drops them all
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._gradients: dict[int, tuple[Any, torch.Tensor]] = {}

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def join(self, address: str, port: int, timeout_s: float) -> None:
        """Join the group at ``address:port`` (rank = stage)."""
        dist.init_process_group(self.backend, init_method=f"tcp://{address}:{port}", rank=self.stage,
                                world_size=self.num_stages, timeout=timedelta(seconds=timeout_s))

    def leave(self) -> None:
        """Drop pending operations and leave the group, closing its connections."""
        self._sends.clear()
        self._gradients.clear()
        if dist.is_initialized():
            dist.destroy_process_group()

    def send_activation(self, tensor: torch.Tensor, micro_batch: int) -> None:
        """Start sending an activation (header, then payload) to the next stage,
        and post the receive of its gradient."""
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(f"cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)} between stages")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        header, payload = header.to(self.device), tensor.detach().contiguous()
        peer = self.stage + 1
        self._sends += [(dist.isend(header, peer), header), (dist.isend(payload, peer), payload)]
        gradient = torch.empty_like(payload)
        early = dist.irecv(gradient, peer, tag=micro_batch + 1) if self.backend == "gloo" else None
        self._gradients[micro_batch] = early, gradient

    def recv_activation(self, micro_batch: int) -> torch.Tensor:
        """The next activation from the previous stage, whatever its shape and dtype."""
        peer = self.stage - 1
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(header, peer), peer, micro_batch, "activation")
        ndim, code, *shape = header.tolist()
        tensor = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=self.device)
        self._wait(dist.irecv(tensor, peer), peer, micro_batch, "activation")
        return tensor

    def recv_gradient(self, micro_batch: int) -> torch.Tensor:
        """The gradient of the activation sent for ``micro_batch``."""
        work, gradient = self._gradients.pop(micro_batch)
        peer = self.stage + 1
        self._wait(work if work is not None else dist.irecv(gradient, peer), peer, micro_batch, "gradient")
        return gradient

    def send_gradient(self, gradient: torch.Tensor | None, micro_batch: int) -> None:
        """Start sending the gradient of this stage's input to the previous stage."""
        if gradient is None:
            raise RuntimeError(f"stage {self.stage} has no gradient for its input of micro-batch "
                               f"{micro_batch}: the stage does not use its input")
        payload = gradient.detach().contiguous()
        tag = micro_batch + 1 if self.backend == "gloo" else 0
        self._sends.append((dist.isend(payload, self.stage - 1, tag=tag), payload))

    def finish_sends(self) -> None:
        """Wait until every started send has completed (the buffers live until then)."""
        for work, _buffer in self._sends:
            self._wait(work, None, None, "send")
        self._sends.clear()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over every stage (float64: adding the
        zeros of the other stages' slots is exact, so every stage gets the same)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._wait(dist.all_reduce(tensor, async_op=True), None, None, "reduction")
        return tensor.tolist()

    def _wait(self, work: Any, peer: int | None, micro_batch: int | None, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            source = "a stage" if peer is None else f"stage {peer}"
            raise StepAborted(self.stage, "recv" if what in ("activation", "gradient") else what, micro_batch,
                              f"{source} left the step before this {what} completed ({error})") from None
