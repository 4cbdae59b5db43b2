"""Stage boundaries that carry trees of tensors (issue 44, item 1), without Ray: stages that
pass dicts and tuples (a floating-point tensor that takes a gradient, an integer tensor that
goes forward only, a float mask made without a graph, ``None`` and a constant) train as one
process does, on every schedule; the packed LLaMA on two and three stages trains as one
process on each document; a leaf that cannot cross a boundary is named by stage and path."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import raypipe
from raypipe.comm.tree_messages import TreeLeafError
from raypipe.errors import StageError
from raypipe.testing.op_interpreter import OpInterpreter
from tests.reference import adamw, assert_parameters_match, random_batches, reference_step

BATCH, MICRO_BATCHES, STEPS, CLIP = 8, 4, 2, 0.1


class ToDict(nn.Module):
    """Input (B, 8) -> {"hidden": (B, 16) with a graph, "bucket": int64 (B,), "mask": float (B,)
    made without a graph, "nothing": None, "scale": a constant}."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> dict:
        return {"hidden": torch.tanh(self.linear(x)), "bucket": (x[:, 0] > 0).long(),
                "mask": (x[:, 1] > 0).float(), "nothing": None, "scale": 0.5}


class DictToTuple(nn.Module):
    """The dict -> (hidden, bucket, None), using the integer leaf and the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.buckets = nn.Embedding(2, 16)

    def forward(self, tree: dict) -> tuple:
        assert tree["nothing"] is None and tree["scale"] == 0.5 and not tree["bucket"].is_floating_point()
        hidden = self.linear(tree["hidden"]) * tree["scale"] + self.buckets(tree["bucket"])
        return torch.nn.functional.gelu(hidden * (1.0 + tree["mask"])[:, None]), tree["bucket"], None


class TupleToTuple(nn.Module):
    """(hidden, bucket, None) -> (hidden, bucket, None): a block that passes the rest on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, tree: tuple) -> tuple:
        hidden, bucket, nothing = tree
        return torch.tanh(self.linear(hidden)) + bucket[:, None], bucket, nothing


class Head(nn.Module):
    """The tuple -> (prediction (B, 4), bucket): the loss takes the tree as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, tree: tuple) -> tuple:
        return self.linear(tree[0]), tree[1]


def tree_loss(output: tuple, target: torch.Tensor) -> torch.Tensor:
    prediction, bucket = output
    assert isinstance(output, tuple) and bucket.dtype == torch.int64
    return nn.functional.mse_loss(prediction, target)


def tree_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(ToDict(), DictToTuple(), TupleToTuple(), Head())


@pytest.mark.parametrize("schedule,num_stages,mode", [
    ("gpipe", 2, "never"), ("1f1b", 2, "never"), ("1f1b", 3, "always"), ("gpipe", 4, "except_last"),
    ("zb_h1", 3, "never"), ("zb_h1", 2, "always")])
def test_stages_passing_trees_train_as_one_process(schedule, num_stages, mode):
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=MICRO_BATCHES, schedule=schedule,
                                    clip_grad_norm=CLIP, activation_checkpoint=mode)
    pipeline = OpInterpreter(list(tree_model()), tree_loss, adamw, config)
    model = tree_model()
    optimizer = adamw(model.parameters())
    for step, (x, y) in enumerate(random_batches(BATCH, STEPS)):
        decision = pipeline.step(step, x, y)
        loss, norm = reference_step(model, optimizer, tree_loss, x, y, MICRO_BATCHES, CLIP)
        assert not decision.skipped
        torch.testing.assert_close(decision.loss, loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(decision.grad_norm, norm, rtol=1e-6, atol=0)
    assert_parameters_match(pipeline.state_dict(), model.state_dict(), rtol=1e-6, atol=1e-7)


def test_the_gradient_sent_back_is_a_tree_of_the_input_with_none_where_no_gradient_flows():
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=1, balance=[1, 3])
    pipeline = OpInterpreter(list(tree_model()), tree_loss, adamw, config)
    first, last = pipeline.workers
    x, y = random_batches(BATCH, 1)[0]
    sent = first.forward(0, x, step=0)
    assert set(sent) == {"hidden", "bucket", "mask", "nothing", "scale"}
    assert not any(leaf.requires_grad for leaf in sent.values() if isinstance(leaf, torch.Tensor))
    last.forward(0, sent, y, 1.0, step=0)
    gradient = last.backward(0)
    assert gradient["bucket"] is None and gradient["nothing"] is None and gradient["scale"] is None
    assert gradient["hidden"].shape == (BATCH, 16) and gradient["mask"].shape == (BATCH,)
    assert first.backward(0, gradient) is None  # the mask had no graph upstream: nothing starts from it


class SendsAList(nn.Module):
    """A stage output with a leaf no boundary carries: a Python list inside the tree's dict."""

    def forward(self, x: torch.Tensor) -> dict:
        return {"hidden": x, "extra": {"lengths": object()}}


def test_a_leaf_that_cannot_be_sent_names_the_stage_and_its_path():
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=1)
    pipeline = OpInterpreter([SendsAList(), nn.Identity()], tree_loss, adamw, config)
    x, y = random_batches(BATCH, 1)[0]
    with pytest.raises(StageError) as raised:
        pipeline.workers[0].forward(0, x, step=0)
    assert isinstance(raised.value.original, TreeLeafError)
    assert "stage 0 output['extra']['lengths'] is an object of type object" in str(raised.value).splitlines()[0]


def test_a_split_backward_of_several_differentiable_outputs_into_a_differentiable_input_is_refused():
    class TwoOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, tree: dict) -> tuple:
            hidden = self.linear(tree["hidden"])
            return hidden, hidden * 2

    config = raypipe.PipelineConfig(num_stages=3, num_micro_batches=3, schedule="zb_h1")
    pipeline = OpInterpreter([ToDict(), TwoOut(), nn.Identity()], lambda out, y: out[0].sum() + out[1].sum(),
                             adamw, config)
    x = torch.randn(6, 8)
    with pytest.raises(StageError) as raised:
        pipeline.step(0, x, torch.zeros(6, 16))
    first_line = str(raised.value).splitlines()[0]
    assert first_line.startswith("stage 1, op I, micro-batch 0: ValueError: stage 1: schedule 'zb_h1' splits")
    assert "output has 2" in first_line


def test_offloading_a_tree_input_is_refused_with_the_cause_first():
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=1, balance=[1, 3], activation_checkpoint="always",
                                    offload_activations=True)
    last = OpInterpreter(list(tree_model()), tree_loss, adamw, config).workers[1]
    x, y = random_batches(BATCH, 1)[0]
    received = {"hidden": torch.randn(BATCH, 16), "bucket": (x[:, 0] > 0).long(), "mask": torch.ones(BATCH),
                "nothing": None, "scale": 0.5}
    with pytest.raises(StageError, match=r"^stage 1, op F, micro-batch 0: ValueError: stage 1: offload_activations "
                                         r"offloads a single-tensor stage input; this stage receives a tree \("
                                         r"\['hidden'\]: torch.float32 \(8, 16\), \['bucket'\]: torch.int64"):
        last.forward(0, received, y, 1.0, step=0)


def test_a_tree_is_sent_with_contiguous_tensors_for_transports_that_send_each_as_it_is():
    """A packed row's positions and document ids are strided views of the (B, 3, T) batch; Ray
    Direct Transport gives each tensor to a collective send, which refuses a strided one."""
    from raypipe.core.packed import make_packed
    from raypipe.models.llama import llama_layers, llama_loss
    from tests.models.test_packed_documents import CONFIG

    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    packed = make_packed(tokens, torch.arange(8).expand(2, -1), torch.zeros_like(tokens))
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=1, balance=[2, 2])
    first, last = OpInterpreter([spec.build() for spec in llama_layers(CONFIG)], llama_loss, adamw, config).workers
    sent = first.forward(0, packed, step=0)
    assert isinstance(sent, tuple) and len(sent) == 3 and all(tensor.is_contiguous() for tensor in sent)
    last.forward(0, sent, tokens, 1.0, step=0)
    gradient = last.backward(0)
    assert gradient[0].is_contiguous() and gradient[1] is None and gradient[2] is None
