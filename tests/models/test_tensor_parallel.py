"""Tensor parallelism inside a stage (raypipe.models.tensor_parallel), over real gloo groups.

Two processes (forked once for the whole module, tests/gloo_ranks.py: a module-scoped
fixture runs every case in one pair and hands back the results) each build a stage's
layers with the per-layer seeding, split them with their plans over a 1-D CPU mesh of
2, run one forward and backward and gather the gradients whole. The reference is this
process: the same layers unparallelized, fp32. Tensor parallelism changes the order of
reductions, so losses and gradients are compared within 1e-5 relative (gradients in
norm), not bitwise; a replicated layer's gradients are compared across the two ranks
bitwise.

The models are dropout-free: dropout under tensor parallelism on CPU cannot match one
process, because DTensor's random-number coordination runs on CUDA only (each rank draws
its own masks).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.checkpoint import checkpoint

from raypipe.core.packed import IGNORE_INDEX, make_packed
from raypipe.errors import ConfigError
from raypipe.models.layers import LayerSpec, build_layer
from raypipe.models.llama import LlamaConfig, get_config, llama_layers, llama_loss, llama_tp_plan
from raypipe.models.tensor_parallel import (
    check_tensor_parallel,
    full_state_dict,
    local_shapes,
    loss_parallel_active,
    loss_parallel_scope,
    parallelize_layer,
    redistribute_gradients,
)
from raypipe.stage.split_backward import input_gradient
from tests.gloo_ranks import on_gloo_ranks

SEED = 7
TP = 2
BATCH, SEQ_LEN = 2, 8
TINY = get_config("tiny")  # vocabulary 259: the embedding and the head split it 130 + 129
BYO_DIM, BYO_HIDDEN = 6, 8
TOLERANCE = 1e-5


class SequenceMixer(nn.Module):
    """A layer that mixes positions (each adds a projection of the running mean of those up to
    it), so it is wrong on a sequence shard; takes a tensor or a packed (hidden, ...) tuple."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        if isinstance(x, tuple):
            hidden, *rest = x
            return (self._mix(hidden), *rest)
        return self._mix(x)

    def _mix(self, hidden: torch.Tensor) -> torch.Tensor:
        counts = torch.arange(1, hidden.size(1) + 1, dtype=hidden.dtype).view(1, -1, 1)
        return hidden + self.proj(hidden.cumsum(dim=1) / counts)


class MLP(nn.Module):
    """A residual two-Linear MLP: a model's own layer, not the LLaMA's."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def mlp_plan(sequence_parallel: bool) -> dict:
    """The MLP's plan: its input sequence-sharded under sequence parallelism, whole otherwise."""
    sequence = Shard(1) if sequence_parallel else Replicate()
    return {"fc1": ColwiseParallel(input_layouts=sequence), "fc2": RowwiseParallel(output_layouts=sequence)}


MLP_DICT_PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}  # without sequence parallelism


# -- the stages and their inputs ----------------------------------------------------------

def llama_stage(with_mixer: bool, config: LlamaConfig = TINY) -> list[tuple[int, LayerSpec]]:
    """(global index, spec): embedding, 2 blocks (a replicated mixer between them), head."""
    specs = llama_layers(config)
    stage = [(0, specs[0]), (1, specs[1])]
    if with_mixer:
        stage.append((2, LayerSpec(SequenceMixer, config.dim)))
    return stage + [(3, specs[2]), (len(specs) - 1, specs[-1])]


def byo_stage(plan) -> list[tuple[int, LayerSpec]]:
    """A replicated input projection (whole input, sharded output under sequence parallelism),
    an MLP with a plan, a replicated mixer, an MLP with a plan, a replicated head (whole output)."""
    return [(0, LayerSpec(nn.Linear, BYO_DIM, BYO_DIM)), (1, LayerSpec(MLP, BYO_DIM, BYO_HIDDEN, tp_plan=plan)),
            (2, LayerSpec(SequenceMixer, BYO_DIM)), (3, LayerSpec(MLP, BYO_DIM, BYO_HIDDEN, tp_plan=plan)),
            (4, LayerSpec(nn.Linear, BYO_DIM, 3))]


def llama_batch(packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY.vocab_size, (BATCH, SEQ_LEN + 1), generator=generator)
    targets = tokens[:, 1:].clone()
    targets[0, :2] = IGNORE_INDEX
    if not packed:
        return tokens[:, :-1], targets
    # row 0: three documents; row 1: a continuation (positions from 5) and a second document
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [5, 6, 7, 8, 9, 0, 1, 2]])
    targets[:, :-1][ids[:, 1:] != ids[:, :-1]] = IGNORE_INDEX  # no target crosses into the next document
    return make_packed(tokens[:, :-1], positions, ids), targets


def byo_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    inputs = torch.randn(BATCH, SEQ_LEN, BYO_DIM, generator=generator)
    return inputs, torch.randn(BATCH, SEQ_LEN, 3, generator=generator)


CASES = {  # name: (stage, batch, loss, sequence_parallel)
    "llama_sp": (functools.partial(llama_stage, False), functools.partial(llama_batch, False), llama_loss, True),
    "llama": (functools.partial(llama_stage, False), functools.partial(llama_batch, False), llama_loss, False),
    "llama_packed_sp": (functools.partial(llama_stage, False), functools.partial(llama_batch, True), llama_loss, True),
    "llama_packed": (functools.partial(llama_stage, False), functools.partial(llama_batch, True), llama_loss, False),
    "llama_packed_mixer_sp": (functools.partial(llama_stage, True), functools.partial(llama_batch, True),
                              llama_loss, True),
    # grouped-query attention: each rank 2 query heads reading its 1 KV head
    "llama_gqa_packed_sp": (functools.partial(llama_stage, False, TINY.replace(n_kv_heads=2)),
                            functools.partial(llama_batch, True), llama_loss, True),
    "byo_dict": (functools.partial(byo_stage, MLP_DICT_PLAN), byo_batch, F.mse_loss, False),
    "byo_mixer_sp": (functools.partial(byo_stage, mlp_plan), byo_batch, F.mse_loss, True),
}


def gradients(layers: list[nn.Module]) -> dict[str, torch.Tensor]:
    grads = {}
    for position, layer in enumerate(layers):
        for name, parameter in layer.named_parameters():
            grad = parameter.grad
            grads[f"{position}.{name}"] = grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()
    return grads


# -- the two processes ----------------------------------------------------------------------

def run_case(name: str, mesh) -> dict:
    make_stage, make_batch, loss_fn, sequence_parallel = CASES[name]
    stage = make_stage()
    layers = []
    for position, (index, spec) in enumerate(stage):
        layer = build_layer(spec, index, SEED)
        layers.append(parallelize_layer(layer, spec.tp_plan, mesh, sequence_parallel=sequence_parallel,
                                        first_layer=position == 0, final_layer=position == len(stage) - 1))
    initial = [full_state_dict(layer) for layer in layers]
    inputs, targets = make_batch()
    activation_shapes = []
    with loss_parallel_scope():
        x = inputs
        for layer in layers:
            x = layer(x)
            hidden = x[0] if isinstance(x, tuple) else x
            activation_shapes.append((type(hidden).__name__, tuple(hidden.shape)))
        loss = loss_fn(x, targets)
        loss.backward()
    relaid = sorted(f"{position}.{name}" for position, layer in enumerate(layers)
                    for name, p in layer.named_parameters() if isinstance(p.grad, DTensor)
                    and p.grad.placements != p.placements)
    for layer in layers:
        redistribute_gradients(layer)
    for layer in layers:  # after it, every gradient has its parameter's local shape
        for p in layer.parameters():
            if isinstance(p, DTensor):
                assert p.grad.placements == p.placements and p.grad.to_local().shape == p.to_local().shape
    return {"loss": loss.detach(), "loss_type": type(loss).__name__, "grads": gradients(layers),
            "initial": initial, "activation_shapes": activation_shapes, "relaid": relaid,
            "local_shapes": [local_shapes(layer) for layer in layers]}


def later_stage_backward(mesh, sequence_parallel: bool, mode: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A last stage (2 blocks, head) from a received activation (a sequence shard under
    sequence parallelism): its loss, the input's gradient and the weights' gradients, by one
    whole backward ("whole"), by the split I then W ("split", zero-bubble schedules), or with
    each layer's forward recomputed in the backward ("recompute")."""
    specs = llama_layers(TINY)
    layers = [parallelize_layer(build_layer(specs[index], index, SEED), specs[index].tp_plan, mesh,
                                sequence_parallel=sequence_parallel, final_layer=index == len(specs) - 1)
              for index in (1, 2, len(specs) - 1)]
    whole = torch.randn(BATCH, SEQ_LEN, TINY.dim, generator=torch.Generator().manual_seed(5))
    received = whole.chunk(TP, dim=1)[mesh.get_local_rank()] if sequence_parallel else whole
    received = received.clone().requires_grad_()
    targets = llama_batch(packed=False)[1]
    with loss_parallel_scope():
        x = received
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False) if mode == "recompute" else layer(x)
        loss = llama_loss(x, targets)
        if mode == "split":
            input_grad, weights = input_gradient(loss, torch.ones_like(loss), received,
                                                 [p for layer in layers for p in layer.parameters()])
            weights.run()
        else:
            loss.backward()
            input_grad = received.grad
    for layer in layers:
        redistribute_gradients(layer)
    return loss.detach(), input_grad, gradients(layers)


def dtensor_loss_outside_scope(mesh) -> str:
    logits = distribute_tensor(torch.randn(BATCH, SEQ_LEN, 6), mesh, [Shard(-1)], src_data_rank=None)
    try:
        llama_loss(logits, torch.zeros(BATCH, SEQ_LEN, dtype=torch.int64))
    except RuntimeError as error:
        return str(error)
    return "no error"


def every_case(mesh) -> dict:
    """What one rank computes for every case."""
    results = {name: run_case(name, mesh) for name in CASES}
    results["outside_scope"] = dtensor_loss_outside_scope(mesh)
    results["later_stage"] = {(sequence_parallel, mode): later_stage_backward(mesh, sequence_parallel, mode)
                              for sequence_parallel in (True, False) for mode in ("whole", "split", "recompute")}
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every case's results on both ranks, from one pair of processes."""
    return on_gloo_ranks(every_case, TP, tmp_path_factory.mktemp("tensor_parallel"))


def reference(name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[dict]]:
    """The case in this process, nothing parallelized."""
    make_stage, make_batch, loss_fn, _ = CASES[name]
    layers = [build_layer(spec, index, SEED) for index, spec in make_stage()]
    initial = [{key: value.clone() for key, value in layer.state_dict().items()} for layer in layers]
    inputs, targets = make_batch()
    x = inputs
    for layer in layers:
        x = layer(x)
    loss = loss_fn(x, targets)
    loss.backward()
    return loss.detach(), gradients(layers), initial


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# -- equal to one process -----------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_every_gradient_equal_one_process(ranks, name):
    loss, grads, initial = reference(name)
    for rank in range(TP):
        result = ranks[rank][name]
        assert result["loss_type"] == "Tensor"  # a local tensor, whole on every rank
        assert relative(result["loss"], loss) <= TOLERANCE, (rank, float(result["loss"]), float(loss))
        assert result["grads"].keys() == grads.keys()
        for key, grad in grads.items():
            assert relative(result["grads"][key], grad) <= TOLERANCE, (rank, key)
        # full_state_dict: the keys of the unsplit layers, the seeded initial weights exactly
        for gathered, whole in zip(result["initial"], initial):
            assert gathered.keys() == whole.keys()
            for key in whole:
                assert torch.equal(gathered[key], whole[key]), (rank, key)


@pytest.mark.parametrize("name", ["llama_packed_mixer_sp", "byo_mixer_sp", "byo_dict"])
def test_replicated_layers_have_the_same_gradients_on_every_rank(ranks, name):
    make_stage = CASES[name][0]
    replicated = {position for position, (_, spec) in enumerate(make_stage()) if spec.tp_plan is None}
    assert len(replicated) >= 1
    for key, grad in ranks[0][name]["grads"].items():
        if int(key.split(".")[0]) in replicated:
            assert torch.equal(grad, ranks[1][name]["grads"][key]), key


def test_without_sequence_parallel_the_norms_are_whole_and_agree_on_every_rank(ranks):
    norms = [key for key in ranks[0]["llama"]["grads"] if "norm" in key]
    assert len(norms) == 5  # 2 per block, the head's
    for key in norms:
        assert torch.equal(ranks[0]["llama"]["grads"][key], ranks[1]["llama"]["grads"][key]), key


def test_sequence_parallel_passes_sequence_shards_and_the_head_vocabulary_shards(ranks):
    shapes = ranks[0]["llama_sp"]["activation_shapes"]
    half = SEQ_LEN // TP
    assert shapes[:-1] == [("Tensor", (BATCH, half, TINY.dim))] * 3  # embedding, blocks: local sequence shards
    assert shapes[-1] == ("DTensor", (BATCH, SEQ_LEN, TINY.vocab_size))  # the head's Shard(-1) logits
    assert ranks[0]["llama"]["activation_shapes"][1] == ("Tensor", (BATCH, SEQ_LEN, TINY.dim))
    mixer = ranks[0]["llama_packed_mixer_sp"]["activation_shapes"]
    assert mixer[2] == ("Tensor", (BATCH, half, TINY.dim))  # the replicated layer's output sharded again
    # the vocabulary of 259 split unevenly: 130 and 129 rows, in the embedding and the head
    for rank, rows in enumerate((130, 129)):
        local = ranks[rank]["llama_sp"]["local_shapes"]
        assert local[0]["tokens.weight"] == (rows, TINY.dim)
        assert local[-1]["output.weight"] == (rows, TINY.dim)
        assert local[1]["attention.wk.weight"] == (TINY.kv_dim // TP, TINY.dim)
        assert local[1]["feed_forward.w2.weight"] == (TINY.dim, TINY.ffn_dim // TP)


def test_gradients_left_out_of_their_parameters_layout_are_redistributed(ranks):
    # under sequence parallelism the norms' gradients come back Partial (summed over the ranks);
    # the row-parallel embedding's whole and replicated (cut to the rank's rows); the
    # projections' are already their parameters' shards
    assert ranks[0]["llama_sp"]["relaid"] == ["0.tokens.weight", "1.attention_norm.weight", "1.ffn_norm.weight",
                                              "2.attention_norm.weight", "2.ffn_norm.weight", "3.norm.weight"]
    assert ranks[0]["llama"]["relaid"] == ["0.tokens.weight"]


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_split_backward_and_recompute_give_the_whole_backwards_gradients(ranks, sequence_parallel):
    """What zero-bubble schedules (I, then W) and activation recomputation do with a stage's
    split layers: bitwise the gradients of one whole backward, on every rank."""
    for rank in range(TP):
        results = ranks[rank]["later_stage"]
        loss, input_grad, grads = results[(sequence_parallel, "whole")]
        for mode in ("split", "recompute"):
            other_loss, other_input_grad, other_grads = results[(sequence_parallel, mode)]
            assert torch.equal(other_loss, loss) and torch.equal(other_input_grad, input_grad), (rank, mode)
            for key, grad in grads.items():
                assert torch.equal(other_grads[key], grad), (rank, mode, key)


def test_dtensor_logits_outside_the_loss_parallel_scope_are_refused(ranks):
    assert ranks[0]["outside_scope"].startswith("llama_loss got DTensor logits outside")


# -- the scope, the plans, the checks (one process) -------------------------------------------

def test_loss_parallel_scope_nests_and_is_restored_when_the_body_raises():
    from torch.distributed.tensor.parallel.loss import customized_loss_ops

    handlers = DTensor._op_dispatcher._custom_op_handlers
    with pytest.raises(KeyError):
        with loss_parallel_scope():
            with loss_parallel_scope():
                assert loss_parallel_active()
            assert loss_parallel_active() and set(customized_loss_ops) <= set(handlers)
            raise KeyError("a failing op")
    assert not loss_parallel_active()
    assert not set(customized_loss_ops) & set(handlers)


def test_layer_spec_carries_its_plan_and_never_passes_it_to_the_class():
    spec = LayerSpec(nn.Linear, 4, 4, tp_plan=MLP_DICT_PLAN)
    assert isinstance(spec.build("meta"), nn.Linear)
    assert spec.with_cost(None).tp_plan is MLP_DICT_PLAN
    assert spec.with_tp_plan(None).tp_plan is None and spec.tp_plan is MLP_DICT_PLAN
    with pytest.raises(TypeError, match="tp_plan must be None, a dict"):
        LayerSpec(nn.Linear, 4, 4, tp_plan={"fc1": "colwise"})
    layers = llama_layers("tiny")
    assert all(spec.tp_plan is not None for spec in layers)
    assert set(layers[0].tp_plan(True)) == {"tokens"} and set(layers[-1].tp_plan(True)) == {"norm", "output"}
    assert set(llama_tp_plan("block", True)) - set(llama_tp_plan("block", False)) == {"attention_norm", "ffn_norm"}
    assert set(llama_tp_plan("head", False)) == {"output"}
    with pytest.raises(ValueError, match="unknown LLaMA layer kind"):
        llama_tp_plan("norm", True)


def test_tensor_parallel_checks_name_their_cause():
    check_tensor_parallel(llama_layers(TINY), TP, seq_len=SEQ_LEN)  # the vocabulary of 259 may split unevenly
    check_tensor_parallel(llama_layers(TINY), 1)
    cases = [
        (llama_layers(TINY), 8, {}, "invalid tensor_parallel=8: must divide layer 1 (LlamaBlock)'s heads (4)"),
        (llama_layers(TINY.replace(n_kv_heads=1)), 2, {}, "must divide layer 1 (LlamaBlock)'s KV heads (1)"),
        (llama_layers(TINY.replace(ffn_dim=351)), 2, {}, "must divide layer 1 (LlamaBlock)'s FFN width (351)"),
        ([nn.Linear(4, 4), LayerSpec(nn.Linear, 4, 4)], 2, {}, "no layer of the model has a tensor-parallel plan"),
        (llama_layers(TINY), 2, {"seq_len": 7}, "seq_len=7 does not divide by it"),
        ([LayerSpec(MLP, 4, 8, tp_plan={"fc9": ColwiseParallel()})], 2, {}, "names 'fc9', which is no submodule"),
        ([LayerSpec(MLP, 4, 7, tp_plan=MLP_DICT_PLAN)], 2, {}, "must divide the width fc1 of layer 0 (MLP)"),
        (llama_layers(TINY), 0, {}, "invalid tensor_parallel=0: must be an int >= 1"),
    ]
    for model, t, options, cause in cases:
        with pytest.raises(ConfigError) as raised:
            check_tensor_parallel(model, t, **options)
        assert cause in str(raised.value).splitlines()[0], (cause, str(raised.value))
    check_tensor_parallel(llama_layers(TINY), TP, sequence_parallel=False, seq_len=7)  # no sequence shards


def test_plans_pickle_with_their_specs():
    import pickle

    specs = pickle.loads(pickle.dumps(llama_layers(LlamaConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2,
                                                                ffn_dim=8, max_seq_len=8))))
    assert set(specs[1].tp_plan(False)) == set(llama_tp_plan("block", False))
