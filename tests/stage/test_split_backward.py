"""The split backward (issue 42, item 3): I followed at once by W gives bitwise the
gradients of the whole backward B, on every stage of a tiny LLaMA and of an MLP, with
and without activation checkpointing, and a recomputed forward runs once. No Ray."""
import pytest
import torch
from torch import nn

import raypipe
from raypipe.models.llama import LlamaConfig, llama_layers, llama_loss
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.worker import StageWorker
from tests.reference import make_mlp

LLAMA = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16, dropout=0.1)
MODES = [{"activation_checkpoint": "never"}, {"activation_checkpoint": "always"},
         {"activation_checkpoint": "always", "activation_checkpoint_segments": 1}]
MICRO_BATCHES = 3


def llama_stages():
    layers = llama_layers(LLAMA)  # embedding, 2 blocks, head: stages [emb, block], [block], [head]
    return [(layers[:2], (0, 1)), (layers[2:3], (2,)), (layers[3:], (3,))], llama_loss


def mlp_stages():
    layers = list(make_mlp())
    return [(layers[:2], (0, 1)), (layers[2:5], (2, 3, 4)), (layers[5:], (5, 6))], nn.functional.mse_loss


def stage_inputs(model, stage, generator):
    """One micro-batch's stage input and (last stage) targets; gradients from the next stage."""
    if model == "llama":
        tokens = lambda: torch.randint(0, 64, (2, 16), generator=generator)  # noqa: E731
        hidden = torch.randn(2, 16, 32, generator=generator)
        return (tokens() if stage == 0 else hidden), tokens(), hidden
    hidden = torch.randn(3, 16, generator=generator)
    return (torch.randn(3, 8, generator=generator) if stage == 0 else hidden), torch.randn(3, 4, generator=generator), \
        hidden


def make_worker(model, stage, mode, precision="fp32", use_gpu=False):
    stages, loss_fn = llama_stages() if model == "llama" else mlp_stages()
    layers, indices = stages[stage]
    config = raypipe.PipelineConfig(num_stages=3, num_micro_batches=MICRO_BATCHES, seed=3, precision=precision,
                                    **mode)
    spec = WorkerSpec(stage, 3, tuple(layers), indices, config, loss_fn=loss_fn if stage == 2 else None,
                      use_gpu=use_gpu)
    return StageWorker(spec)


def run_backwards(worker, model, stage, split, loss_scale=1.0):
    """Forward every micro-batch, then backward them in reverse (split: I then W at once);
    the input gradients and the parameters' .grad."""
    generator = torch.Generator().manual_seed(stage)
    grads_in = []
    data = [stage_inputs(model, stage, generator) for _ in range(MICRO_BATCHES)]
    for micro_batch, (inputs, targets, _) in enumerate(data):
        worker.forward(micro_batch, inputs, targets if stage == 2 else None, 1.0 / MICRO_BATCHES, step=0)
    for micro_batch in reversed(range(MICRO_BATCHES)):
        grad_outputs = None if stage == 2 else data[micro_batch][2]  # the stage output's shape
        if split:
            grads_in.append(worker.backward_input(micro_batch, grad_outputs, loss_scale))
            worker.backward_weight(micro_batch)
        else:
            grads_in.append(worker.backward(micro_batch, grad_outputs, loss_scale))
    return grads_in, [worker.weights.gradient(p) for p in worker._trainable]


@pytest.mark.parametrize("model", ["llama", "mlp"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{v}" for v in m.values()))
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_input_then_weight_gradient_is_bitwise_the_whole_backward(model, mode, stage):
    whole = run_backwards(make_worker(model, stage, mode), model, stage, split=False)
    split = run_backwards(make_worker(model, stage, mode), model, stage, split=True)
    for (name, whole_gradients), split_gradients in zip((("input", whole[0]), ("weight", whole[1])), split):
        assert len(whole_gradients) == len(split_gradients)
        for index, (expected, actual) in enumerate(zip(whole_gradients, split_gradients)):
            if stage == 0 and name == "input":
                assert expected is None and actual is None  # the first stage sends no input gradient
                continue
            assert expected is not None and actual is not None, f"{name} gradient {index}"
            assert torch.equal(expected, actual), f"{name} gradient {index} differs"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_and_loss_scale_as_whole_backward(precision):
    mode = {"activation_checkpoint": "never"}
    whole = run_backwards(make_worker("llama", 2, mode, precision), "llama", 2, split=False, loss_scale=1024.0)
    split = run_backwards(make_worker("llama", 2, mode, precision), "llama", 2, split=True, loss_scale=1024.0)
    for expected, actual in zip(whole[0] + whole[1], split[0] + split[1]):
        assert torch.equal(expected, actual)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_input_then_weight_gradient_is_bitwise_the_whole_backward_on_a_gpu(precision, stage):
    mode = {"activation_checkpoint": "always"}
    whole = run_backwards(make_worker("llama", stage, mode, precision, use_gpu=True), "llama", stage, split=False)
    split = run_backwards(make_worker("llama", stage, mode, precision, use_gpu=True), "llama", stage, split=True)
    for expected, actual in zip(whole[0] + whole[1], split[0] + split[1]):
        assert expected.is_cuda and torch.equal(expected, actual)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_recomputed_forward_runs_once_under_the_split(stage, monkeypatch):
    worker = make_worker("mlp", stage, {"activation_checkpoint": "always"})
    calls = []
    run = worker._run
    monkeypatch.setattr(worker, "_run", lambda *args, **kwargs: calls.append(torch.is_grad_enabled())
                        or run(*args, **kwargs))
    run_backwards(worker, "mlp", stage, split=True)
    # one no-grad forward and one replay with grad per micro-batch: W replays nothing
    assert calls == [False] * MICRO_BATCHES + [True] * MICRO_BATCHES


def test_weight_gradient_waits_for_later_input_gradients():
    """W deferred behind later I's (ZB-H1's order) still gives the whole backward's gradients."""
    mode = {"activation_checkpoint": "never"}
    whole = run_backwards(make_worker("llama", 1, mode), "llama", 1, split=False)
    worker = make_worker("llama", 1, mode)
    generator = torch.Generator().manual_seed(1)
    data = [stage_inputs("llama", 1, generator) for _ in range(MICRO_BATCHES)]
    for micro_batch, (inputs, _, _) in enumerate(data):
        worker.forward(micro_batch, inputs, None, 1.0 / MICRO_BATCHES, step=0)
    input_gradients = [worker.backward_input(mb, data[mb][2]) for mb in reversed(range(MICRO_BATCHES))]
    for micro_batch in reversed(range(MICRO_BATCHES)):
        worker.backward_weight(micro_batch)
    assert all(torch.equal(a, b) for a, b in zip(whole[0], input_gradients))
    assert all(torch.equal(a, b) for a, b in zip(whole[1], [worker.weights.gradient(p) for p in worker._trainable]))


@pytest.mark.parametrize("stage", [0, 1])
def test_input_gradient_runs_only_the_input_path_and_weight_gradient_only_the_weight_path(stage, monkeypatch):
    """On timed layers (input path and weight path are separate autograd nodes) I runs each layer's
    input-gradient node once and no weight-gradient node, W the reverse: W does not redo the input
    path. The first stage has no input gradient: its W runs the whole backward."""
    from raypipe.testing import timed_layers

    layers = timed_layers.timed_model(2, forward_s=0.0, input_grad_s=1.0, weight_grad_s=2.0, width=4)
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=1)
    worker = StageWorker(WorkerSpec(stage, 2, tuple(layers), (0, 1), config,
                                    loss_fn=nn.functional.mse_loss if stage == 1 else None))
    slept = []
    monkeypatch.setattr(timed_layers, "_sleep", slept.append)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    worker.forward(0, x, y if stage == 1 else None, 1.0, step=0)
    slept.clear()
    worker.backward_input(0, None if stage == 1 else torch.randn(3, 4))
    assert slept == ([] if stage == 0 else [1.0, 1.0])
    slept.clear()
    worker.backward_weight(0)
    # the first stage's whole backward: its first layer's input needs no gradient
    assert sorted(slept) == ([1.0, 2.0, 2.0] if stage == 0 else [2.0, 2.0])


@pytest.mark.parametrize("metered", [True, False], ids=["metered", "recalled"])
def test_a_split_backward_under_the_meter_leaves_no_graph_behind(metered):
    """I retains the graph and W runs on it; the stage's meter packs what autograd saves. A saved output
    (tanh saves its result) packed as itself held its own node: a cycle through autograd's C++ graph that
    the garbage collector never frees, so every micro-batch's graph stayed (~125 MB a step on the tiny
    LLaMA). Packed detached, nothing is left once the micro-batch is done; nor on the steps that recall
    the metered bytes (no hooks: autograd saves an output without its node)."""
    import contextlib
    import gc

    from raypipe.stage.measure import SavedTensorMeter
    from raypipe.stage.split_backward import input_gradient

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4), torch.nn.Tanh())
    weights = list(net.parameters())

    def micro_batch() -> None:
        x = torch.randn(4, 8, requires_grad=True)
        with SavedTensorMeter(set()) if metered else contextlib.nullcontext():
            out = net(x).sum()
        _, pending = input_gradient(out, torch.ones(()), x, weights)
        pending.run()

    for _ in range(5):
        micro_batch()
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(50):
        micro_batch()
    gc.collect()
    assert len(gc.get_objects()) - before < 50  # ~22 objects a micro-batch before
