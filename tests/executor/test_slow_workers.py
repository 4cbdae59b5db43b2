"""A slow worker on real processes: timed layers on 2 stages, stage 1 slowed 4x between two
steps (its sleeps, not its arithmetic), with on_slow="replace" and a warm spare. One replica, two
workers: the suite's time (the other replicas' comparison, and on_slow="report" alone, are tested
without Ray in tests/control/). The driver names it, its node and its factor in one WARNING line
once it stayed behind for slow_steps steps, marks it on that step's timeline, and swaps it for the
spare before the next step, its state moved from it; every step's loss is the plain one-process
loop's (tests/reference.py): neither the slow worker nor its swap changes a result. A slow rank at
tensor_parallel=2, named alone and not its waiting peer, runs on real processes without Ray:
tests/control/test_slow_tensor_parallel_rank.py."""
from __future__ import annotations

import copy
import logging
import re

import torch
from torch import nn

import raypipe
from raypipe.testing import timed_model
from raypipe.testing.fault_injection import slow_down_worker
from tests.reference import reference_step

# found after SLOW_STEPS slowed steps (step 6) when quiet and swapped before the next; under the suite's load
# a window where the other stage's own compute rose too reads as the whole replica slowed (a shared cause,
# not this worker), which can put the finding later: once, with 10 steps, no swap came (the step it was found
# at not recorded then): steps to spare, and the step is in the message now
STEPS, SLOWED_FROM, SLOW_STEPS = 14, 4, 3
SWAP_LINE = re.compile(r"raypipe: swapped slow replica 0 stage 1 tp_rank 0 for spare \d+ in [\d.]+s, its state moved "
                       r"from it, no step replayed")
SLOW_LINE = re.compile(r"raypipe: slow worker replica (\d+) stage (\d+) tp_rank (\d+) on node (\S+): its own compute "
                       r"is ([\d.]+)x its baseline, (\d+) steps in a row")


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def test_a_worker_slowed_mid_run_is_named_swapped_for_a_spare_and_the_losses_do_not_move(ray_cluster, caplog):
    torch.manual_seed(0)
    layers = timed_model(4, forward_s=0.004, input_grad_s=0.004, weight_grad_s=0.004, width=8)
    reference = copy.deepcopy(layers)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator))
               for _ in range(STEPS)]
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, slow_steps=SLOW_STEPS, on_slow="replace",
                                    spare_workers=1)
    losses, marks, found_at = [], [], []
    with caplog.at_level(logging.WARNING, logger="raypipe"), \
            raypipe.PipelineTrainer(layers, nn.functional.mse_loss, sgd, config) as trainer:
        slowed = trainer.layout.topology.rank(0, 1)
        node = trainer.workers[slowed].node_id
        assert trainer.spares.wait_until_up(120)  # a spare up before the worker slows: the swap takes it
        for step, (inputs, targets) in enumerate(batches):
            if step == SLOWED_FROM:
                slow_down_worker(trainer.layout.actors[slowed], 4.0)
            result = trainer.step(inputs, targets)
            losses.append(result.loss)
            marks += [(mark.replica, mark.stage, mark.tp_rank, mark.what.split()[0]) for mark in result.marks]
            found_at += [step] if any((m.replica, m.stage, m.tp_rank) == (0, 1, 0) for m in result.marks) else []
    found = [match.groups() for record in caplog.records if (match := SLOW_LINE.search(record.getMessage()))]
    named = [(int(replica), int(stage), int(tp_rank), where) for replica, stage, tp_rank, where, _, _ in found]
    assert (0, 1, 0, node) in named, found
    factor = float(next(groups[4] for groups in found if groups[:3] == ("0", "1", "0")))
    # 4x its sleeps: 3.83 alone; under the whole suite's load (the other xdist worker's test beside it)
    # every op's Python waits for a core in the baseline and the slowed steps alike, and it read 1.74 once
    assert factor > 1.5  # above slow_factor=1.3, by which it was named
    assert (0, 1, 0, "slow") in marks  # on the timeline of the step it was found at
    swaps = [record.getMessage() for record in caplog.records if SWAP_LINE.search(record.getMessage())]
    assert len(swaps) == 1, (found_at, [record.getMessage() for record in caplog.records])

    optimizer = sgd(reference.parameters())
    expected = [reference_step(reference, optimizer, nn.functional.mse_loss, inputs, targets, 2)[0]
                for inputs, targets in batches]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-7)
