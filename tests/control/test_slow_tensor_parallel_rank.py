"""A slow tensor-parallel rank on real processes and real collectives, named alone, not its waiting peer.

t = 2, one stage: timed layers (replicated) around two tensor-parallel MLPs (column- then row-wise:
an all-reduce in each F and each B), in :class:`tests.gloo_pipeline.GlooPipeline`'s forked workers
over gloo (no Ray). From step ``SLOWED_FROM`` rank 1's timed sleeps take 4x (its own kernels slow,
:func:`raypipe.testing.timed_layers.slow_down` in its process alone): rank 0's F and B then take as
long as rank 1's, waiting in the collectives, and only the measured waits tell them apart
(raypipe/stage/collective_wait.py, sampled at one step in ``COLLECTIVE_WAIT_EVERY``).

Each step's real timeline goes to the real controller's watch (the fault-injection fakes stand in for
Ray's workers, their fabricated timelines replaced by the real ones): it must name rank 1 alone, in
one WARNING line, once ``slow_steps`` measured steps showed it behind, with its factor in
``raypipe_worker_slowdown{replica,stage,tp_rank}`` and rank 0's near 1; and the losses are those of
the plain one-process loop (tests/reference.py)."""
from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import raypipe
from raypipe.config import PipelineConfig
from raypipe.control.controller import Controller, StageModel
from raypipe.control.snapshots import LoggedStep
from raypipe.models.layers import build_layer
from raypipe.observability.metrics import MetricsExporter
from raypipe.stage.stage_op import COLLECTIVE_WAIT_EVERY
from raypipe.testing.timed_layers import TimedLayer, slow_down
from tests.control.test_compound_faults import fake_ray  # noqa: F401 - the fixture
from tests.gloo_pipeline import GlooPipeline
from tests.observability.test_metrics import scrape
from tests.reference import reference_step

WIDTH, SLOW_STEPS = 8, 2
# the measured steps are 0, 10, 20, ...: baselines from 0-10 and 10-20, rank 1 slowed from 25, found at 40
SLOWED_FROM, STEPS = 25, 41
SLOW_LINE = re.compile(r"raypipe: slow worker replica (\d+) stage (\d+) tp_rank (\d+) on node (\S+): its own compute "
                       r"is ([\d.]+)x its baseline")


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def layers() -> list[raypipe.LayerSpec]:
    timed = raypipe.LayerSpec(TimedLayer, 0.006, 0.003, 0.003, WIDTH)
    planned = raypipe.LayerSpec(MLP, WIDTH, 16, tp_plan=PLAN)
    return [timed, planned, timed, planned]


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _slow_down_in(worker, factor: float) -> None:
    slow_down(factor)


def test_a_slow_tensor_parallel_rank_is_named_alone_from_its_measured_own_compute(fake_ray, caplog):  # noqa: F811
    assert COLLECTIVE_WAIT_EVERY == 10  # the steps above
    config = PipelineConfig(num_stages=1, num_micro_batches=2, tensor_parallel=2, sequence_parallel=False,
                            slow_steps=SLOW_STEPS, snapshot_every=0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, WIDTH, generator=generator), torch.randn(4, 4, WIDTH, generator=generator))
               for _ in range(STEPS)]
    losses = []
    with MetricsExporter() as exporter, GlooPipeline(layers(), nn.functional.mse_loss, sgd, config) as pipeline:
        controller = Controller(config, [4], StageModel(tuple(nn.Linear(4, 4) for _ in range(4)), None,
                                                         nn.functional.mse_loss, None, len), metrics=exporter)
        controller.start()
        fabricated = controller.executor.run_step

        def run_step(data_step, batch, loss_scale):  # the fakes' step, with the real run's timeline
            outcome = fabricated(data_step, batch, loss_scale)
            if data_step == SLOWED_FROM:
                pipeline.run_in(1, _slow_down_in, 4.0)
            result = pipeline.step(*batches[data_step])
            losses.append(result.loss)
            for report in outcome.reports:
                where = (report.stats.replica, report.stats.stage, report.stats.tp_rank)
                report.events[:] = [event for event in result.timeline
                                    if (event.replica, event.stage, event.tp_rank) == where]
            return outcome

        controller.executor.run_step = run_step
        with caplog.at_level("WARNING", logger="raypipe"):
            for step in range(STEPS):
                controller.run_step(step, None, None)
                controller.committed(step + 1, LoggedStep(step, None, None))
        slowdowns = scrape(exporter)["samples"]["raypipe_worker_slowdown"]

    found = [(found.data_step, found.worker.worker) for found in controller.slow_workers]
    assert found == [(40, (0, 0, 1))], found  # rank 1 alone: not its waiting peer, not the stage whole
    lines = [match.groups() for record in caplog.records if (match := SLOW_LINE.search(record.getMessage()))]
    assert [groups[:4] for groups in lines] == [("0", "0", "1", "node")]
    assert float(lines[0][4]) > 1.5  # 4x its sleeps (its collectives and arithmetic not slowed): well above 1.3
    rank = {labels["tp_rank"]: ratio for labels, ratio in ((dict(key), ratio) for key, ratio in slowdowns.items())}
    # the peer's own compute near its baseline (its op times, waits included, are rank 1's: 2-3x)
    assert rank["0"] < 1.5 < rank["1"], slowdowns

    reference = nn.Sequential(*(build_layer(spec, index, config.seed) for index, spec in enumerate(layers())))
    optimizer = sgd(reference.parameters())
    expected = [reference_step(reference, optimizer, nn.functional.mse_loss, inputs, targets, 2)[0]
                for inputs, targets in batches]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-7)
