"""A step completes on every stage or changes nothing, in every executor.

A forward or a backward failure on a middle micro-batch of a middle stage
raises a StageError naming that stage and micro-batch within seconds (the p2p
executor does not wait out ``p2p_timeout_s``), leaves every parameter,
optimizer and LR-scheduler state bitwise as it was, and the next step trains
exactly like a single process that never saw the failed batches.
"""
import copy
import time

import pytest
import torch
from torch import nn

import raypipe
from raypipe import StageError, StepAborted
from tests.reference import (ReplaceGradientIf, assert_bitwise_equal, assert_parameters_match, checkpoint_state,
                             executor_options, in_process, on_ray, reference_step)

MARK = -100.0  # an input value no real sample has: the tripwire's signal
BATCH, MICRO_BATCHES, FAILING = 6, 3, 1  # micro-batch 1 holds rows 2-3


def _tripwire_in_backward(grad):
    raise FloatingPointError("tripwire in backward")


class Tripwire(nn.Module):
    """Identity that fails in forward when column 0 of its first row is marked,
    and in backward when column 1 is."""

    def forward(self, x):
        if x[0, 0] < MARK / 2:
            raise ValueError("tripwire in forward")
        return ReplaceGradientIf.apply(x, bool(x[0, 1] < MARK / 2), _tripwire_in_backward)


def layers_and_balance(num_stages):
    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    with torch.no_grad():  # the marks reach the tripwire unchanged
        first.weight.copy_(torch.eye(4))
        first.bias.zero_()
    layers = [first, Tripwire(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)]
    return layers, {2: [1, 4], 3: [1, 2, 2]}[num_stages]  # the tripwire opens stage 1


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def marked(x, column):
    x = x.clone()
    x[FAILING * 2, column] = MARK  # first row of micro-batch 1
    return x


# each executor with clipping (3 stages) and without (2); Ray's gloo transport runs the per-op
# executor's steps with other tensor transfers, once. Each executor once on Ray, three stages (a middle one)
# but for the per-op tasks of the default executor; the default executor's three stages over its connections
# on Ray under NCCL's emulation below (its release: the driver's abort), and its step runner (the failed op
# raised, no worker's commit, the next step) through the same code in one process, with the same assertions.
@pytest.mark.parametrize("num_stages,transport", [(3, "object_store"), (2, "p2p-tasks"), (3, "gloo")])
def test_a_failed_step_changes_nothing_and_the_next_one_trains(ray_cluster, tmp_path, transport, num_stages):
    assert_a_failed_step_changes_nothing_and_the_next_one_trains(on_ray, tmp_path, transport, num_stages)


# and with the stage inputs kept in the object store for recompute, each backward fetching the next one's
# ahead: the failed backward (micro-batch 1's) has fetched micro-batch 2's, which the next step must not use
@pytest.mark.parametrize("fields", [{}, {"activation_checkpoint": "always", "offload_activations": True}],
                         ids=["kept", "offloaded"])
@pytest.mark.parametrize("num_stages,transport", [(3, "p2p")])
def test_a_failed_step_changes_nothing_and_the_next_one_trains_in_process(request, tmp_path, transport, num_stages,
                                                                          fields):
    if fields.get("offload_activations"):
        request.getfixturevalue("ray_cluster")  # the offloader's object store: the driver's, in one process
    assert_a_failed_step_changes_nothing_and_the_next_one_trains(in_process, tmp_path, transport, num_stages,
                                                                 **fields)


def assert_a_failed_step_changes_nothing_and_the_next_one_trains(trainer_of, tmp_path, transport: str,
                                                                 num_stages: int, **fields) -> None:
    layers, balance = layers_and_balance(num_stages)
    reference = nn.Sequential(*copy.deepcopy(layers))
    reference_optimizer = adamw(reference.parameters())
    reference_scheduler = halving(reference_optimizer)
    clip = 1.0 if num_stages == 3 else None  # both the early-apply path and the reduce-first path
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=MICRO_BATCHES, balance=balance,
                                    clip_grad_norm=clip, **executor_options(transport), **fields)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 2, generator=generator))
               for _ in range(2)]
    with trainer_of(layers, nn.functional.mse_loss, adamw, config, lr_scheduler=halving) as trainer:
        x, y = batches[0]
        trainer.step(x, y)
        reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y, MICRO_BATCHES, clip)
        reference_scheduler.step()
        before = checkpoint_state(trainer, tmp_path / "before", len(layers))

        for column, op in ((0, "F"), (1, "B")):
            started = time.monotonic()
            with pytest.raises(StageError) as error:
                trainer.step(marked(x, column), y)
            assert time.monotonic() - started < 10
            assert not isinstance(error.value, StepAborted)  # the cause, not a consequence
            assert (error.value.stage, error.value.op, error.value.micro_batch) == (1, op, FAILING)
            assert f"stage 1, op {op}, micro-batch {FAILING}" in str(error.value)
            assert "tripwire" in str(error.value.__cause__)
            assert trainer.step_count == 1

        assert_bitwise_equal(before, checkpoint_state(trainer, tmp_path / "after", len(layers)))
        x, y = batches[1]
        result = trainer.step(x, y)
        loss, _ = reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y, MICRO_BATCHES, clip)
        assert result.loss == pytest.approx(loss, rel=1e-5)
        assert_parameters_match(trainer.state_dict(), reference.state_dict())


def test_under_nccls_emulation_a_failed_step_changes_nothing_and_the_next_one_trains(ray_cluster, tmp_path,
                                                                                     monkeypatch):
    """The same with three stages under NCCL's emulation (RAYPIPE_EMULATE_NCCL=1): the
    middle stage's neighbours are released only by the driver's abort (no transfer
    raises when a peer leaves), still within seconds, with the cause reported."""
    monkeypatch.setenv("RAYPIPE_EMULATE_NCCL", "1")
    assert_a_failed_step_changes_nothing_and_the_next_one_trains(on_ray, tmp_path, "p2p", 3)


# every way a stage keeps, recomputes and steps (each cell against itself: the same trainer in one process
# that never saw the failed batches); the offloaded cells' inputs in the driver's object store
LEAVES_NOTHING = {
    "1f1b-recompute-offload": {"schedule": "1f1b", "activation_checkpoint": "always", "offload_activations": True},
    "gpipe-except_last-offload": {"schedule": "gpipe", "activation_checkpoint": "except_last",
                                  "offload_activations": True},
    "zb_h1-recompute": {"schedule": "zb_h1", "activation_checkpoint": "always"},
    "zb_h1-offload": {"schedule": "zb_h1", "activation_checkpoint": "always", "offload_activations": True},
    "interleaved-offload": {"schedule": "interleaved_1f1b", "virtual_stages": 2, "balance": [1, 1, 2, 1],
                            "activation_checkpoint": "always", "offload_activations": True},
    "zbv-offload": {"schedule": "zbv", "virtual_stages": 2, "balance": [1, 1, 2, 1],
                    "activation_checkpoint": "always", "offload_activations": True},
    "bf16-zero1": {"precision": "bf16", "num_replicas": 2, "shard_optimizer": True},
    "fp16": {"precision": "fp16"},
}


@pytest.mark.parametrize("fields", LEAVES_NOTHING.values(), ids=LEAVES_NOTHING.keys())
def test_a_failed_step_leaves_nothing_the_next_steps_read(request, fields):
    """A step failing in its forward, then one failing in its backward (micro-batch 1, stage 1), then
    a step on another batch: bitwise the run without the two failed steps, in every cell."""
    if fields.get("offload_activations"):
        request.getfixturevalue("ray_cluster")
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES, clip_grad_norm=1.0,
                                    **{"balance": [1, 4], **fields})
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 2, generator=generator))
               for _ in range(3)]
    runs = []
    for failing in (True, False):
        layers, _ = layers_and_balance(2)
        with in_process(layers, nn.functional.mse_loss, adamw, config, lr_scheduler=halving) as trainer:
            results = [trainer.step(*batches[0])]
            if failing:
                for column in (0, 1):
                    with pytest.raises(StageError):
                        trainer.step(marked(batches[1][0], column), batches[1][1])
            results += [trainer.step(*batch) for batch in batches[1:]]
            runs.append(([(result.loss, result.grad_norm) for result in results], trainer.state_dict()))
    (failed_results, failed_state), (results, state) = runs
    assert failed_results == results
    assert_bitwise_equal(state, failed_state)
