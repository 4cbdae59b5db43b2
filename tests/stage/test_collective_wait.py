"""Which compute ops measure their wait in tensor-parallel collectives (raypipe/stage/stage_op.py's
``collective_waits``): a CPU worker with a tensor-parallel mesh, at the steps sampled, the same on every
worker; nothing to measure at t = 1 or on CUDA. The measurement itself, on real gloo collectives, is
tests/control/test_slow_tensor_parallel_rank.py's."""
from types import SimpleNamespace

import torch

from raypipe.stage.collective_wait import CollectiveWait
from raypipe.stage.stage_op import COLLECTIVE_WAIT_EVERY, collective_waits, stage_op


def _worker(mesh: object | None, device: str = "cpu", running: int = -1) -> SimpleNamespace:
    return SimpleNamespace(tensor_mesh=mesh, device=torch.device(device), _running=SimpleNamespace(number=running))


def test_a_tensor_parallel_cpu_worker_measures_at_the_steps_sampled_and_not_between():
    worker = _worker(mesh=object())
    meter, wait = collective_waits(worker, 2 * COLLECTIVE_WAIT_EVERY)
    assert isinstance(meter, CollectiveWait) and wait is None and meter.seconds == 0.0
    assert collective_waits(worker, 2 * COLLECTIVE_WAIT_EVERY + 1) == (None, None)  # not measured


class _SplitStage:
    """The attributes a stage op's wrapper reads, on a CPU worker with a tensor-parallel mesh."""

    def __init__(self, running: int) -> None:
        self.tensor_mesh, self.device, self._running = object(), torch.device("cpu"), SimpleNamespace(number=running)
        self.stage_index, self.replica, self.spec, self.ops_done, self._events = 0, 0, SimpleNamespace(tp_rank=0), 0, []

    @stage_op("F", in_step=True)
    def forward(self, micro_batch: int, step: int | None = None) -> None:
        pass

    @stage_op("B", in_step=True)
    def backward(self, micro_batch: int) -> None:
        pass


def test_an_op_measures_at_its_own_step_or_else_at_the_running_one():
    stage = _SplitStage(running=COLLECTIVE_WAIT_EVERY + 3)
    stage.forward(0, step=COLLECTIVE_WAIT_EVERY)  # a forward begins its step: its own number counts
    stage.backward(0)  # B, I and W belong to the running step
    assert [(event.op, event.collective_wait) for event in stage._events] == [("F", 0.0), ("B", None)]


def test_nothing_is_measured_without_a_tensor_parallel_peer_or_on_cuda():
    assert collective_waits(_worker(mesh=None), 0) == (None, 0.0)
    assert collective_waits(_worker(mesh=object(), device="cuda"), 0) == (None, 0.0)  # the host does not wait


def test_ops_that_are_no_collectives_add_no_wait():
    meter = CollectiveWait()
    with meter:
        x = torch.randn(8, 8, requires_grad=True)
        (x @ x).sum().backward()
    assert meter.seconds == 0.0
