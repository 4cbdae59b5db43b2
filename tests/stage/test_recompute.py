"""Activation checkpointing and offload change memory, never the result."""
import pytest
import torch

import raypipe
from raypipe.models.llama import LlamaConfig, llama_layers, llama_loss
from tests.reference import in_process, on_ray

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=64, max_seq_len=32, dropout=0.1)
MODES = [  # the baseline, then every way a stage recomputes (except_last: alone, with offload)
    {"activation_checkpoint": "never"},
    {"activation_checkpoint": "always"},
    {"activation_checkpoint": "always", "activation_checkpoint_segments": 2},
    {"activation_checkpoint": "always", "offload_activations": True},
    {"activation_checkpoint": "except_last", "offload_activations": True},
]
# on Ray: recomputing whole stages with offload (a worker's kept inputs in Ray's object store), against the
# baseline of the same step runner in one process (each worker single-threaded, as a stage is: bit for bit
# the arithmetic of the Ray workers). What is recomputed, and how (whole stages, segments, all but the last
# micro-batch), is the stage worker's: the other modes through the same step runner in one process, with the
# same assertions (except_last's offload, there, into the driver's object store).
RAY_MODES = [MODES[3]]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def token_batches(steps=2, batch=6, seq=16):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 64, (batch, seq), generator=generator),
             torch.randint(0, 64, (batch, seq), generator=generator)) for _ in range(steps)]


_RUNS = {}


def train(mode, schedule="gpipe", trainer_of=on_ray):
    """The step results and final state of a run in ``mode`` (each mode run once per module, on Ray or
    in one process)."""
    key = (schedule, tuple(sorted(mode.items())), trainer_of)
    if key not in _RUNS:
        config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=3, schedule=schedule, seed=7, **mode)
        with trainer_of(llama_layers(CONFIG), llama_loss, adamw, config) as trainer:
            _RUNS[key] = [trainer.step(x, y) for x, y in token_batches()], trainer.state_dict()
    return _RUNS[key]


@pytest.fixture(scope="module")
def baseline():
    return train(MODES[0], trainer_of=in_process)


def _mode_id(mode):
    return "-".join(f"{k}={v}" for k, v in mode.items())


@pytest.mark.parametrize("mode", RAY_MODES, ids=_mode_id)
def test_checkpoint_modes_give_identical_parameters_with_dropout(ray_cluster, baseline, mode):
    assert_identical_to_baseline(train(mode), baseline)


@pytest.mark.parametrize("mode", [mode for mode in MODES[1:] if mode not in RAY_MODES], ids=_mode_id)
def test_checkpoint_modes_give_identical_parameters_with_dropout_in_process(request, baseline, mode):
    if mode.get("offload_activations"):
        request.getfixturevalue("ray_cluster")  # the offloader's object store: the driver's, in one process
    assert_identical_to_baseline(train(mode, trainer_of=in_process), baseline)


def assert_identical_to_baseline(run, baseline):
    results, state = run
    base_results, base_state = baseline
    assert [r.loss for r in results] == pytest.approx([r.loss for r in base_results], rel=1e-6)
    for key, value in base_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{key}: {m}")


def test_dropout_is_active_so_the_comparison_means_something(baseline):
    _, base_state = baseline
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=3, seed=7)  # same init, no dropout
    no_dropout = llama_layers(CONFIG.replace(dropout=0.0))
    with in_process(no_dropout, llama_loss, adamw, config) as trainer:
        for x, y in token_batches():
            trainer.step(x, y)
        other = trainer.state_dict()
    assert any(not torch.allclose(other[k], v) for k, v in base_state.items())


# the stage workers' measure, read from their step reports: in one process, but offload's on Ray
def test_held_bytes_shrink_with_checkpointing_and_offload(ray_cluster):
    held = {}
    for name, mode in {"never": MODES[0], "always": MODES[1], "offload": MODES[3]}.items():
        results, _ = train(mode, trainer_of=on_ray if mode in RAY_MODES else in_process)
        held[name] = results[-1].stages
    for stage in range(2):
        never = held["never"][stage].held_for_backward_bytes
        always = held["always"][stage].held_for_backward_bytes
        offload = held["offload"][stage]
        assert always < never / 2, (stage, always, never)
        assert offload.held_for_backward_bytes < always
        assert offload.offloaded_bytes > 0 and held["always"][stage].offloaded_bytes == 0
