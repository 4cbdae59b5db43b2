"""Trees across stage boundaries (issue 44, item 1): packed documents on two stages (the default p2p
executor, and through its step runner in one process) and on two replicas of two stages (in one
process), where the LLaMA's hidden states, positions and document ids cross the boundary as a tree,
and a model passing dicts and tuples on the per-op executor and over Ray Direct Transport, each equal
to one process.
Every schedule and checkpointing mode runs in-process (tests/stage/test_tree_boundaries.py,
tests/models/test_packed_documents.py)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import raypipe
from raypipe.core.packed import IGNORE_INDEX
from raypipe.models.llama import llama_loss
from raypipe.run import llama_count_tokens
from tests.reference import in_process, on_ray
from tests.models.test_packed_documents import CONFIG, model, packed_batch
from tests.reference import (adamw, assert_bitwise_equal, assert_parameters_match, executor_options, random_batches,
                             reference_step)
from tests.stage.test_tree_boundaries import CLIP as TREE_CLIP
from tests.stage.test_tree_boundaries import MICRO_BATCHES as TREE_MICRO_BATCHES
from tests.stage.test_tree_boundaries import tree_loss, tree_model

MICRO_BATCHES = 2
UNEVEN_BATCH = 10  # the tree model's rows on the other executors: uneven over its 4 micro-batches


def sgd(params) -> torch.optim.SGD:
    # not Adam: its normalised update would magnify the last bits where a gradient is near zero,
    # which accumulating two micro-batches (against one batch here) rounds differently
    return torch.optim.SGD(params, lr=0.1)


def reference_step_packed(net: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                          targets: torch.Tensor) -> float:
    """One step in one process: the summed loss of every predicted token over their count."""
    logits = net(inputs)
    loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum") / llama_count_tokens(targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


# the default executor's trees on Ray (their headers and shapes, which change from micro-batch to
# micro-batch); the same step runner in one process (the trees handed over as they are), and two replicas
# there below; over Ray's other transports: the tree model on the other executors
def test_packed_rows_on_two_stages_train_as_one_process(ray_cluster):
    assert_packed_rows_on_two_stages_train_as_one_process(on_ray)


def test_packed_rows_on_two_stages_train_as_one_process_in_process():
    assert_packed_rows_on_two_stages_train_as_one_process(in_process)


def assert_packed_rows_on_two_stages_train_as_one_process(trainer_of) -> None:
    net = model()
    reference = copy.deepcopy(net)
    reference_optimizer = sgd(reference.parameters())
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES, schedule="1f1b")
    with trainer_of(net, llama_loss, sgd, config, loss_count_fn=llama_count_tokens) as trainer:
        for step in range(2):
            inputs, targets, _ = packed_batch(seed=20 + step, rows=4)
            counts = [llama_count_tokens(part) for part in torch.tensor_split(targets, MICRO_BATCHES)]
            assert counts[0] != counts[1]  # the micro-batches weigh by predicted tokens, not rows
            result = trainer.step(inputs, targets)
            loss = reference_step_packed(reference, reference_optimizer, inputs, targets)
            torch.testing.assert_close(result.loss, loss, rtol=1e-5, atol=0)
        assert_parameters_match(trainer.state_dict(), reference.state_dict())


# The per-op executor's Ray cells of tests/executor/test_equivalence.py too (one trainer each): over the object
# store under 1f1b, over Ray Direct Transport (gloo) under zb_h1, the global clip biting, on micro-batches of
# uneven sizes (10 rows in 4: 3, 3, 2, 2); over gloo also every bit as the step runner in one process on the
# same config
@pytest.mark.parametrize("transport, schedule", [("object_store", "1f1b"), ("gloo", "zb_h1")])
def test_stages_passing_trees_train_as_one_process_on_the_other_executors(ray_cluster, transport, schedule):
    # dicts and tuples (a float leaf with a gradient, an int leaf, a float mask, None, a constant) over 3 stages
    config = raypipe.PipelineConfig(num_stages=3, num_micro_batches=TREE_MICRO_BATCHES, schedule=schedule,
                                    clip_grad_norm=TREE_CLIP, **executor_options(transport))
    net = tree_model()
    reference = copy.deepcopy(net)
    reference_optimizer = adamw(reference.parameters())
    batches = random_batches(UNEVEN_BATCH, 2)
    with raypipe.PipelineTrainer(copy.deepcopy(net), tree_loss, adamw, config) as trainer:
        results = []
        for x, y in batches:
            results.append(result := trainer.step(x, y))
            loss, norm = reference_step(reference, reference_optimizer, tree_loss, x, y, TREE_MICRO_BATCHES,
                                        TREE_CLIP)
            assert (result.loss, result.grad_norm) == (pytest.approx(loss, rel=1e-5), pytest.approx(norm, rel=1e-5))
            assert result.clip_coefficient == pytest.approx(min(1.0, TREE_CLIP / (norm + 1e-6)), rel=1e-5)
            assert result.clip_coefficient < 1.0  # the clip really bites
        state = trainer.state_dict()
        assert_parameters_match(state, reference.state_dict())
    if transport == "gloo":
        with in_process(net, tree_loss, adamw, config) as one_process:
            again = [one_process.step(x, y) for x, y in batches]
            assert [(r.loss, r.grad_norm) for r in again] == [(r.loss, r.grad_norm) for r in results]
            assert_bitwise_equal(state, one_process.state_dict())


# each replica's block weighs by its predicted tokens: the step runner's arithmetic, in one process (the
# replicas' reduction on Ray: tests/executor/test_data_parallel.py)
def test_packed_rows_on_two_replicas_of_two_stages_train_as_one_process_in_process():
    net = model()
    reference = copy.deepcopy(net)
    reference_optimizer = sgd(reference.parameters())
    config = raypipe.PipelineConfig(num_stages=2, num_replicas=2, num_micro_batches=MICRO_BATCHES)
    with in_process(net, llama_loss, sgd, config, loss_count_fn=llama_count_tokens) as trainer:
        inputs, targets, _ = packed_batch(seed=30, rows=8)
        result = trainer.step(inputs, targets)  # each replica's block weighs by its predicted tokens
        loss = reference_step_packed(reference, reference_optimizer, inputs, targets)
        torch.testing.assert_close(result.loss, loss, rtol=1e-5, atol=0)
        assert_parameters_match(trainer.state_dict(), reference.state_dict())
