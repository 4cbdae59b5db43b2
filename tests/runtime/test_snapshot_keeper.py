"""The snapshot keeper runs without a GPU: it reads, keeps and hands back the
snapshot of a worker on a GPU (host tensors only)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import raypipe
from raypipe.runtime.actor_classes import worker_actor_class
from raypipe.runtime.snapshot_keeper import start_keeper
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.worker import StageWorker
from tests.reference import adamw, make_mlp


@pytest.mark.gpu
def test_the_keeper_keeps_a_gpu_workers_snapshot_without_a_gpu(ray_cluster):
    ray = ray_cluster
    if not ray.cluster_resources().get("GPU"):
        pytest.fail("the local Ray instance sees no GPU")  # CUDA is here (the test was selected): a misconfiguration
    spec = WorkerSpec(0, 1, tuple(make_mlp()), tuple(range(7)), raypipe.PipelineConfig(num_stages=1),
                      optimizer_factory=adamw, loss_fn=nn.functional.mse_loss, use_gpu=True)
    worker = worker_actor_class(StageWorker).options(num_gpus=1, num_cpus=0).remote(spec)
    keeper = start_keeper()  # no CPU, no GPU
    ray.get(keeper.keep.remote(1, worker.snapshot.remote()))  # the keeper unpickles it: it must not need CUDA
    # a CUDA tensor would have started CUDA in the keeper's process to unpickle (and failed with none visible)
    assert ray.get(keeper.__ray_call__.remote(lambda _: torch.cuda.is_initialized())) is False
    [[kept_ref]] = ray.get(keeper.copies.remote(1))
    kept = ray.get(kept_ref)
    expected = ray.get(worker.state_dict.remote())  # on the host
    for key, tensor in kept["layers"].items():
        position, name = key.split(".", 1)
        assert tensor.device.type == "cpu" and torch.equal(tensor, expected[int(position)][name]), key
    ray.kill(worker)
    ray.kill(keeper)
