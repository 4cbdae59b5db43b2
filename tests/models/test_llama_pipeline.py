"""The tiny LLaMA trained on 2 pipeline stages equals one process with gradient accumulation.

The reference builds the same layers the stages build (each from its
LayerSpec, seeded by ``(seed, "init", layer index)``), so the initial weights
are compared too; it then accumulates the micro-batches' gradients, weighted by
their share of the non-ignored target tokens, and steps AdamW (fp32).

The reference sums the micro-batches' gradients in the order the schedule runs
their backward passes. The sum is the same in any order, but float32 rounds it
differently, and AdamW (dividing each gradient by sqrt(v) + eps) magnifies that
for gradients near eps: summing in the opposite order moves single weights of
this model by up to 8e-6 after two steps (updates are 1e-3), beyond rtol 1e-5.

Both cells run the step runner that trains in one process (tests/reference.py's ``in_process``):
what they check is the step's arithmetic. A LLaMA built from LayerSpecs on Ray's workers is
compared with transformers in tests/models/test_hf_interop.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import raypipe
from raypipe.models.layers import build_layer
from raypipe.models.llama import IGNORE_INDEX, get_config, llama_layers, llama_loss
from raypipe.run import llama_count_tokens
from tests.reference import assert_parameters_match, in_process

RTOL = 1e-5
SEED = 0
STEPS = 2
BATCH, SEQ_LEN, MICRO_BATCHES = 8, 32, 4
CONFIG = get_config("tiny")


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token batches whose micro-batches hold different numbers of counted tokens."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ_LEN + 1), generator=generator)
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        # padding at the end of some sequences: ignored, so micro-batches weigh differently
        for row, padded in enumerate([0, 5, 31, 0, 12, 0, 0, 20]):
            if padded:
                targets[row, -padded:] = IGNORE_INDEX
        out.append((inputs, targets))
    return out


def reference_model() -> nn.Sequential:
    """The model as one process builds it from the same specs and seeds as the stages."""
    return nn.Sequential(*[build_layer(spec, index, SEED) for index, spec in enumerate(llama_layers(CONFIG))])


def reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                   targets: torch.Tensor, backward_order: list[int]) -> tuple[float, float]:
    """Gradient accumulation over the micro-batches, summed in ``backward_order``;
    returns (global mean loss, grad norm before the step)."""
    total = int((targets != IGNORE_INDEX).sum())
    parts = list(zip(torch.tensor_split(inputs, MICRO_BATCHES), torch.tensor_split(targets, MICRO_BATCHES)))
    loss_sum = 0.0
    for x, y in (parts[mb] for mb in backward_order):
        loss = llama_loss(model(x), y) * (int((y != IGNORE_INDEX).sum()) / total)
        loss.backward()
        loss_sum += loss.item()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, float(norm)


def relative_differences(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """||actual - expected|| / ||expected|| of every tensor (same keys required)."""
    assert actual.keys() == expected.keys()
    return {key: float(torch.linalg.vector_norm(actual[key] - expected[key]) / torch.linalg.vector_norm(expected[key]))
            for key in expected}


def test_micro_batches_really_weigh_differently():
    # guards the test below: equal weights would hide a sample-weighted (wrong) mean
    counts = [int((y != IGNORE_INDEX).sum()) for y in torch.tensor_split(batches()[0][1], MICRO_BATCHES)]
    assert len(set(counts)) > 1


# The order each schedule runs the micro-batches' backward in (GPipe: all forwards,
# then the backwards in reverse; 1F1B: in order), so that float32 sums round alike.
BACKWARD_ORDER = {"gpipe": list(reversed(range(MICRO_BATCHES))), "1f1b": list(range(MICRO_BATCHES))}


# GPipe, and 1F1B with activation checkpointing, through the step runner that trains, in one process
@pytest.mark.parametrize(("schedule", "activation_checkpoint"), [("gpipe", "never"), ("1f1b", "always")])
def test_two_stages_match_single_process_training_in_process(schedule, activation_checkpoint):
    assert_two_stages_match_single_process_training(in_process, schedule, activation_checkpoint)


def assert_two_stages_match_single_process_training(trainer_of, schedule: str, activation_checkpoint: str) -> None:
    reference = reference_model()
    optimizer = adamw(reference.parameters())
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES, schedule=schedule,
                                    activation_checkpoint=activation_checkpoint, precision="fp32", seed=SEED)
    with trainer_of(llama_layers(CONFIG), llama_loss, adamw, config, loss_count_fn=llama_count_tokens) as trainer:
        balance = [len(worker.layer_indices) for worker in trainer.pipeline.workers]
        assert balance[0] >= 1 and balance[1] >= 1 and sum(balance) == CONFIG.n_layers + 2
        assert_parameters_match(trainer.state_dict(), reference.state_dict(), rtol=0, atol=0)
        initial = {key: value.clone() for key, value in reference.state_dict().items()}
        for inputs, targets in batches():
            result = trainer.step(inputs, targets)
            loss, norm = reference_step(reference, optimizer, inputs, targets, BACKWARD_ORDER[schedule])
            assert result.loss == pytest.approx(loss, rel=RTOL)
            assert result.grad_norm == pytest.approx(norm, rel=RTOL)
        trained = trainer.state_dict()
    assert_parameters_match(trained, reference.state_dict(), rtol=RTOL)
    # the tolerance is far below what training changed: every tensor moved by more than 10x it
    moved = relative_differences(trained, initial)
    assert min(moved.values()) > 10 * RTOL, min(moved.items(), key=lambda item: item[1])
