"""A stage adopts the layers of another partition's snapshots: weights, optimizer
state per parameter, hyper-parameters and schedule, exactly."""
import copy
import pickle

import pytest
import torch
from torch import nn

import raypipe
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.worker import StageWorker
from tests.reference import adamw, make_mlp


def stage_worker(layers, indices, num_stages, stage):
    config = raypipe.PipelineConfig(num_stages=num_stages)
    scheduler = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # noqa: E731
    return StageWorker(WorkerSpec(stage, num_stages, tuple(layers[i] for i in indices), tuple(indices), config,
                                  optimizer_factory=adamw, scheduler_factory=scheduler,
                                  loss_fn=nn.functional.mse_loss if stage == num_stages - 1 else None))


def test_one_stage_adopts_two_stages_snapshots_bitwise():
    layers = list(make_mlp())
    stages = [stage_worker(layers, range(0, 3), 2, 0), stage_worker(layers, range(3, 7), 2, 1)]
    generator = torch.Generator().manual_seed(3)
    for worker in stages:
        for _ in range(2):  # optimizer state and a schedule that moved
            for parameter in worker.layers.parameters():
                parameter.grad = torch.randn(parameter.shape, generator=generator)
            worker.optimizer.step()
            worker.scheduler.step()
        worker.commits = 2
    merged = stage_worker(list(make_mlp(seed=5)), range(7), 1, 0)  # other weights: all must be replaced
    merged.adopt(*[pickle.loads(pickle.dumps(worker.snapshot(), protocol=5)) for worker in stages])  # as Ray ships it
    expected = {**stages[0].state_dict(), **stages[1].state_dict()}
    assert merged.state_dict().keys() == expected.keys()
    for index, state in merged.state_dict().items():
        for name, tensor in state.items():
            assert torch.equal(tensor, expected[index][name]), (index, name)
    expected_optimizer = {**stages[0].optimizer_state(), **stages[1].optimizer_state()}
    adopted = merged.optimizer_state()
    for index in range(7):
        for name, state in expected_optimizer[index].items():
            assert all(torch.equal(torch.as_tensor(adopted[index][name][key]), torch.as_tensor(value))
                       for key, value in state.items()), (index, name)
    assert adopted[-1] == expected_optimizer[-1]  # hyper-parameters, the scheduled learning rate included
    assert merged.scheduler.state_dict() == stages[0].scheduler.state_dict() and merged.commits == 2


def zero1_spec(layers, indices, stage, num_stages, replica, num_replicas):
    """Stage ``stage`` (layers ``indices``) as replica ``replica`` of an elastic ZeRO-1 run in bf16, with its
    own copy of them (as a Ray worker unpickles: a worker turns the ones it does not own to bf16)."""
    config = raypipe.PipelineConfig(num_stages=num_stages, num_replicas=(1, 3), shard_optimizer=True,
                                    precision="bf16")
    scheduler = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # noqa: E731
    last = stage == num_stages - 1
    return WorkerSpec(stage, num_stages, tuple(copy.deepcopy([layers[i] for i in indices])), tuple(indices), config,
                      optimizer_factory=adamw, scheduler_factory=scheduler,
                      loss_fn=nn.functional.mse_loss if last else None, replica=replica, num_replicas=num_replicas,
                      micro_batches=range(replica, replica + 1))


def parameter_of(worker, index, name):
    """Parameter ``name`` of global layer ``index`` on ``worker``, or None when it holds another stage."""
    if index not in worker.layer_indices:
        return None
    return worker.layers[worker.layer_indices.index(index)].get_parameter(name)


def owner_of(workers, index, name):
    """The worker whose optimizer steps parameter ``name`` of layer ``index`` (and keeps its main weight)."""
    owners = [w for w in workers if any(p is parameter_of(w, index, name) for p in w._owned)]
    assert len(owners) == 1, (index, name, len(owners))
    return owners[0]


@pytest.mark.parametrize("stages_before, before, after", [(1, 3, 2), (1, 1, 2), (1, 2, 1), (2, 2, 1)],
                         ids=["shrink-3-to-2", "grow-1-to-2", "shrink-2-to-1", "repartition-2x2-to-1"])
def test_zero1_workers_adopt_every_replicas_part_when_the_layout_changes(stages_before, before, after):
    layers = list(make_mlp())
    ranges = [range(7)] if stages_before == 1 else [range(0, 3), range(3, 7)]
    old = [StageWorker(zero1_spec(layers, ranges[stage], stage, stages_before, replica, before))
           for replica in range(before) for stage in range(stages_before)]
    generator = torch.Generator().manual_seed(3)
    for worker in old:
        for _ in range(2):  # each owner steps its own parameters: its fp32 main weights and moments move
            for parameter in worker._owned:
                parameter.grad = torch.randn(parameter.shape, generator=generator)
            worker.optimizer.step()
            worker.scheduler.step()
        worker.commits = 2
    snapshots = [pickle.loads(pickle.dumps(worker.snapshot(), protocol=5)) for worker in old]  # as Ray ships them
    old_owners = {(i, n): owner_of(old, i, n) for i, layer in enumerate(layers) for n, _ in layer.named_parameters()}
    old_mains = {key: parameter_of(owner, *key).detach().clone() for key, owner in old_owners.items()}
    old_moments = {key: owner.optimizer_state()[key[0]][key[1]] for key, owner in old_owners.items()}
    new = [StageWorker(zero1_spec(list(make_mlp(seed=5)), range(7), 0, 1, replica, after))
           for replica in range(after)]
    if stages_before == 1:  # replica 0 takes the new layout in place (rebuilt for its new owners)
        old[0].take_layout(zero1_spec(layers, range(7), 0, 1, 0, after))
        new[0] = old[0]
    for worker in new:
        worker.adopt(*snapshots)
    for (index, name), main in old_mains.items():
        owner = owner_of(new, index, name)
        assert parameter_of(owner, index, name).dtype == torch.float32
        assert torch.equal(parameter_of(owner, index, name), main), (index, name)  # the fp32 main, bitwise
        moments = owner.optimizer_state()[index][name]
        assert all(torch.equal(torch.as_tensor(moments[k]), torch.as_tensor(v))
                   for k, v in old_moments[(index, name)].items()), (index, name)
        for other in new:  # every other replica computes with its bf16 value
            assert torch.equal(other.weights.compute_weight(parameter_of(other, index, name)).float(),
                               main.to(torch.bfloat16).float()), (index, name)
    for worker in new:
        held = sum(1 for state in worker.optimizer_state().values() for _ in state) - 1 if worker.optimizer else 0
        assert held == len(worker._owned)  # each worker holds its own parameters' moments, no one else's
        assert worker.commits == 2 and worker.ownership.replica == new.index(worker)
        if worker.scheduler is not None:
            assert worker.scheduler.state_dict()["last_epoch"] == 2
