"""Tensor parallelism inside a stage on Ray (PP x TP x DP): each stage's ``t`` workers split the
LLaMA's planned layers over their tensor-parallel group, and the run trains as one process.

The reference is this process: the same layers (the per-layer seeding builds the same initial
weights), unsplit, fp32, gradient accumulation over the global batch (tests/reference.py's
loop). Tensor parallelism changes the order of reductions, so each step's loss and pre-clip
gradient norm are compared within 1e-5 relative, and every parameter tensor after the steps
within 1e-5 relative in norm, not bitwise. The LLaMA tiny preset is dropout-free; clipping bites.

One Ray trainer per cell, three steps each, on the session's Ray instance (6 logical CPUs:
up to 2 replicas x 1 stage or 1 replica x 2 stages at t = 2, plus 2 x 2 x 2 on a cluster of
its own, marked ``cluster``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import raypipe
from raypipe import ConfigError
from raypipe.models.layers import build_layer
from raypipe.models.llama import llama_layers, llama_loss
from tests.reference import reference_step

STEPS = 3
BATCH, SEQ_LEN = 4, 8  # the sequence divides by t = 2 (sequence parallelism shards it)
CLIP = 0.5  # below every step's norm: the clip bites
TOLERANCE = 1e-5


def adamw(params) -> torch.optim.AdamW:
    """AdamW with an eps above the float noise of the smallest gradients. Adam divides each element's
    step by its gradients' root mean square: with the default eps (1e-8) an element whose gradients
    nearly cancel turns reduction-order noise into a visible step, and one process against itself
    (the same batches split into 2 or into 4 micro-batches) differs by 1.4e-5 in parameter norm after
    3 steps of this model; with eps=1e-3, by 1.5e-7. The state still carries over (m and v as DTensors)."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-3)

# (replicas, stages, schedule, sequence_parallel)
CELLS = [(1, 1, "gpipe", True), (1, 1, "1f1b", False), (1, 2, "gpipe", False), (1, 2, "1f1b", True),
         (2, 1, "1f1b", True)]


def _config(replicas: int, stages: int, schedule: str, sequence_parallel: bool) -> raypipe.PipelineConfig:
    return raypipe.PipelineConfig(num_stages=stages, num_micro_batches=2, num_replicas=replicas, schedule=schedule,
                                  tensor_parallel=2, sequence_parallel=sequence_parallel, clip_grad_norm=CLIP,
                                  snapshot_every=0)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 259, (BATCH, SEQ_LEN + 1), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _reference(config: raypipe.PipelineConfig) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor], float]:
    """Each step's (loss, pre-clip norm), the final state, and the first batch's loss after the
    steps, of one process on the same batches."""
    model = nn.Sequential(*(build_layer(spec, index, config.seed) for index, spec in enumerate(llama_layers("tiny"))))
    optimizer = adamw(model.parameters())
    count = config.num_micro_batches * config.max_replicas
    steps = [reference_step(model, optimizer, llama_loss, x, y, count, config.clip_grad_norm) for x, y in _batches()]
    with torch.no_grad():
        evaluated = float(llama_loss(model(_batches()[0][0]), _batches()[0][1]))
    return steps, model.state_dict(), evaluated


def run_cell(config: raypipe.PipelineConfig) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor], float]:
    """Each step's (loss, pre-clip norm), the final whole state and the first batch's evaluated
    loss after the steps, of a Ray trainer."""
    trainer = raypipe.PipelineTrainer(llama_layers("tiny"), llama_loss, adamw, config)
    try:
        steps = []
        for x, y in _batches():
            result = trainer.step(x, y)
            steps.append((result.loss, result.grad_norm))
        return steps, trainer.state_dict(), trainer.evaluate(*_batches()[0])
    finally:
        trainer.shutdown()


def _assert_matches_one_process(config, steps, state, evaluated) -> None:
    expected_steps, expected_state, expected_evaluated = _reference(config)
    assert evaluated == pytest.approx(expected_evaluated, rel=TOLERANCE)
    for (loss, norm), (expected_loss, expected_norm) in zip(steps, expected_steps, strict=True):
        assert loss == pytest.approx(expected_loss, rel=TOLERANCE)
        assert norm == pytest.approx(expected_norm, rel=TOLERANCE)
        assert norm > CLIP  # the clip bites
    assert state.keys() == expected_state.keys()
    for key, expected in expected_state.items():
        assert state[key].shape == expected.shape, key
        assert float((state[key] - expected).norm()) <= TOLERANCE * float(expected.norm()), key


@pytest.mark.parametrize("replicas, stages, schedule, sequence_parallel", CELLS,
                         ids=[f"d{d}-p{p}-t2-{s}-{'sp' if sp else 'nosp'}" for d, p, s, sp in CELLS])
def test_tensor_parallel_steps_equal_one_process(ray_cluster, replicas, stages, schedule, sequence_parallel):
    config = _config(replicas, stages, schedule, sequence_parallel)
    _assert_matches_one_process(config, *run_cell(config))


_OWN_CLUSTER = textwrap.dedent("""
    import sys, torch, ray
    from raypipe.runtime.cluster import LOCAL_SYSTEM_CONFIG
    sys.path.insert(0, {root!r})
    from ray import cloudpickle
    import tests.executor.test_tensor_parallel_steps as cells
    cloudpickle.register_pickle_by_value(cells)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING",
             _system_config=LOCAL_SYSTEM_CONFIG)
    torch.save(cells.run_cell(cells._config(2, 2, {schedule!r}, {sequence_parallel!r})), {out!r})
    ray.shutdown()
""")


@pytest.mark.cluster
@pytest.mark.parametrize("schedule, sequence_parallel", [("1f1b", True)])
def test_two_replicas_of_two_stages_at_t2_equal_one_process(tmp_path, schedule, sequence_parallel):
    """d = 2, p = 2, t = 2: eight workers, more than the session's Ray instance has CPUs for, so
    on a Ray instance of its own, in a process of its own."""
    out = tmp_path / "cell.pt"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = _OWN_CLUSTER.format(root=root, schedule=schedule, sequence_parallel=sequence_parallel, out=str(out))
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root, timeout=550)
    _assert_matches_one_process(_config(2, 2, schedule, sequence_parallel), *torch.load(out))


@pytest.mark.parametrize("change, field", [
    ({"schedule": "zb_h1"}, "schedule"), ({"precision": "bf16"}, "precision"),
    ({"shard_optimizer": True, "num_replicas": 2}, "shard_optimizer"),
    ({"activation_checkpoint": "always"}, "activation_checkpoint"), ({"snapshot_every": 1}, "snapshot_every"),
    ({"num_replicas": (1, 2)}, "num_replicas"), ({"transport": "object_store"}, "transport"),
])
def test_what_tensor_parallelism_does_not_run_yet_is_refused_by_name(change, field):
    config = raypipe.PipelineConfig(tensor_parallel=2, snapshot_every=0).replace(**change)
    with pytest.raises(ConfigError) as error:
        config.validate()
    first_line = str(error.value).splitlines()[0]
    assert error.value.field == field and "tensor_parallel=2 runs only with" in first_line


def test_sequence_parallel_follows_tensor_parallel_unless_given():
    assert raypipe.PipelineConfig().sequence_parallel is False
    assert raypipe.PipelineConfig(tensor_parallel=2).sequence_parallel is True
    assert raypipe.PipelineConfig(tensor_parallel=2, sequence_parallel=False).sequence_parallel is False
    assert raypipe.PipelineConfig().replace(tensor_parallel=2).sequence_parallel is True
    with pytest.raises(ConfigError, match="invalid sequence_parallel"):
        raypipe.PipelineConfig(tensor_parallel=2, sequence_parallel="yes", snapshot_every=0).validate()
    with pytest.raises(ConfigError, match="invalid tensor_parallel=0"):
        raypipe.PipelineConfig(tensor_parallel=0).validate()


def test_a_sequence_that_sequence_parallelism_cannot_shard_is_refused_before_the_step():
    from raypipe.control.steps import check_sequence_length
    from raypipe.core.packed import make_packed

    check_sequence_length(torch.zeros(2, 8, dtype=torch.long), 2)
    ids = torch.zeros(2, 7, dtype=torch.long)
    for inputs in (ids, make_packed(ids, ids, ids)):  # a packed batch's sequence is its last dimension
        with pytest.raises(ConfigError) as error:
            check_sequence_length(inputs, 2)
        assert str(error.value).splitlines()[0].startswith("invalid tensor_parallel=2: sequence parallelism shards")
