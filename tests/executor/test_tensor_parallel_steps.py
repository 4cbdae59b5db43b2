"""Tensor parallelism inside a stage (PP x TP x DP): each stage's ``t`` workers split the
LLaMA's planned layers over their tensor-parallel group, and the run trains as one process.

The reference is this process: the same layers (the per-layer seeding builds the same initial
weights), unsplit, fp32, gradient accumulation over the global batch (tests/reference.py's
loop). Tensor parallelism changes the order of reductions, so each step's loss and pre-clip
gradient norm are compared within 1e-5 relative, and every parameter tensor after the steps
within 1e-5 relative in norm, not bitwise. The LLaMA tiny preset is dropout-free; clipping bites.

The matrix runs through :class:`tests.gloo_pipeline.GlooPipeline`: the Ray actors' class
(the per-step worker: the step runner over the p2p channel) in forked processes joined in real
gloo groups, no Ray (DTensor needs a process group per rank, so the threads of the in-process
harness cannot run it). A real-Ray subset of five cells (the trainer, the driver's calls, the
evaluation; one also saves a checkpoint, which the same layout in processes continues bitwise)
runs on the session's Ray instance (6 logical CPUs: up to 2 replicas x 1 stage or 1 replica x 2
stages at t = 2), plus 2 x 2 x 2 on a cluster of its own, marked ``cluster``: six in all. Three
steps each.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest
import ray
import torch
from torch import nn

import raypipe
from raypipe import ConfigError
from raypipe.models.layers import build_layer
from raypipe.models.llama import get_config, llama_layers, llama_loss
from tests.gloo_pipeline import GlooPipeline
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

# (replicas, stages, schedule, sequence_parallel, other fields): the real-Ray subset
CELLS = [(1, 1, "gpipe", True, {}), (1, 1, "1f1b", False, {}),
         (1, 2, "zbv", False, {"activation_checkpoint": "always"}), (1, 2, "1f1b", True, {}),
         (2, 1, "1f1b", True, {"shard_optimizer": True})]
# the cell whose trainer also saves before its last step, loaded outside Ray (the checkpoint's test there)
SAVING_CELL = (1, 2, "1f1b", True, {})


def _config(replicas: int, stages: int, schedule: str, sequence_parallel: bool) -> raypipe.PipelineConfig:
    return raypipe.PipelineConfig(num_stages=stages, num_micro_batches=2, num_replicas=replicas, schedule=schedule,
                                  tensor_parallel=2, sequence_parallel=sequence_parallel, clip_grad_norm=CLIP,
                                  snapshot_every=0)


def _cell_config(replicas: int, stages: int, schedule: str, sequence_parallel: bool,
                 fields: dict) -> raypipe.PipelineConfig:
    """A cell's config: the chunked schedules with 2 chunks per worker."""
    config = _config(replicas, stages, schedule, sequence_parallel).replace(**fields)
    return config.replace(virtual_stages=2) if schedule in ("interleaved_1f1b", "zbv") else config


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 259, (BATCH, SEQ_LEN + 1), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _reference(config: raypipe.PipelineConfig) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor], float]:
    """Each step's (loss, pre-clip norm), the final state, and the first batch's loss after the
    steps, of one process on the same batches."""
    return _reference_of(config.num_micro_batches * config.max_replicas, config.clip_grad_norm, config.seed)


@functools.cache
def _reference_of(count: int, clip: float, seed: int) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor],
                                                                float]:
    """:func:`_reference` of a step split into ``count`` micro-batches (computed once: the cells share it), on
    one thread, as a stage computes (cpus_per_stage=1): the suite's processes share their cores, and a
    second thread that waits for one makes this step tens of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = nn.Sequential(*(build_layer(spec, index, seed) for index, spec in enumerate(llama_layers("tiny"))))
        optimizer = adamw(model.parameters())
        steps = [reference_step(model, optimizer, llama_loss, x, y, count, clip) for x, y in _batches()]
        with torch.no_grad():
            evaluated = float(llama_loss(model(_batches()[0][0]), _batches()[0][1]))
        return steps, model.state_dict(), evaluated
    finally:
        torch.set_num_threads(threads)


def run_cell(config: raypipe.PipelineConfig, checkpoint_root=None) -> tuple[list[tuple[float, float]],
                                                                           dict[str, torch.Tensor], float]:
    """Each step's (loss, pre-clip norm), the final whole state and the first batch's evaluated
    loss after the steps, of a Ray trainer; with ``checkpoint_root``, its checkpoint saved there
    before the last step (a save changes nothing)."""
    before = set(ray.util.placement_group_table())
    trainer = raypipe.PipelineTrainer(llama_layers("tiny"), llama_loss, adamw, config)
    try:
        # one bundle per stage holding its t workers (a bundle never spans nodes), one group per replica
        created = [group for key, group in ray.util.placement_group_table().items()
                   if key not in before and group["state"] == "CREATED"]
        assert len(created) == config.num_replicas, created
        bundle = {"CPU": float(2 * config.cpus_per_stage), **({"GPU": 2.0} if config.use_gpu else {})}
        for group in created:
            assert list(group["bundles"].values()) == [bundle] * config.num_stages
        steps = []
        for step, (x, y) in enumerate(_batches()):
            if checkpoint_root is not None and step == STEPS - 1:
                trainer.save_checkpoint(str(checkpoint_root))
            result = trainer.step(x, y)
            steps.append((result.loss, result.grad_norm))
        return steps, trainer.state_dict(), trainer.evaluate(*_batches()[0])
    finally:
        trainer.shutdown()


def run_cell_in_processes(config: raypipe.PipelineConfig) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor],
                                                                   None]:
    """:func:`run_cell` through :class:`GlooPipeline` (no evaluation: that is the driver's)."""
    with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, config) as pipeline:
        steps = []
        for x, y in _batches():
            result = pipeline.step(x, y)
            steps.append((result.loss, result.grad_norm))
        return steps, pipeline.state_dict(), None


def _assert_matches_one_process(config, steps, state, evaluated, tolerance: float = TOLERANCE) -> None:
    expected_steps, expected_state, expected_evaluated = _reference(config)
    if evaluated is not None:
        assert evaluated == pytest.approx(expected_evaluated, rel=tolerance)
    for (loss, norm), (expected_loss, expected_norm) in zip(steps, expected_steps, strict=True):
        assert loss == pytest.approx(expected_loss, rel=tolerance)
        assert norm == pytest.approx(expected_norm, rel=tolerance)
        assert norm > CLIP  # the clip bites
    assert state.keys() == expected_state.keys()
    for key, expected in expected_state.items():
        assert state[key].shape == expected.shape, key
        assert float((state[key].cpu() - expected).norm()) <= tolerance * float(expected.norm()), key


def _cell_id(replicas, stages, schedule, sequence_parallel, fields) -> str:
    named = "".join(f"-{key}={value}" for key, value in fields.items())
    return f"d{replicas}-p{stages}-t2-{schedule}-{'sp' if sequence_parallel else 'nosp'}{named}"


@pytest.mark.parametrize("replicas, stages, schedule, sequence_parallel, fields", CELLS,
                         ids=[_cell_id(*cell) for cell in CELLS])
def test_tensor_parallel_steps_equal_one_process(ray_cluster, tmp_path, replicas, stages, schedule,
                                                 sequence_parallel, fields):
    config = _cell_config(replicas, stages, schedule, sequence_parallel, fields)
    saves = (replicas, stages, schedule, sequence_parallel, fields) == SAVING_CELL
    steps, state, evaluated = run_cell(config, tmp_path if saves else None)
    _assert_matches_one_process(config, steps, state, evaluated)
    if saves:
        _assert_a_checkpoint_saved_on_ray_continues_bitwise_where_it_is_loaded(config, tmp_path, steps[-1], state)


# (replicas, stages): the layouts at t = 2, each with gpipe and 1f1b, sequence parallelism on for
# one and off for the other (both ways round over the layouts). A cell costs seconds of gloo collectives
# between 2-8 processes on the suite's 2 cores, so the matrix covers each pair of factors, not their product.
LAYOUTS = [(1, 1), (1, 2), (2, 2), (1, 3)]
MATRIX = [(d, p, schedule, (schedule == "gpipe") == (index % 2 == 0)) for index, (d, p) in enumerate(LAYOUTS)
          for schedule in ("gpipe", "1f1b")]
# the matrix's cells that the real-Ray subset (CELLS) runs, with the same assertions and the evaluation, run
# there only; but (1, 2, 1f1b, sp), whose run in processes the tests after it read too (one_by_two)
ON_RAY_ONLY = [cell for cell in MATRIX if (*cell, {}) in CELLS and cell != (1, 2, "1f1b", True)]
IN_PROCESSES = [cell for cell in MATRIX if cell not in ON_RAY_ONLY]


@pytest.fixture(scope="module")
def one_by_two(tmp_path_factory) -> dict:
    """The (1, 2, 2) run of 1f1b under sequence parallelism in processes, read by the tests that need it
    (its matrix cell, the boundary's bytes, the checkpoint's layouts): each step's result, its checkpoint
    saved after 2 steps (a save changes nothing) and the whole state after the steps."""
    root = tmp_path_factory.mktemp("one_by_two")
    with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, _config(1, 2, "1f1b", True)) as pipeline:
        results = []
        for step, (x, y) in enumerate(_batches()):
            if step == 2:
                assert pipeline.save_checkpoint(root) == 2
            results.append(pipeline.step(x, y))
        return {"results": results, "checkpoint": root, "state": pipeline.state_dict()}


@pytest.mark.parametrize("replicas, stages, schedule, sequence_parallel", IN_PROCESSES,
                         ids=[f"d{d}-p{p}-t2-{s}-{'sp' if sp else 'nosp'}" for d, p, s, sp in IN_PROCESSES])
def test_tensor_parallel_steps_in_processes_equal_one_process(request, replicas, stages, schedule,
                                                              sequence_parallel):
    config = _config(replicas, stages, schedule, sequence_parallel)
    if config == _config(1, 2, "1f1b", True):
        run = request.getfixturevalue("one_by_two")
        steps = [(result.loss, result.grad_norm) for result in run["results"]]
        _assert_matches_one_process(config, steps, run["state"], None)
    else:
        _assert_matches_one_process(config, *run_cell_in_processes(config))


# the other schedules (the chunked ones with 2 chunks per worker), recompute and ZeRO-1: each schedule on
# 2 and 3 stages (zb_h1 on 2 replicas of 2 too, with ZeRO-1), recompute and sequence parallelism alternating
# over them (ZeRO-1 at d = 2 x p = 1 and zbv with recompute on Ray: CELLS above):
# (replicas, stages, schedule, sequence_parallel, other fields)
OTHER_CELLS = [
    (1, 2, "zb_h1", True, {}), (2, 2, "zb_h1", False, {"activation_checkpoint": "always", "shard_optimizer": True}),
    (1, 3, "zb_h1", True, {"activation_checkpoint": "always"}),
    (1, 2, "interleaved_1f1b", False, {"activation_checkpoint": "always"}), (1, 3, "interleaved_1f1b", True, {}),
    (1, 2, "zbv", True, {}), (1, 3, "zbv", False, {"activation_checkpoint": "always"}),
    (1, 2, "gpipe", False, {"activation_checkpoint": "except_last"}),
    (1, 2, "1f1b", True, {"activation_checkpoint_segments": 2}),
]


@pytest.mark.parametrize("replicas, stages, schedule, sequence_parallel, fields", OTHER_CELLS,
                         ids=[_cell_id(*cell) for cell in OTHER_CELLS])
def test_every_schedule_recompute_and_zero1_at_t2_equal_one_process(replicas, stages, schedule, sequence_parallel,
                                                                    fields):
    config = _cell_config(replicas, stages, schedule, sequence_parallel, fields)
    _assert_matches_one_process(config, *run_cell_in_processes(config))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_at_t2_stays_close_to_fp32(precision):
    """bf16 (fp32 main weights) and fp16 (the global loss scale) at t = 2: their usual tolerances
    against fp32 one process (tests/stage/test_precision.py's: losses within 1%, norms within 2%),
    and the main weights stay fp32."""
    config = _config(1, 2, "1f1b", True).replace(precision=precision)
    with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, config) as pipeline:
        results = [pipeline.step(x, y) for x, y in _batches()]
        state = pipeline.state_dict()
    expected_steps, expected_state, _ = _reference(config)
    losses = [result.loss for result in results]
    assert max(abs(low - full) / full for low, (full, _) in zip(losses, expected_steps)) > 1e-6  # it ran low
    for result, (loss, norm) in zip(results, expected_steps, strict=True):
        assert not result.skipped and result.loss == pytest.approx(loss, rel=0.01)
        assert result.grad_norm == pytest.approx(norm, rel=0.02)
        assert (result.loss_scale is not None) == (precision == "fp16")
    assert {value.dtype for value in state.values()} == {torch.float32} and state.keys() == expected_state.keys()


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
    ({"transport": "object_store"}, "transport"),
])
def test_what_tensor_parallelism_does_not_run_yet_is_refused_by_name(change, field):
    config = raypipe.PipelineConfig(tensor_parallel=2).replace(**change)
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


@pytest.mark.parametrize("schedule, sequence_parallel", [("1f1b", True)])
def test_a_models_own_plan_and_a_replicated_layer_train_as_one_process(schedule, sequence_parallel):
    """Not the LLaMA: a model of its own (tests/models/test_tensor_parallel.py's: a replicated input
    projection, MLPs with their own plan, a replicated layer that mixes positions, a replicated head)
    over 2 stages at t = 2, its plan a function of sequence parallelism; under sequence parallelism the
    replicated layers see the whole sequence (gathered before them), so they train as one process."""
    from tests.models.test_tensor_parallel import BYO_DIM, byo_stage, mlp_plan

    layers = [spec for _, spec in byo_stage(mlp_plan)]
    config = _config(1, 2, schedule, sequence_parallel).replace(balance=[2, 3])
    generator = torch.Generator().manual_seed(6)
    batches = [(torch.randn(BATCH, SEQ_LEN, BYO_DIM, generator=generator),
                torch.randn(BATCH, SEQ_LEN, 3, generator=generator)) for _ in range(STEPS)]
    with GlooPipeline(layers, nn.functional.mse_loss, adamw, config) as pipeline:
        results = [pipeline.step(x, y) for x, y in batches]
        state = pipeline.state_dict()
    model = nn.Sequential(*(build_layer(spec, index, config.seed) for index, spec in enumerate(layers)))
    optimizer = adamw(model.parameters())
    expected = [reference_step(model, optimizer, nn.functional.mse_loss, x, y, config.num_micro_batches, CLIP)
                for x, y in batches]
    for result, (loss, norm) in zip(results, expected, strict=True):
        assert result.loss == pytest.approx(loss, rel=TOLERANCE)
        assert result.grad_norm == pytest.approx(norm, rel=TOLERANCE)
    assert state.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert float((state[key] - value).norm()) <= TOLERANCE * float(value.norm()), key


def test_each_tensor_parallel_rank_sends_its_shard_of_the_boundary_and_reports_as_itself(one_by_two):
    """Sequence parallelism: each of a stage's t = 2 ranks sends half the floating-point bytes a
    t = 1 worker sends across the boundary (activations and gradients: the LLaMA's boundary is one
    fp32 tensor), measured by the channel; every worker's stats and timeline carry its tp_rank. (t = 2:
    the first step of the shared (1, 2, 2) run.)"""
    sent = {}
    for t in (1, 2):
        if t == 1:
            config = _config(1, 2, "1f1b", False).replace(tensor_parallel=1)
            with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, config) as pipeline:
                result = pipeline.step(*_batches()[0])
        else:
            result = one_by_two["results"][0]
        sent[t] = {(stats.stage, stats.tp_rank): stats.sent_bytes for stats in result.stages}
        assert {(event.stage, event.tp_rank) for event in result.timeline} == set(sent[t])
    # a step of 2 micro-batches of (4 / 2 rows x 8 positions x the tiny preset's width) fp32 each way
    whole = 2 * (BATCH // 2) * SEQ_LEN * get_config("tiny").dim * 4
    assert sent[1] == {(0, 0): whole, (1, 0): whole}
    assert sent[2] == {(stage, tp_rank): whole // 2 for stage in (0, 1) for tp_rank in (0, 1)}


# On GPUs, over NCCL: a stage's 2 workers on one node's 2 GPUs (and 2 stages on 4). The reference
# is the CPU's one process: CUDA's fp32 kernels sum in other orders, so within 1e-4, not 1e-5.
GPU_TOLERANCE = 1e-4


@pytest.mark.gpu
@pytest.mark.gpus2
def test_a_stage_split_over_two_gpus_trains_as_one_process(ray_cluster):
    config = _config(1, 1, "1f1b", True).replace(use_gpu=True)
    _assert_matches_one_process(config, *run_cell(config), tolerance=GPU_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.gpus4
def test_two_stages_each_split_over_two_gpus_train_as_one_process(ray_cluster):
    config = _config(1, 2, "zb_h1", True).replace(use_gpu=True)
    _assert_matches_one_process(config, *run_cell(config), tolerance=GPU_TOLERANCE)


def test_a_checkpoint_at_t2_holds_whole_layers_and_loads_into_other_layouts(one_by_two):
    """A (1, 2, 2) run's checkpoint after 2 steps (the shared run's): each layer's file holds whole
    tensors (a stage's ranks gather, tp_rank 0 writes); loaded into (1, 1, 2) and into one process's
    layout of 4 stages (t = 1, in-process), its next step equals one process's within 1e-5 (loaded into
    its own layout it continues bitwise: the Ray cell that saves, SAVING_CELL). AdamW's moments carry
    over (a lost part would restart them and miss the reference)."""
    from raypipe.checkpoint.store import read_layer
    from tests.reference import InterpretedTrainer

    config = _config(1, 2, "1f1b", True)
    batches, tmp_path = _batches(), one_by_two["checkpoint"]
    expected_steps, expected_state, _ = _reference(config)
    for key, expected in expected_state.items():  # whole tensors, the moments too
        index, name = key.split(".", 1)
        saved = read_layer(str(tmp_path), 2, int(index))
        assert saved["model"][name].shape == expected.shape, key
        if name in saved["optimizer"]:
            assert saved["optimizer"][name]["exp_avg"].shape == expected.shape, key
    for other in (_config(1, 1, "1f1b", True), raypipe.PipelineConfig(num_stages=4, num_micro_batches=2,
                                                                      clip_grad_norm=CLIP, snapshot_every=0)):
        if other.tensor_parallel > 1:
            with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, other) as pipeline:
                pipeline.load_checkpoint(tmp_path, 2)
                result, state = pipeline.step(*batches[2]), pipeline.state_dict()
        else:
            trainer = InterpretedTrainer(llama_layers("tiny"), llama_loss, adamw, other)
            trainer.load_checkpoint(tmp_path, 2)
            result, state = trainer.step(*batches[2]), trainer.state_dict()
        assert result.loss == pytest.approx(expected_steps[2][0], rel=TOLERANCE)
        assert result.grad_norm == pytest.approx(expected_steps[2][1], rel=TOLERANCE)
        for key, expected in expected_state.items():
            assert float((state[key] - expected).norm()) <= TOLERANCE * float(expected.norm()), key


def _assert_a_checkpoint_saved_on_ray_continues_bitwise_where_it_is_loaded(config, root, last_step, state) -> None:
    """The trainer's save on Ray at (1, 2, 2) before its last step (:data:`SAVING_CELL`), its files
    layout-free: loaded into the same layout of per-step workers (tests/gloo_pipeline.py), the next
    step is bitwise the Ray run's ``last_step`` (loss, pre-clip norm) and ``state`` after it."""
    with GlooPipeline(llama_layers("tiny"), llama_loss, adamw, config) as pipeline:
        pipeline.load_checkpoint(root, STEPS - 1)
        resumed = pipeline.step(*_batches()[-1]), pipeline.state_dict()
    assert (resumed[0].loss, resumed[0].grad_norm) == last_step
    assert all(torch.equal(resumed[1][key], value) for key, value in state.items())
