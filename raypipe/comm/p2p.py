"""The per-step executor: each stage runs its whole schedule in one Ray task,
sending activations and gradients straight to its neighbours over
``torch.distributed`` (gloo on CPU, NCCL on GPU).

One task per stage per step instead of one per op, and no hop through the
object store: the per-op overhead that shows with small micro-batches goes.
Activations are preceded by a fixed-size header with their dtype and shape, so
micro-batches of different shapes flow without any fixed-shape agreement;
gradients need none (see ``_expect_gradient``).

A stage whose step fails closes its connections at once (``_leave_failed_step``):
a neighbour blocked on a receive from it fails immediately with
:class:`~raypipe.errors.StepAborted` and closes its own, so the whole group
stops within milliseconds instead of waiting ``p2p_timeout_s``. The driver then
re-forms the group under a fresh rendezvous before the next step.
"""
from __future__ import annotations

import socket
import time
import traceback
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from raypipe.errors import StepAborted
from raypipe.core.result import OpEvent
from raypipe.stage.worker import StageWorker

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool]
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS  # ndim, dtype code, shape


def send_tensor(tensor: torch.Tensor, peer: int, header_device: torch.device) -> tuple[list[Any], tuple]:
    """Start sending ``tensor`` (header, then payload); returns the works to wait on and
    the buffers, which must stay alive until then."""
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)} between stages")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    header, payload = header.to(header_device), tensor.detach().contiguous()
    return [dist.isend(header, peer), dist.isend(payload, peer)], (header, payload)


def recv_tensor(peer: int, device: torch.device) -> torch.Tensor:
    """Receive the next tensor ``peer`` sends, whatever its shape and dtype."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, peer)
    ndim, code, *shape = header.tolist()
    tensor = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=device)
    dist.recv(tensor, peer)
    return tensor


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class P2PStageWorker(StageWorker):
    """A StageWorker that also runs a whole step's schedule with direct sends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the running step's unfinished sends and posted gradient receives: a pending
        # operation keeps the group's connections open, so a failed step drops them all
        self._sends: list[tuple[list[Any], tuple]] = []
        self._expected_gradients: dict[int, tuple[Any, torch.Tensor]] = {}

    def rendezvous_address(self) -> tuple[str, int]:
        """Where the other stages meet this one (called on stage 0)."""
        return ray.util.get_node_ip_address(), free_port()

    def join_group(self, address: str, port: int, timeout_s: float) -> None:
        dist.init_process_group(self._backend, init_method=f"tcp://{address}:{port}", rank=self.stage_index,
                                world_size=self.num_stages, timeout=timedelta(seconds=timeout_s))

    def leave_group(self) -> None:
        self._sends.clear()
        self._expected_gradients.clear()
        if dist.is_initialized():
            dist.destroy_process_group()

    def in_group(self) -> bool:
        """Whether this worker is a member of a live group (a failed step leaves it)."""
        return dist.is_initialized()

    def run_step(self, step: int, inputs: list | None, targets: list | None, weights: list | None,
                 loss_scale: float = 1.0, inv_scale: float = 1.0,
                 clip_value: float | None = None) -> dict[str, Any]:
        """This stage's ops of one step in schedule order, then its gradient statistics.

        Returns ``{"loss": weighted loss sum (last stage) or None, "grad_stats":
        (squared norm, found_inf)}`` as :meth:`StageWorker.grad_stats` reports them.
        On any failure this worker leaves the group first, releasing its neighbours.
        """
        try:
            loss = self._run_ops(step, inputs, targets, weights, loss_scale)
            self._finish_sends()
        except BaseException as error:
            self._leave_failed_step(error)
            raise
        return {"loss": loss if self.is_last else None, "grad_stats": self.grad_stats(inv_scale, clip_value)}

    def _run_ops(self, step: int, inputs: list | None, targets: list | None, weights: list | None,
                 loss_scale: float) -> float:
        count = self.config.num_micro_batches
        inputs, targets, weights = inputs or [None] * count, targets or [None] * count, weights or [None] * count
        loss = 0.0
        for kind, micro_batch in self._own_ops:
            if kind == "F":
                hidden = inputs[micro_batch] if self.is_first else self._receive(self.stage_index - 1, micro_batch)
                output = self.forward(micro_batch, hidden, targets[micro_batch], weights[micro_batch], step)
                if self.is_last:
                    loss += output
                else:
                    self._sends.append(send_tensor(output, self.stage_index + 1, self._header_device))
                    self._expected_gradients[micro_batch] = self._expect_gradient(output, micro_batch)
            else:
                grad = None if self.is_last else self._gradient(micro_batch)
                grad_input = self.backward(micro_batch, grad, loss_scale if self.is_last else 1.0)
                if not self.is_first:
                    self._sends.append(self._send_gradient(grad_input, micro_batch))
        return loss

    def _finish_sends(self) -> None:
        for works, _buffers in self._sends:  # the buffers stay alive until their sends complete
            for work in works:
                self._wait(work, "send", None)
        self._sends.clear()

    def _leave_failed_step(self, error: BaseException) -> None:
        """Close this worker's connections now, so that neighbours blocked on it fail at once.

        Every pending operation holds the connections open: the step's own lists,
        and the frames of the error's traceback (cleared: only its text is kept).
        """
        cause = error.__cause__
        for failure in (error, cause):
            if failure is not None and failure.__traceback__ is not None:
                traceback.clear_frames(failure.__traceback__)
        self.leave_group()
        self.abort_step()

    def _wait(self, work: Any, what: str, micro_batch: int | None) -> None:
        """Wait for a send or receive; a peer that left the group aborts this step."""
        try:
            work.wait()
        except RuntimeError as error:
            raise StepAborted(self.stage_index, what, micro_batch,
                              f"a neighbouring stage left the step ({error})") from None

    # A gradient has the shape and dtype of the activation this stage sent for the
    # same micro-batch, so it needs no header. With gloo its receive is posted as
    # soon as that activation is sent (tagged by micro-batch): the transfer then
    # completes in the background instead of after the previous backward. NCCL
    # matches point-to-point ops in stream order, so there it is received in turn.

    def _expect_gradient(self, output: torch.Tensor, micro_batch: int) -> Any:
        buffer = torch.empty_like(output)
        if self._backend == "gloo":
            return dist.irecv(buffer, self.stage_index + 1, tag=micro_batch + 1), buffer
        return None, buffer

    def _gradient(self, micro_batch: int) -> torch.Tensor:
        work, buffer = self._expected_gradients.pop(micro_batch)
        start = time.time()
        if work is None:
            work = dist.irecv(buffer, self.stage_index + 1)
        self._wait(work, "recv", micro_batch)
        self._events.append(OpEvent(self.stage_index, "recv", micro_batch, start, time.time()))
        return buffer

    def _send_gradient(self, grad_input: torch.Tensor, micro_batch: int) -> tuple[list[Any], tuple]:
        if grad_input is None:
            raise RuntimeError(f"stage {self.stage_index} has no gradient for its input of micro-batch "
                               f"{micro_batch}: the stage does not use its input")
        payload = grad_input.detach().contiguous()
        tag = micro_batch + 1 if self._backend == "gloo" else 0
        return [dist.isend(payload, self.stage_index - 1, tag=tag)], (payload,)

    @property
    def _backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def _header_device(self) -> torch.device:
        return self.device  # NCCL sends only device tensors; gloo takes CPU ones

    def _receive(self, peer: int, micro_batch: int) -> torch.Tensor:
        start = time.time()
        try:
            tensor = recv_tensor(peer, self.device)
        except RuntimeError as error:
            raise StepAborted(self.stage_index, "recv", micro_batch,
                              f"stage {peer} left the step before sending this activation ({error})") from None
        self._events.append(OpEvent(self.stage_index, "recv", micro_batch, start, time.time()))
        return tensor
