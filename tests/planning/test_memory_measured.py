"""The memory model predicts what each stage measures it holds for backward (tiny LLaMA, CPU)."""
import pytest
import torch

import raypipe
from raypipe.config import PipelineConfig
from raypipe.core.partition import stage_layer_ranges
from raypipe.models.llama import get_config, llama_layers, llama_loss
from raypipe.models.llama_memory import activation_breakdown
from raypipe.planning.memory import estimate_stage
from raypipe.stage import worker
from raypipe.stage.precision import ModuleWeights
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.worker import StageWorker
from tests.reference import in_process

TINY = get_config("tiny")
MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ_LEN = 4, 2, 64
# (activation_checkpoint, offload_activations, precision): measured by the stage workers of a step through
# the step runner in one process (offload's kept inputs in the driver's object store: Ray's, as a worker's;
# offload on Ray's workers is tests/stage/test_recompute.py's); checkpointing without offload is measured
# by the stage's meter alone below, for each mode in fp32 and bf16
MODES = [("never", False, "fp32"), ("always", True, "fp32"), ("except_last", True, "fp32"), ("always", True, "bf16")]


def mode_id(mode):
    return f"{mode[0]}{'-offload' if mode[1] else ''}-{mode[2]}"


def _measured_config(activation_checkpoint, offload_activations, precision):
    return raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES,
                                  activation_checkpoint=activation_checkpoint,
                                  offload_activations=offload_activations, precision=precision)


def _tokens():
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, TINY.vocab_size, (MICRO_BATCHES * MICRO_BATCH_SIZE, SEQ_LEN + 1), generator=generator)


def measure(activation_checkpoint, offload_activations, precision):
    """One step's result through the step runner in one process, the balance, and the tensor bytes of
    each worker's snapshot after it (its host copy: what a worker's snapshot task ships)."""
    tokens = _tokens()
    with in_process(llama_layers(TINY), llama_loss, lambda p: torch.optim.AdamW(p),
                    _measured_config(activation_checkpoint, offload_activations, precision)) as trainer:
        result = trainer.step(tokens[:, :-1], tokens[:, 1:])  # the optimizer state exists from the first step
        workers = trainer.pipeline.workers
        return result, [len(worker.layer_indices) for worker in workers], [
            _tensor_bytes(worker.host_snapshot().wait()) for worker in workers]


@pytest.fixture(scope="module")
def measurements(ray_cluster):  # ray_cluster: offload's object store
    return {mode: measure(*mode) for mode in MODES}


def predict(layers, stage, activation_checkpoint="never", offload_activations=False, precision="fp32",
            micro_batches=MICRO_BATCHES, micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN, amp=None):
    return estimate_stage(TINY, layers, num_micro_batches=micro_batches, micro_batch_size=micro_batch_size,
                          seq_len=seq_len, activation_checkpoint=activation_checkpoint,
                          offload_activations=offload_activations, precision=precision, stage_index=stage,
                          num_stages=2, device="cpu", amp=amp)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_predicted_held_bytes_match_measurement(measurements, mode):
    result, balance, _ = measurements[mode]
    for stage, layers in enumerate(stage_layer_ranges(balance)):
        predicted = predict(layers, stage, *mode)
        measured = result.stages[stage]
        assert measured.held_for_backward_bytes == pytest.approx(predicted.held_for_backward_bytes, rel=0.10)
        assert measured.offloaded_bytes == pytest.approx(predicted.offloaded_bytes, rel=0.10, abs=0)


def test_checkpointing_holds_inputs_plus_one_micro_batch(measurements):
    """never: m graphs; always: m kept inputs + one micro-batch rebuilt (both measured by the stage's
    meter without Ray, GPipe as the trainer's default); offload: about one micro-batch (in a trainer)."""
    never = run_stages(MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ_LEN, activation_checkpoint="never")
    always = run_stages(MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ_LEN, activation_checkpoint="always")
    for stage, layers in enumerate(RANGES):
        memory = predict(layers, stage)
        one_graph, one_input = memory.graph_bytes, memory.input_bytes
        assert never[stage] == pytest.approx(MICRO_BATCHES * one_graph, rel=0.10)
        assert always[stage] == pytest.approx(MICRO_BATCHES * one_input + one_graph - one_input, rel=0.10)
    offloaded, balance, _ = measurements[("always", True, "fp32")]
    for stage, layers in enumerate(stage_layer_ranges(balance)):
        memory = predict(layers, stage)
        assert offloaded.stages[stage].held_for_backward_bytes == pytest.approx(memory.graph_bytes, rel=0.10)
        assert offloaded.stages[stage].offloaded_bytes == MICRO_BATCHES * memory.input_bytes


# -- the stage's own meter, no Ray -----------------------------------------------------------

RANGES = [range(3), range(3, 6)]  # embedding + 2 blocks | 2 blocks + head


def run_stages(micro_batches, batch, seq_len, autocast_fp32_weights=False, **config):
    """One GPipe step of the tiny LLaMA on two StageWorkers; each stage's held-for-backward peak.

    ``autocast_fp32_weights``: compute with the fp32 parameters under autocast (how bf16 ran
    before it had bf16 compute weights), for comparison.
    """
    layers = llama_layers(TINY)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 259, (batch, seq_len), generator=generator) for _ in range(micro_batches)]
    targets = [torch.randint(0, 259, (batch, seq_len), generator=generator) for _ in range(micro_batches)]
    config = PipelineConfig(num_stages=2, num_micro_batches=micro_batches, **config)
    with pytest.MonkeyPatch.context() as patch:
        if autocast_fp32_weights:
            patch.setattr(worker, "compute_weights", lambda *args: ModuleWeights())
        stages = [StageWorker(WorkerSpec(i, 2, tuple(layers[j] for j in r), tuple(r), config,
                                         optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=llama_loss))
                  for i, r in enumerate(RANGES)]
    for mb in range(micro_batches):
        stages[1].forward(mb, stages[0].forward(mb, inputs[mb]), targets[mb], 1 / micro_batches)
    for mb in reversed(range(micro_batches)):
        stages[0].backward(mb, stages[1].backward(mb))
    stats = [stage.finish_backward() for stage in stages]
    return [stage.commit(False, *stats).stats.held_for_backward_bytes for stage in stages]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_stage_worker_measurement_matches_prediction(precision, mode):
    """The stage's own meter (StageWorker, no Ray) against the model, GPipe, 2 stages."""
    shape = {"micro_batches": 3, "micro_batch_size": 2, "seq_len": 24}
    measured = run_stages(3, 2, 24, activation_checkpoint=mode, precision=precision)
    for stage, layers in enumerate(RANGES):
        predicted = predict(layers, stage, mode, precision=precision, **shape)
        assert measured[stage] == pytest.approx(predicted.held_for_backward_bytes, rel=0.10)


def test_bf16_micro_batches_share_one_weight_copy():
    """bf16, GPipe, m = 4, no recompute: each kept micro-batch holds its activations and no copy
    of the stage's weights; autocast on fp32 weights held one per micro-batch."""
    micro_batches, batch, seq_len = 4, 2, 24
    shape = {"micro_batches": micro_batches, "micro_batch_size": batch, "seq_len": seq_len}
    bf16 = run_stages(micro_batches, batch, seq_len, precision="bf16")
    autocast = run_stages(micro_batches, batch, seq_len, autocast_fp32_weights=True, precision="bf16")
    for stage, layers in enumerate(RANGES):
        predicted = predict(layers, stage, precision="bf16", **shape)
        assert bf16[stage] == pytest.approx(predicted.held_for_backward_bytes, rel=0.10)
        assert bf16[stage] == pytest.approx(micro_batches * predicted.graph_bytes, rel=0.10)
        # the old way, measured and modelled: every micro-batch saved its own 2-byte weight copies
        old = predict(layers, stage, precision="bf16", amp="autocast", **shape)
        assert autocast[stage] == pytest.approx(old.held_for_backward_bytes, rel=0.10)
        weight_copies = sum(size for index in layers for name, size in activation_breakdown(
            TINY, ["embedding", "block", "block", "block", "block", "head"][index], batch, seq_len, "bf16",
            amp="autocast").items() if "weight_copy" in name)
        assert weight_copies > 0
        assert autocast[stage] - bf16[stage] >= micro_batches * weight_copies


def _tensor_bytes(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def test_plan_predicts_the_bytes_of_each_workers_snapshot(measurements):
    """`raypipe plan`'s snapshot line: the tensors a worker's in-memory snapshot holds (bf16: fp32
    main weights and Adam moments) against the model, within 10%."""
    from raypipe.planning.plan import snapshot_bytes

    _, balance, measured = measurements[("always", True, "bf16")]
    for stage, layers in enumerate(stage_layer_ranges(balance)):
        predicted = snapshot_bytes(estimate_stage(TINY, list(layers), num_micro_batches=MICRO_BATCHES,
                                                  micro_batch_size=MICRO_BATCH_SIZE, seq_len=SEQ_LEN,
                                                  precision="bf16", optimizer="adamw"))
        assert measured[stage] == pytest.approx(predicted, rel=0.10), (stage, measured[stage], predicted)


@pytest.mark.parametrize("mode, segments", [("never", None), ("always", None), ("except_last", None),
                                            ("always", 2)])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_interpreted_schedule_holds_what_the_model_predicts(schedule, mode, segments):
    """Each worker's meter in a whole interpreted step (the lowered ops, no Ray) against the model's
    walk of the schedule: a split backward keeps a micro-batch's graph (rebuilt, where it was
    recomputed) from its I until its W."""
    from raypipe.testing.op_interpreter import OpInterpreter

    micro_batches, batch, seq_len = 4, 2, 24
    config = PipelineConfig(num_stages=2, num_micro_batches=micro_batches, schedule=schedule,
                            activation_checkpoint=mode, activation_checkpoint_segments=segments)
    pipeline = OpInterpreter(llama_layers(TINY), llama_loss, lambda p: torch.optim.SGD(p, lr=0.1), config)
    tokens = torch.randint(0, TINY.vocab_size, (micro_batches * batch, seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    pipeline.step(0, tokens[:, :-1], tokens[:, 1:])
    for stage, layers in enumerate(RANGES):
        assert list(pipeline.workers[stage].layer_indices) == list(layers)
        predicted = estimate_stage(TINY, list(layers), num_micro_batches=micro_batches, micro_batch_size=batch,
                                   seq_len=seq_len, activation_checkpoint=mode,
                                   activation_checkpoint_segments=segments, schedule=schedule,
                                   stage_index=stage, num_stages=2, device="cpu")
        measured = pipeline.reports[stage].stats.held_for_backward_bytes
        assert measured == pytest.approx(predicted.held_for_backward_bytes, rel=0.10), (stage, measured, predicted)


@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_interpreted_chunked_schedule_holds_what_the_model_predicts(schedule, mode):
    """Two chunks a worker (the tiny LLaMA's 6 layers as 4 virtual stages, [2, 1, 1, 2]): each worker's
    meter against the model's walk, every op keeping and freeing its own chunk's graph or input."""
    from raypipe.core.partition import worker_chunks
    from raypipe.testing.op_interpreter import OpInterpreter

    micro_batches, batch, seq_len, balance = 4, 2, 24, [2, 1, 1, 2]
    config = PipelineConfig(num_stages=2, num_micro_batches=micro_batches, schedule=schedule, virtual_stages=2,
                            activation_checkpoint=mode, balance=balance)
    pipeline = OpInterpreter(llama_layers(TINY), llama_loss, lambda p: torch.optim.SGD(p, lr=0.1), config)
    tokens = torch.randint(0, TINY.vocab_size, (micro_batches * batch, seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    pipeline.step(0, tokens[:, :-1], tokens[:, 1:])
    for stage, chunks in enumerate(worker_chunks(balance, 2, config.placement)):
        layers = [index for chunk in chunks for index in chunk]
        assert list(pipeline.workers[stage].layer_indices) == layers
        predicted = estimate_stage(TINY, layers, num_micro_batches=micro_batches, micro_batch_size=batch,
                                   seq_len=seq_len, activation_checkpoint=mode, schedule=schedule,
                                   stage_index=stage, num_stages=2, device="cpu",
                                   chunk_sizes=[len(chunk) for chunk in chunks])
        measured = pipeline.reports[stage].stats.held_for_backward_bytes
        assert measured == pytest.approx(predicted.held_for_backward_bytes, rel=0.10), (stage, measured, predicted)
