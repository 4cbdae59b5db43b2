"""Pipeline training equals a single-process loop with gradient accumulation,
in every executor (each test names the one it runs)."""
import copy

import pytest
import torch
from torch import nn

import raypipe
from raypipe.models.layers import build_layer
from tests.reference import (adamw, assert_parameters_match, executor_options, in_process, make_mlp, on_ray,
                             random_batches, reference_step)

STEPS = 3
BATCH = 10  # does not divide evenly into 3 or 4 micro-batches


def batches(seed=1):
    return random_batches(BATCH, STEPS, seed)


# The per-op executor on Ray (one trainer over the object store under 1F1B and one over Ray Direct Transport
# under zb_h1, three stages, more micro-batches than stages with 10 rows split unevenly in 4, the global clip
# biting): tests/executor/test_packed_pipeline.py's cells of a model passing trees (GPipe, the default, runs on
# it in tests/executor/test_atomic_steps.py, test_nonfinite.py and tests/stage/test_precision.py); the default
# executor on Ray, three stages and clipping: the chunked cells below (a ring of three under NCCL's emulation).
# Fewer micro-batches than stages (3 x 2), one stage with accumulation and an uneven 2 x 3 run the same step
# runner in one process (the in-process test below, with the same assertions), as does every size of
# tests/testing/test_op_interpreter.py's matrix.
@pytest.mark.parametrize("num_stages,num_micro_batches", [(1, 4), (2, 3), (3, 2)])
def test_matches_single_process_reference_in_process(num_stages, num_micro_batches):
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=num_micro_batches)
    assert_matches_single_process_reference(in_process, config)


def assert_matches_single_process_reference(trainer_of, config: raypipe.PipelineConfig) -> None:
    num_stages, num_micro_batches = config.num_stages, config.num_micro_batches
    clip = 0.05 if (num_stages + num_micro_batches) % 2 else None
    model = make_mlp()
    reference = copy.deepcopy(model)
    reference_optimizer = adamw(reference.parameters())
    with trainer_of(model, nn.functional.mse_loss, adamw, config.replace(clip_grad_norm=clip)) as trainer:
        for x, y in batches():
            result = trainer.step(x, y)
            loss, norm = reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y,
                                        num_micro_batches, clip)
            assert result.loss == pytest.approx(loss, rel=1e-5)
            assert result.grad_norm == pytest.approx(norm, rel=1e-5)
            if clip is not None:
                assert result.clip_coefficient == pytest.approx(min(1.0, clip / (norm + 1e-6)), rel=1e-5)
                assert result.clip_coefficient < 1.0  # the clip really bites
        assert_parameters_match(trainer.state_dict(), reference.state_dict())


# clipping by value is the stage's, alike under every executor: in one process through the step runner the
# per-step executor runs (the per-op executor's 1F1B on Ray: tests/executor/test_packed_pipeline.py)
def test_1f1b_and_clip_by_value_match_reference_in_process():
    assert_1f1b_and_clip_by_value_match_reference(in_process, {})


def assert_1f1b_and_clip_by_value_match_reference(trainer_of, options: dict) -> None:
    model = make_mlp()
    reference = copy.deepcopy(model)
    reference_optimizer = adamw(reference.parameters())
    config = raypipe.PipelineConfig(num_stages=3, num_micro_batches=4, schedule="1f1b", clip_grad_value=0.01,
                                    **options)
    with trainer_of(model, nn.functional.mse_loss, adamw, config) as trainer:
        for x, y in batches(seed=2):
            trainer.step(x, y)
            for xm, ym in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
                (nn.functional.mse_loss(reference(xm), ym) * (xm.shape[0] / BATCH)).backward()
            torch.nn.utils.clip_grad_value_(reference.parameters(), 0.01)
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        assert_parameters_match(trainer.state_dict(), reference.state_dict())


class TokenMLP(nn.Module):
    """Embedding + per-token MLP: works on any sequence length."""

    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)

    def forward(self, tokens):
        return self.embed(tokens)


# micro-batches of other lengths in every step, token-weighted, through the step runner in one process, which
# hands the tensors over as they are. On Ray: a boundary whose shape changes with the data, each new
# signature's step retried with headers, and the Ray trainer's state dict round trip, in
# tests/executor/test_learned_boundaries.py; layers given as specs (built in the stages) with a token-weighted
# loss: every LLaMA run on Ray (tests/test_fit.py's among them); the per-op executor's object store takes any
# shape (tests/executor/test_packed_pipeline.py sends it trees)
def test_micro_batches_with_different_sequence_lengths_train_in_process():
    # specs: each built in its stage with the seed of its index (as the reference builds them here)
    layers = [raypipe.LayerSpec(TokenMLP), raypipe.LayerSpec(nn.Linear, 16, 16), raypipe.LayerSpec(nn.Tanh),
              raypipe.LayerSpec(nn.Linear, 16, 32)]
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=3)
    reference = nn.Sequential(*(build_layer(spec, index, config.seed) for index, spec in enumerate(layers)))
    loss_fn = lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    generator = torch.Generator().manual_seed(3)

    def batch(lengths):
        return ([torch.randint(0, 32, (2, t), generator=generator) for t in lengths],
                [torch.randint(0, 32, (2, t), generator=generator) for t in lengths])

    # p2p predicts each micro-batch's shape from the step before: step 2 changes
    # micro-batches 0 and 2 and keeps 1, step 3 repeats step 2
    steps = [batch([5, 9, 3]), batch([3, 9, 5]), batch([3, 9, 5])]
    # weight by token count so the loss is the exact mean over all tokens of the step
    with in_process(layers, loss_fn, adamw, config, loss_count_fn=lambda y: y.numel()) as trainer:
        results = [trainer.step(xs, ys) for xs, ys in steps]
        state = trainer.state_dict()
    optimizer = adamw(reference.parameters())
    for result, (xs, ys) in zip(results, steps):  # one process with token-weighted accumulation
        total, expected = sum(y.numel() for y in ys), 0.0
        for x, y in zip(xs, ys):
            loss = loss_fn(reference(x), y) * y.numel() / total
            loss.backward()
            expected += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        assert result.loss == pytest.approx(expected, rel=1e-5)
    assert_parameters_match(state, reference.state_dict())


# three stages (a middle one) with the split backward (zb_h1: I and W ops, W deferred) on Ray: the per-op
# executor over Ray Direct Transport, in tests/executor/test_packed_pipeline.py (its model passing trees,
# with these assertions and the clip coefficient); the default executor on Ray runs a ring of three with the
# global clip (and its measured receives) in the chunked cells below. 1f1b on three stages under the default
# executor's step runner runs in one process (the in-process test below, its receives measured too), as do
# every schedule and activation-checkpoint mode (tests/testing/test_op_interpreter.py) and two stages
# under zb_h1, with the same assertions.
@pytest.mark.parametrize("num_stages,schedule", [(2, "zb_h1"), (3, "1f1b")])
def test_global_clipping_matches_single_process_reference_in_process(num_stages, schedule):
    assert_global_clipping_matches_single_process_reference(in_process, num_stages, "p2p", schedule)


def assert_global_clipping_matches_single_process_reference(trainer_of, num_stages: int, transport: str,
                                                            schedule: str) -> None:
    model = make_mlp()
    reference = copy.deepcopy(model)
    reference_optimizer = adamw(reference.parameters())
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=4, schedule=schedule,
                                    clip_grad_norm=0.05, **executor_options(transport))
    with trainer_of(model, nn.functional.mse_loss, adamw, config) as trainer:
        for x, y in batches():
            result = trainer.step(x, y)
            loss, norm = reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y, 4, 0.05)
            assert (result.loss, result.grad_norm) == (pytest.approx(loss, rel=1e-5), pytest.approx(norm, rel=1e-5))
        assert_parameters_match(trainer.state_dict(), reference.state_dict())
        if transport.startswith("p2p"):
            backward = {"B"} if schedule == "1f1b" else {"I", "W"}
            assert {event.op for event in result.timeline} >= {"F", "recv"} | backward  # receives are measured too


# Model chunks on Ray (v chunks on each worker, activations crossing back from the last worker to the first,
# zbv's both ends on worker 0): interleaved 1F1B on a ring of three under NCCL's emulation below, and two
# replicas with ZeRO-1 under zbv recomputing every forward in tests/executor/test_elastic.py's elastic run (its
# first steps, before it grows to three; the same checks of the measured receives and of evaluate) (that every
# chunked schedule's lowered order runs under the rendezvous rule, which the emulation enforces, zbv's at
# p = 3 and m = 3 among them, exchanges and headers included, is checked without Ray:
# tests/core/test_header_first.py, tests/core/test_new_schedules.py). Every cell of this pairwise subset runs
# the same step runner in one process (with the same assertions but evaluate, the driver's forward through
# every chunk in order, which the Ray cells check); the whole matrix (every chunked schedule x activation
# checkpointing x replicas with ZeRO-1, bf16 and fp16) runs in-process in tests/testing/test_op_interpreter.py. zbv at p = 3, m = 3 runs its list-scheduled order
# (raypipe.core.list_scheduling), at p = 2, m = 3 the paper's V.
CHUNKED = [("interleaved_1f1b", 2, 2, 4, {}, 1),
           ("interleaved_1f1b", 3, 2, 3, {"activation_checkpoint": "except_last"}, 1),
           ("zbv", 2, 2, 3, {"activation_checkpoint": "always"}, 2),
           ("zbv", 3, 2, 3, {"activation_checkpoint_segments": 1}, 1)]


def assert_chunked_run_matches_single_process_reference(schedule, num_stages, virtual_stages, num_micro_batches,
                                                        mode, num_replicas, trainer_of=on_ray):
    model = make_mlp()
    reference = copy.deepcopy(model)
    reference_optimizer = adamw(reference.parameters())
    count = num_micro_batches * num_replicas
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=num_micro_batches, schedule=schedule,
                                    virtual_stages=virtual_stages, num_replicas=num_replicas,
                                    shard_optimizer=num_replicas > 1, clip_grad_norm=0.05, **mode)
    with trainer_of(model, nn.functional.mse_loss, adamw, config) as trainer:
        if trainer_of is on_ray:
            assert len(trainer.balance) == num_stages * virtual_stages
        else:
            assert sum(len(worker.spec.chunk_sizes) for worker in trainer.pipeline.replicas[0].workers) == (
                num_stages * virtual_stages)
        for x, y in batches():
            result = trainer.step(x, y)
            loss, norm = reference_step(reference, reference_optimizer, nn.functional.mse_loss, x, y, count, 0.05)
            assert (result.loss, result.grad_norm) == (pytest.approx(loss, rel=1e-5), pytest.approx(norm, rel=1e-5))
        assert_parameters_match(trainer.state_dict(), reference.state_dict())
        if trainer_of is on_ray:  # the default executor's: its receives are measured too
            backward = {"I", "W"} if schedule == "zbv" else {"B"}
            assert {event.op for event in result.timeline} >= {"F", "recv"} | backward
            x, y = batches(seed=7)[0]
            with torch.no_grad():
                expected = float(nn.functional.mse_loss(reference(x), y))
            assert trainer.evaluate(x, y) == pytest.approx(expected, rel=1e-5)  # forward through every chunk in order


@pytest.mark.parametrize("schedule,num_stages,virtual_stages,num_micro_batches,mode,num_replicas",
                         CHUNKED, ids=lambda value: str(value))
def test_chunked_schedules_match_single_process_reference_in_process(schedule, num_stages, virtual_stages,
                                                                     num_micro_batches, mode, num_replicas):
    assert_chunked_run_matches_single_process_reference(schedule, num_stages, virtual_stages, num_micro_batches,
                                                        mode, num_replicas, in_process)


@pytest.mark.parametrize("schedule,num_stages,virtual_stages,num_micro_batches,mode,num_replicas",
                         [CHUNKED[1]], ids=lambda value: str(value))
def test_chunked_schedules_under_nccls_emulation_match_single_process_reference(
        ray_cluster, monkeypatch, schedule, num_stages, virtual_stages, num_micro_batches, mode, num_replicas):
    """Under NCCL's emulation (RAYPIPE_EMULATE_NCCL=1: rendezvous sends, one stream per rank, a pair's
    messages matched in issue order) a ring of three chunked workers each sending on before it receives
    completes: its exchanges receive the payloads the lowering awaits headers for in their batches (with
    every payload after its batch, as before, it waited forever)."""
    monkeypatch.setenv("RAYPIPE_EMULATE_NCCL", "1")
    assert_chunked_run_matches_single_process_reference(schedule, num_stages, virtual_stages, num_micro_batches,
                                                        mode, num_replicas)
