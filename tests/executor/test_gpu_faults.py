"""Failures on GPUs over NCCL: an in-step error and a killed worker cost seconds, not the watchdog.

On NCCL a receive from a failed or departed peer neither raises nor returns: a
stage's neighbours are released only by the driver's abort of their
communicator (``P2PChannel.abort()``), never by ``p2p_timeout_s``. The CPU suite
proves that path under NCCL's emulation (tests/executor/test_atomic_steps.py,
tests/executor/test_fault_tolerance.py); this runs it over real NCCL.

Marked ``gpu`` and ``gpus2``: two stages over NCCL need two GPUs (NCCL refuses two
ranks on one), so it skips on a one-GPU node and is deselected without CUDA. Run it
on a node with two with ``python -m pytest -q -m gpus2 tests``.
"""
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

import raypipe
from raypipe import StageError, StepAborted
from tests.executor.test_atomic_steps import FAILING, Tripwire, marked
from tests.executor.test_fault_tolerance import Sleep
from tests.reference import adamw, assert_bitwise_equal, checkpoint_state

MICRO_BATCHES, BATCH = 3, 6  # micro-batch FAILING (1) holds rows 2-3
PAUSE_S = 0.3  # stage 0 sleeps this long in each micro-batch's forward: a kill at KILL_AT_S lands inside a step
KILL_AT_S = PAUSE_S / 2
BOUND_S = 60.0  # the failed step's error and the heal; far below p2p_timeout_s, where NCCL's watchdog would fire


def _layers():
    """Stage 0: an identity Linear (the tripwire's mark passes unchanged) and a pause;
    stage 1: the tripwire of tests/executor/test_atomic_steps.py, then an MLP."""
    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    with torch.no_grad():
        first.weight.copy_(torch.eye(4))
        first.bias.zero_()
    return [first, Sleep(PAUSE_S), Tripwire(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)]


NUM_LAYERS = len(_layers())


def _config():
    # p2p_timeout_s=120: a neighbour left to NCCL's watchdog would show as a step of >= 120 s, not < BOUND_S
    return raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES, balance=[2, 4], use_gpu=True,
                                  transport="p2p", p2p_timeout_s=120.0, hang_timeout_s=10.0)


def _batches(steps):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 2, generator=generator))
            for _ in range(steps)]


def _parameters(trainer):
    return {key: value.detach().cpu() for key, value in trainer.state_dict().items()}


@pytest.mark.cluster
@pytest.mark.gpu
@pytest.mark.gpus2
def test_a_forward_error_and_a_sigkill_over_nccl_are_released_and_healed_within_60_s(ray_cluster, tmp_path):
    assert _config().p2p_timeout_s > BOUND_S
    batches = _batches(4)
    # the uninterrupted run: same seed, data, layout and GPUs
    with raypipe.PipelineTrainer(_layers(), nn.functional.mse_loss, adamw, _config()) as trainer:
        expected_losses = [trainer.step(x, y).loss for x, y in batches]
        expected = checkpoint_state(trainer, tmp_path / "uninterrupted", NUM_LAYERS)

    with raypipe.PipelineTrainer(_layers(), nn.functional.mse_loss, adamw, _config()) as trainer:
        losses = [trainer.step(*batches[0]).loss]
        before = _parameters(trainer)
        saved = checkpoint_state(trainer, tmp_path / "before", NUM_LAYERS)

        # 1. stage 1 raises in forward on micro-batch FAILING; stage 0 is left waiting on it over NCCL
        # (for the gradients it never sends), and only the abort of its communicator releases it
        x, y = batches[1]
        started = time.monotonic()
        with pytest.raises(StageError) as error:
            trainer.step(marked(x, 0), y)
        raised_after = time.monotonic() - started
        assert raised_after < BOUND_S, f"the failed step raised after {raised_after:.1f} s (NCCL's watchdog?)"
        assert not isinstance(error.value, StepAborted)  # the cause, not a consequence
        assert (error.value.stage, error.value.op, error.value.micro_batch) == (1, "F", FAILING)
        assert f"stage 1, op F, micro-batch {FAILING}" in str(error.value)
        assert "tripwire" in str(error.value.__cause__)
        assert trainer.step_count == 1 and trainer.failures == []  # an error in the step is no lost worker
        assert_bitwise_equal(before, _parameters(trainer), "parameters")
        assert_bitwise_equal(saved, checkpoint_state(trainer, tmp_path / "after", NUM_LAYERS))
        losses.append(trainer.step(x, y).loss)  # the next step trains

        # 2. SIGKILL stage 0 inside a step (in its first pause): stage 1 waits on a receive from a dead
        # peer, which NCCL never fails; the driver aborts it and heals the step
        victim = trainer.workers[0].pid
        killer = threading.Timer(KILL_AT_S, os.kill, (victim, signal.SIGKILL))
        started = time.monotonic()
        killer.start()
        result = trainer.step(*batches[2])
        step_seconds = time.monotonic() - started
        killer.join()
        assert result.recovered and len(result.failures) == 1 and "died" in result.failures[0], result.failures
        assert trainer.failures == result.failures
        assert victim not in {worker.pid for worker in trainer.workers}, "the victim was not replaced"
        healed = trainer.recoveries[-1]
        assert healed.seconds < BOUND_S and step_seconds < BOUND_S, (healed.seconds, step_seconds)
        losses.append(result.loss)
        losses.append(trainer.step(*batches[3]).loss)
        state = checkpoint_state(trainer, tmp_path / "healed", NUM_LAYERS)

    assert losses == expected_losses  # the failed step trained nothing; the healed one was redone exactly
    assert_bitwise_equal(expected, state)
    print(f"NCCL: forward error raised after {raised_after:.1f} s; kill to step done {step_seconds:.1f} s "
          f"(heal {healed.seconds:.1f} s, from {healed.source})")
