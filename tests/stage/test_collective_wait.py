"""Which compute ops measure their wait in tensor-parallel collectives (raypipe/stage/stage_op.py's
``collective_waits``): a CPU worker with a tensor-parallel mesh, at the steps sampled, the same on every
worker; nothing to measure at t = 1 or on CUDA. The measurement itself, on real gloo collectives, is
tests/control/test_slow_tensor_parallel_rank.py's."""
from types import SimpleNamespace

import torch

from raypipe.stage.collective_wait import CollectiveWait
from raypipe.stage.stage_op import COLLECTIVE_WAIT_EVERY, collective_waits


def _worker(mesh: object | None, device: str = "cpu", running: int = -1) -> SimpleNamespace:
    return SimpleNamespace(tensor_mesh=mesh, device=torch.device(device), _running=SimpleNamespace(number=running))


def test_a_tensor_parallel_cpu_worker_measures_at_the_steps_sampled_and_not_between():
    worker = _worker(mesh=object())
    meter, wait = collective_waits(worker, 2 * COLLECTIVE_WAIT_EVERY)
    assert isinstance(meter, CollectiveWait) and wait is None and meter.seconds == 0.0
    assert collective_waits(worker, 2 * COLLECTIVE_WAIT_EVERY + 1) == (None, None)  # not measured
    # an op without a step argument (B, I, W) belongs to the running step
    assert isinstance(collective_waits(_worker(object(), running=COLLECTIVE_WAIT_EVERY), None)[0], CollectiveWait)
    assert collective_waits(_worker(object(), running=COLLECTIVE_WAIT_EVERY + 3), None) == (None, None)


def test_nothing_is_measured_without_a_tensor_parallel_peer_or_on_cuda():
    assert collective_waits(_worker(mesh=None), 0) == (None, 0.0)
    assert collective_waits(_worker(mesh=object(), device="cuda"), 0) == (None, 0.0)  # the host does not wait


def test_ops_that_are_no_collectives_add_no_wait():
    meter = CollectiveWait()
    with meter:
        x = torch.randn(8, 8, requires_grad=True)
        (x @ x).sum().backward()
    assert meter.seconds == 0.0
