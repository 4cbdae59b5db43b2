"""The per-step executor with its calls sent over a connection to each worker
(step_calls="direct", the default): a step runs on the worker beside its other calls, so a snapshot
still being copied out when the next step reaches its commit holds that commit
back, and is the state of its own step."""
import copy
import time

import pytest
import ray
import torch
from torch import nn

import raypipe
from tests.reference import adamw, assert_parameters_match, random_batches, reference_step

SNAPSHOT_SECONDS = 1.0


class SlowToCopy(nn.Linear):
    """A Linear whose state_dict takes a second: a snapshot of its stage is still
    being taken while the next step runs."""

    def state_dict(self, *args, **kwargs):
        time.sleep(SNAPSHOT_SECONDS)
        return super().state_dict(*args, **kwargs)


def test_a_snapshot_slower_than_the_next_step_holds_its_commit_and_is_its_own_steps_state(ray_cluster):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), SlowToCopy(16, 4)]
    reference = nn.Sequential(*copy.deepcopy(layers))
    reference_optimizer = adamw(reference.parameters())
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, balance=[2, 1])
    assert config.snapshot_every == 1 and config.step_calls == "direct"
    batches = random_batches(8, steps=3)
    with raypipe.PipelineTrainer(layers, nn.functional.mse_loss, adamw, config) as trainer:
        results = [trainer.step(x, y) for x, y in batches]
        snapshot_after_two = trainer._recovery._snapshots[0]
        assert snapshot_after_two.step == 2
        snapshot = ray.get(snapshot_after_two.refs[1])  # stage 1: the slow layer
    for x, y in batches[:2]:
        reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y, 2)
    # stage 1 holds layer 2 at its position 0: the state after step 2, not a mix with step 3
    expected = {name.split(".", 1)[1]: value for name, value in reference.state_dict().items() if name.startswith("2.")}
    assert_parameters_match({name.split(".", 1)[1]: value for name, value in snapshot["layers"].items()}, expected)
    assert snapshot["commits"] == 2
    # the third step's commit on stage 1 waited for the snapshot of the second
    gates = [event for event in results[2].timeline if event.op == "gate" and event.stage == 1]
    assert len(gates) == 1 and gates[0].end - gates[0].start > SNAPSHOT_SECONDS / 4, results[2].timeline
    commit = next(event for event in results[2].timeline if event.op == "optimizer" and event.stage == 1)
    assert commit.start >= gates[0].end


@pytest.mark.parametrize("step_calls", raypipe.config.STEP_CALLS)
def test_step_calls_is_checked(step_calls):
    raypipe.PipelineConfig(step_calls=step_calls).validate()
    with pytest.raises(raypipe.ConfigError, match="step_calls"):
        raypipe.PipelineConfig(step_calls="compiled").validate()  # removed: see benchmarks/RESULTS.md
