"""The memory model at t = 2 against what a tensor-parallel rank holds (tiny LLaMA, CPU, gloo).

Two processes (forked once for the module, tests/gloo_ranks.py) each build the whole tiny LLaMA as one stage, split
every layer with its plan (:func:`~raypipe.models.tensor_parallel.parallelize_layer`, the LLaMA's
``llama_tp_plan``) over a 1-D mesh of 2, and run one micro-batch's forward, loss (vocabulary
parallel) and backward, with and without sequence parallelism. Each rank reports the bytes of
its local parameter and gradient shards, and what autograd saves (distinct storages of the local
tensors, parameters excluded, as raypipe's stage meter counts) in each layer and for the whole
stage. Rank 0 holds the larger piece of the uneven vocabulary (259 = 130 + 129): the model's
figure is that rank's.

This measures one stage's layers directly, not through the trainer (which runs t = 1 only yet).
"""
from __future__ import annotations


import pytest
import torch
from torch.distributed.tensor import DTensor

from raypipe.models.layers import build_layer
from raypipe.models.llama import get_config, llama_layers, llama_loss
from raypipe.models.llama_memory import (estimate_layer_activation_bytes, layer_gradient_counts, layer_kinds,
                                         layer_parameter_counts)
from raypipe.models.tensor_parallel import loss_parallel_scope, parallelize_layer, redistribute_gradients
from raypipe.planning.memory import estimate_stage
from tests.gloo_ranks import on_gloo_ranks

TP, SEED = 2, 0
TINY = get_config("tiny")
BATCH, SEQ_LEN = 2, 64


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``tensor``'s data: a wrapper subclass's (a DTensor's local shard, a
    collective's pending result, whose own storage cannot be read) are its inner tensors', which
    its ``__tensor_flatten__`` names."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in names]
        return [storage for part in inner if isinstance(part, torch.Tensor) for storage in storages(part)]
    return [tensor.untyped_storage()]


class LocalSavedBytes:
    """Bytes of the distinct local storages autograd saves inside the context, parameters excluded."""

    def __init__(self, parameters: set[int]) -> None:
        self.parameters, self.seen = parameters, {}  # storage pointer: bytes
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for storage in storages(tensor):
            if storage.data_ptr() not in self.parameters:
                self.seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def measure(mesh, sequence_parallel: bool) -> dict:
    specs = llama_layers(TINY)
    layers = [parallelize_layer(build_layer(spec, index, SEED), spec.tp_plan, mesh,
                                sequence_parallel=sequence_parallel, final_layer=index == len(specs) - 1)
              for index, spec in enumerate(specs)]
    parameters = {storage.data_ptr() for layer in layers for p in layer.parameters() for storage in storages(p)}
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY.vocab_size, (BATCH, SEQ_LEN + 1), generator=generator)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()  # each its own storage, as a micro-batch's
    saved = []  # per layer, then the loss: {storage pointer: bytes}
    with loss_parallel_scope():
        x = inputs
        for layer in layers:
            with LocalSavedBytes(parameters) as meter:
                x = layer(x)
            saved.append(meter.seen)
        with LocalSavedBytes(parameters | {storage.data_ptr() for storage in storages(x)}) as meter:
            loss = llama_loss(x, targets)
        saved.append(meter.seen)
        loss.backward()
    stage = {pointer: size for layer in saved for pointer, size in layer.items()}  # a storage counted once
    as_left = [sum(local(p.grad).nbytes for p in layer.parameters()) for layer in layers]  # by the backward
    for layer in layers:
        redistribute_gradients(layer)
    return {"activations": [sum(layer.values()) for layer in saved], "stage": sum(stage.values()),
            "parameters": [sum(local(p).nbytes for p in layer.parameters()) for layer in layers],
            "gradients_as_left": as_left,
            "gradients": [sum(local(p.grad).nbytes for p in layer.parameters()) for layer in layers]}


def measure_both(mesh) -> dict:
    return {sp: measure(mesh, sp) for sp in (True, False)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return on_gloo_ranks(measure_both, TP, tmp_path_factory.mktemp("memory_tensor_parallel"))


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_parameters_and_gradients_per_rank_are_the_models(ranks, sequence_parallel):
    predicted = [count * 4 for count in layer_parameter_counts(TINY, tensor_parallel=TP)]  # fp32
    largest, other = ranks[0][sequence_parallel], ranks[1][sequence_parallel]
    assert largest["parameters"] == largest["gradients"] == predicted
    assert other["parameters"] == other["gradients"]
    assert all(size <= most for size, most in zip(other["parameters"], predicted))  # 129 of 259 vocabulary rows
    # during the step, before they are cut to the parameters' layouts: the embedding's whole
    assert largest["gradients_as_left"] == [count * 4 for count in layer_gradient_counts(TINY, tensor_parallel=TP)]
    whole = [count * 4 for count in layer_parameter_counts(TINY)]
    assert [2 * size for size in largest["parameters"][1:-1]] == [size + 2 * TINY.dim * 4 for size in whole[1:-1]]


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_each_layers_saved_tensors_are_the_models(ranks, sequence_parallel):
    measured = ranks[0][sequence_parallel]["activations"]
    kinds = layer_kinds(TINY) + ["loss"]
    predicted = [estimate_layer_activation_bytes(TINY, kind, BATCH, SEQ_LEN, device="cpu", tensor_parallel=TP,
                                                 sequence_parallel=sequence_parallel) for kind in kinds]
    assert measured == predicted
    assert all(size <= most for size, most in zip(ranks[1][sequence_parallel]["activations"], measured))


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_a_stages_memory_is_within_ten_percent_of_the_model(ranks, sequence_parallel):
    stage = estimate_stage(TINY, range(TINY.n_layers + 2), num_micro_batches=1, micro_batch_size=BATCH,
                           seq_len=SEQ_LEN, device="cpu", tensor_parallel=TP, sequence_parallel=sequence_parallel)
    measured = ranks[0][sequence_parallel]
    assert abs(stage.graph_bytes - measured["stage"]) <= 0.1 * measured["stage"], (stage.graph_bytes, measured)
    assert stage.parameters_bytes == sum(measured["parameters"])
    assert stage.gradients_bytes == sum(measured["gradients_as_left"])  # the most a step holds
    # sequence parallelism holds less than whole activations on every rank
    if sequence_parallel:
        assert measured["stage"] < ranks[0][False]["stage"]
