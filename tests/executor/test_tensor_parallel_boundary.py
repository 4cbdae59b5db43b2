"""Stage boundaries without sequence parallelism carry slices (issue 59, item 5): the activation
between stages is whole on every tensor-parallel rank, so each rank sends only its 1/t slice along
the sequence and the receiving stage gathers it over its tensor-parallel group (Megatron's
scatter-gather); the gradient crossing back is a slice too, gathered on the sending stage. A tree's
integer leaves (a packed row's positions and document ids) travel whole.

Each cell is (d, p, t) = (1, 2, 2) with ``sequence_parallel=False``, through
:class:`tests.gloo_pipeline.GlooPipeline` (the Ray actors' per-step worker in forked processes over
real gloo groups), three steps against one process (tests/reference.py's loop: each step's loss and
pre-clip norm within 1e-5 relative, every parameter within 1e-5 relative in norm; clipping bites),
and each worker's measured ``StageStats.sent_bytes`` against the bytes a t = 1 worker sends (measured
once, and counted here from the shapes). One pipeline per cell: the tests read a cell's run.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import raypipe
from raypipe.core.packed import IGNORE_INDEX, make_packed
from raypipe.errors import ConfigError
from raypipe.models.layers import build_layer
from raypipe.models.llama import get_config, llama_layers, llama_loss
from tests.gloo_pipeline import GlooPipeline
from tests.reference import reference_step

STEPS = 3
BATCH, SEQ_LEN, MICRO_BATCHES = 4, 8, 2  # the sequence divides by t = 2
CLIP = 0.5  # below every step's norm: the clip bites
TOLERANCE = 1e-5
TINY = get_config("tiny")
HIDDEN_BYTES = (BATCH // MICRO_BATCHES) * SEQ_LEN * TINY.dim * 4  # one micro-batch's fp32 hidden states
INDEX_BYTES = (BATCH // MICRO_BATCHES) * SEQ_LEN * 8  # one micro-batch's int64 positions (or document ids)

# name: (schedule, other fields, packed rows); the chunked zbv with 2 chunks per worker (its turn on the
# last worker stays on that worker: nothing is cut or gathered there), recompute under the split backward
CELLS = {
    "gpipe": ("gpipe", {}, False),
    "1f1b": ("1f1b", {}, False),
    "zb_h1-recompute": ("zb_h1", {"activation_checkpoint": "always"}, False),
    "zbv": ("zbv", {"virtual_stages": 2}, False),
    "1f1b-packed": ("1f1b", {}, True),
}


def adamw(params) -> torch.optim.AdamW:
    """AdamW with an eps above the float noise of the smallest gradients (as the tensor-parallel
    matrix's: with the default 1e-8, reduction-order noise in a nearly cancelling gradient would
    become a visible step)."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-3)


def config_of(schedule: str, fields: dict, tensor_parallel: int = 2) -> raypipe.PipelineConfig:
    return raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES, schedule=schedule,
                                  tensor_parallel=tensor_parallel, sequence_parallel=False, clip_grad_norm=CLIP,
                                  snapshot_every=0, **fields)


def batches(packed: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three global batches of the tiny LLaMA; packed: rows of several documents (positions restarting
    at each, no target crossing into the next)."""
    generator = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, TINY.vocab_size, (BATCH, SEQ_LEN + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        if packed:
            starts = torch.rand(BATCH, SEQ_LEN, generator=generator) < 0.3
            starts[:, 0] = True
            ids = starts.long().cumsum(dim=1) - 1
            first = torch.arange(SEQ_LEN).expand(BATCH, -1).masked_fill(~starts, 0).cummax(dim=1).values
            targets[:, :-1][ids[:, 1:] != ids[:, :-1]] = IGNORE_INDEX
            inputs = make_packed(inputs, torch.arange(SEQ_LEN) - first, ids)
        out.append((inputs, targets))
    return out


@functools.cache
def run(cell: str) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor], list[dict[tuple[int, int], int]]]:
    """A cell's run: each step's (loss, pre-clip norm), the final whole state, and each step's bytes sent
    by each (stage, tp_rank)."""
    schedule, fields, packed = CELLS[cell]
    with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, config_of(schedule, fields)) as pipeline:
        results = [pipeline.step(x, y) for x, y in batches(packed)]
        state = pipeline.state_dict()
    sent = [{(stats.stage, stats.tp_rank): stats.sent_bytes for stats in result.stages} for result in results]
    return [(result.loss, result.grad_norm) for result in results], state, sent


@functools.cache
def reference(packed: bool) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    model = nn.Sequential(*(build_layer(spec, index, raypipe.PipelineConfig().seed)
                            for index, spec in enumerate(llama_layers("tiny"))))
    optimizer = adamw(model.parameters())
    steps = [reference_step(model, optimizer, llama_loss, x, y, MICRO_BATCHES, CLIP) for x, y in batches(packed)]
    return steps, model.state_dict()


@pytest.mark.parametrize("cell", list(CELLS))
def test_boundary_slices_train_as_one_process(cell):
    steps, state, _ = run(cell)
    expected_steps, expected_state = reference(CELLS[cell][2])
    for (loss, norm), (expected_loss, expected_norm) in zip(steps, expected_steps, strict=True):
        assert loss == pytest.approx(expected_loss, rel=TOLERANCE)
        assert norm == pytest.approx(expected_norm, rel=TOLERANCE)
        assert norm > CLIP
    assert state.keys() == expected_state.keys()
    for key, expected in expected_state.items():
        assert float((state[key] - expected).norm()) <= TOLERANCE * float(expected.norm()), key


@pytest.mark.parametrize("cell", list(CELLS))
def test_each_rank_sends_its_slice_of_the_boundary(cell):
    """Each rank sends 1/t of a t = 1 worker's floating-point bytes, every step; a packed row's
    positions and document ids go whole, forward only (a tree's gradient is its floating-point
    leaves' alone: raypipe.comm.tree_messages.gradient_parts)."""
    schedule, _, packed = CELLS[cell]
    # the messages each worker sends per micro-batch: one (an activation or a gradient) across the one
    # boundary of 2 stages; zbv's V crosses between the workers twice (0 -> 1 and 2 -> 3) and turns on worker 1
    messages = 2 if schedule == "zbv" else 1
    whole = MICRO_BATCHES * messages * HIDDEN_BYTES  # a t = 1 worker's floating-point bytes a step
    indices = MICRO_BATCHES * 2 * INDEX_BYTES if packed else 0  # positions and document ids, whole
    expected = {(stage, tp_rank): whole // 2 + (indices if stage == 0 else 0) for stage in (0, 1)
                for tp_rank in (0, 1)}
    assert run(cell)[2] == [expected] * STEPS


def test_half_the_bytes_of_t1_measured():
    """t = 1 on the same stages sends the whole activation (and its gradient): twice a t = 2 rank's."""
    with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, config_of("1f1b", {}, tensor_parallel=1)) as pipeline:
        result = pipeline.step(*batches(False)[0])
    at_t1 = {stats.stage: stats.sent_bytes for stats in result.stages}
    assert at_t1 == {0: MICRO_BATCHES * HIDDEN_BYTES, 1: MICRO_BATCHES * HIDDEN_BYTES}
    assert run("1f1b")[2][0] == {(stage, tp_rank): at_t1[stage] // 2 for stage in (0, 1) for tp_rank in (0, 1)}


def test_a_sequence_the_boundary_cannot_slice_is_refused_by_name():
    """Without sequence parallelism only a stage boundary slices the sequence, so its length must
    divide by t where there is one: the trainer checks a batch before the step (a packed batch's
    sequence is its last dimension), and a worker the activation it would send (data that reaches
    the stages another way): the step fails by name instead of hanging in a gather of uneven slices."""
    from raypipe.control.steps import check_sequence_length

    ids = torch.zeros(2, 7, dtype=torch.long)
    for inputs in (ids, make_packed(ids, ids, ids)):
        with pytest.raises(ConfigError) as error:
            check_sequence_length(inputs, 2, sequence_parallel=False)
        assert str(error.value).splitlines()[0].startswith("invalid tensor_parallel=2: without sequence parallelism")
    check_sequence_length(torch.zeros(2, 8, dtype=torch.long), 2, sequence_parallel=False)
    config = config_of("1f1b", {})
    with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, config) as pipeline:
        tokens = torch.randint(0, TINY.vocab_size, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
        with pytest.raises(RuntimeError) as error:
            pipeline.step(tokens[:, :-1], tokens[:, 1:])
    stage_0_rank_0 = str(error.value).split("worker 1 (")[0]  # the first worker's failure
    assert ("ConfigError: invalid tensor_parallel=2: each tensor-parallel rank sends its 1/2 of a stage boundary's "
            "activation" in stage_0_rank_0)
