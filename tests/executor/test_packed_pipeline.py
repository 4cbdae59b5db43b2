"""Packed documents on two stages over Ray (the default p2p executor): the LLaMA's hidden
states, positions and document ids cross the stage boundary as a tree, and training equals
one process on the same packed rows (issue 44, item 1)."""
import copy

import torch
import torch.nn.functional as F

import raypipe
from raypipe.core.packed import IGNORE_INDEX
from raypipe.models.llama import llama_loss
from raypipe.run import llama_count_tokens
from tests.models.test_packed_documents import CONFIG, model, packed_batch
from tests.reference import assert_parameters_match

MICRO_BATCHES = 2


def sgd(params) -> torch.optim.SGD:
    # not Adam: its normalised update would magnify the last bits where a gradient is near zero,
    # which accumulating two micro-batches (against one batch here) rounds differently
    return torch.optim.SGD(params, lr=0.1)


def reference_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                   targets: torch.Tensor) -> float:
    """One step in one process: the summed loss of every predicted token over their count."""
    logits = net(inputs)
    loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum") / llama_count_tokens(targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def test_packed_rows_on_two_stages_train_as_one_process(ray_cluster):
    net = model()
    reference = copy.deepcopy(net)
    reference_optimizer = sgd(reference.parameters())
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=MICRO_BATCHES, schedule="1f1b")
    with raypipe.PipelineTrainer(net, llama_loss, sgd, config, loss_count_fn=llama_count_tokens) as trainer:
        for step in range(2):
            inputs, targets, _ = packed_batch(seed=20 + step, rows=4)
            counts = [llama_count_tokens(part) for part in torch.tensor_split(targets, MICRO_BATCHES)]
            assert counts[0] != counts[1]  # the micro-batches weigh by predicted tokens, not rows
            result = trainer.step(inputs, targets)
            loss = reference_step(reference, reference_optimizer, inputs, targets)
            torch.testing.assert_close(result.loss, loss, rtol=1e-5, atol=0)
        assert_parameters_match(trainer.state_dict(), reference.state_dict())
