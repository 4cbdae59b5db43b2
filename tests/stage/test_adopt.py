"""A stage adopts the layers of another partition's snapshots: weights, optimizer
state per parameter, hyper-parameters and schedule, exactly."""
import pickle

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
