"""Op timings: host time on a CPU (as always), device time from CUDA events on a GPU."""
import pytest
import torch
from torch import nn

import raypipe
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.stage_op import device_times
from raypipe.stage.worker import StageWorker


def _flat(pairs):
    return [t for pair in pairs for t in pair]


def test_device_offsets_are_placed_after_the_anchor():
    times = device_times(100.0, [100.0, 100.001, 100.002], [(0.0, 0.010), (0.010, 0.030), (0.030, 0.031)])
    assert _flat(times) == pytest.approx([100.0, 100.010, 100.010, 100.030, 100.030, 100.031])


def test_an_op_never_starts_on_the_device_before_the_host_queued_it():
    # the host queued op 2 at 100.050, but the anchor would place it at 100.010: the GPU
    # reached the anchor at least 40 ms late, and every time moves by that
    times = device_times(100.0, [100.0, 100.050], [(0.0, 0.010), (0.010, 0.020)])
    assert _flat(times) == pytest.approx([100.040, 100.050, 100.050, 100.060])


def _worker(use_gpu=False):
    config = raypipe.PipelineConfig(num_stages=1, num_micro_batches=2)
    torch.manual_seed(0)
    return StageWorker(WorkerSpec(0, 1, (nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4)), (0, 1, 2), config,
                                  use_gpu=use_gpu, loss_fn=nn.functional.mse_loss,
                                  optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1)))


def _step(worker, step=0):
    device = worker.device
    for micro_batch in range(2):
        worker.forward(micro_batch, torch.randn(64, 256, device=device), torch.zeros(64, 4, device=device), 0.5, step)
    for micro_batch in range(2):
        worker.backward(micro_batch, None, 1.0)
    stats = worker.finish_backward()
    return worker.commit(False, stats)


def test_a_cpu_stage_times_its_ops_on_the_host_clock():
    report = _step(_worker())
    assert [e.op for e in report.events] == ["F", "F", "B", "B", "grad_stats", "optimizer"]
    assert all(e.start <= e.end for e in report.events)
    assert all(a.end <= b.start for a, b in zip(report.events, report.events[1:]))
    assert report.stats.busy_seconds == pytest.approx(sum(e.end - e.start for e in report.events[:4]))


@pytest.mark.gpu
def test_a_gpu_stage_times_its_ops_by_cuda_events():
    worker = _worker(use_gpu=True)
    _step(worker, 0)  # warm-up
    report = _step(worker, 1)
    events = report.events
    assert [e.op for e in events] == ["F", "F", "B", "B", "grad_stats", "optimizer"]
    assert all(e.start <= e.end for e in events)
    # device times are ordered as the ops ran on the stream, and the step's events resolved once
    assert all(a.end <= b.start + 1e-6 for a, b in zip(events, events[1:]))
    assert worker._device_timer._marked == []


class _FakeCudaEvent:
    """A torch.cuda.Event stand-in: the device clock (ms) when the GPU reached it."""

    def __init__(self, ms):
        self.ms, self.synchronized = ms, False

    def elapsed_time(self, later):
        return later.ms - self.ms

    def synchronize(self):
        self.synchronized = True


def test_the_timer_rewrites_the_steps_events_with_device_times_once():
    from raypipe.core.result import OpEvent
    from raypipe.stage.stage_op import DeviceTimer

    timer = DeviceTimer()
    timeline = []
    aborted = OpEvent(0, "F", 0, 1.0, 1.1)  # an aborted step's op: gone from the timeline after abort_step
    timer.add(aborted, _FakeCudaEvent(0.0), _FakeCudaEvent(5.0), [aborted])
    host = [(10.0, 10.001), (10.002, 10.003), (10.004, 10.005)]  # the host only queued the kernels
    device = [(1000.0, 1020.0), (1020.0, 1050.0), (1050.0, 1051.0)]  # ms on the device clock
    ends = []
    for (start, end), (device_start, device_end), op in zip(host, device, ("F", "B", "optimizer")):
        event = OpEvent(0, op, 0, start, end)
        timeline.append(event)
        ends.append(_FakeCudaEvent(device_end))
        timer.add(event, _FakeCudaEvent(device_start), ends[-1], timeline)
    timeline.append(OpEvent(0, "recv", 1, 10.0005, 10.0007))  # a host event: not the timer's
    timer.resolve(timeline)
    assert _flat((e.start, e.end) for e in timeline[:3]) == pytest.approx([10.0, 10.020, 10.020, 10.050,
                                                                          10.050, 10.051])
    assert (timeline[3].start, timeline[3].end) == (10.0005, 10.0007)
    assert (aborted.start, aborted.end) == (1.0, 1.1)
    assert ends[-1].synchronized and not ends[0].synchronized  # one wait, on the last op's end
    timer.resolve(timeline)  # nothing left to resolve: the times stay
    assert timeline[0].end == pytest.approx(10.020)
