"""Snapshots live in host memory: a copy that shares no storage with the live state,
made by the staging function the GPU path uses too, and restored by copying into
the tensors that are there, bitwise."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import raypipe
from raypipe.comm.task_tensors import TaskTensor
from raypipe.stage import checkpointing, host_copy
from raypipe.stage.host_copy import HostBuffers, copy_path, load_optimizer_in_place, stage_to_host
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.worker import StageWorker
from tests.reference import adamw


def layers():
    torch.manual_seed(0)
    return (nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))  # a buffer (running statistics) too


def stage_worker(optimizer_factory=adamw):
    scheduler = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # noqa: E731
    return StageWorker(WorkerSpec(0, 1, layers(), (0, 1, 2), raypipe.PipelineConfig(num_stages=1),
                                  optimizer_factory=optimizer_factory, scheduler_factory=scheduler,
                                  loss_fn=nn.functional.mse_loss))


def train(worker, steps, seed=1):
    """``steps`` optimizer steps on random gradients, the buffers moved by a forward."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        worker.layers.train()
        with torch.no_grad():
            worker.layers[1](torch.randn(5, 16, generator=generator))
        for parameter in worker.layers.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator)
        worker.optimizer.step()
        worker.scheduler.step()
        worker.commits += 1


def tensors_in(value):
    if isinstance(value, TaskTensor):
        return [value.tensor]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def live_storages(worker):
    live = [*worker.layers.state_dict().values(),
            *(t for state in worker.optimizer.state.values() for t in state.values() if torch.is_tensor(t))]
    return {t.untyped_storage().data_ptr() for t in live}


def reference_state(worker):
    """The state as torch's own deep copy has it (independent of the staging function)."""
    return copy.deepcopy({"layers": worker.layers.state_dict(), "optimizer": worker.optimizer.state_dict(),
                          "scheduler": worker.scheduler.state_dict(), "commits": worker.commits})


def assert_state_is(worker, expected):
    state = reference_state(worker)
    assert state["layers"].keys() == expected["layers"].keys()
    for name, tensor in expected["layers"].items():
        assert torch.equal(state["layers"][name], tensor) and state["layers"][name].dtype == tensor.dtype, name
    assert state["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert state["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()
    for key, values in expected["optimizer"]["state"].items():
        for name, value in values.items():
            got = state["optimizer"]["state"][key][name]
            assert torch.equal(got, value) and got.dtype == value.dtype and got.device == value.device, (key, name)
    assert state["scheduler"] == expected["scheduler"] and state["commits"] == expected["commits"]


def test_snapshot_tensors_share_no_storage_with_the_live_state():
    worker = stage_worker()
    train(worker, 2)
    expected = reference_state(worker)
    snapshot = worker.snapshot()
    shipped = tensors_in(snapshot)
    assert len(shipped) == len(tensors_in(worker._snapshot_state())) > 0
    assert all(t.device.type == "cpu" for t in shipped)
    assert not {t.untyped_storage().data_ptr() for t in shipped} & live_storages(worker)
    train(worker, 1)  # the live state moves on; the snapshot does not
    restored = stage_worker()
    restored.restore(pickle.loads(pickle.dumps(snapshot, protocol=5)))  # as Ray ships it
    assert_state_is(restored, expected)


def test_the_state_may_change_once_copied_is_called():
    """A commit let go by ``copied`` (it changes the weights in place) does not reach the snapshot."""
    worker = stage_worker()
    train(worker, 1)
    expected = reference_state(worker)
    snapshot = worker.snapshot(copied=lambda: train(worker, 1, seed=9))
    assert worker.commits == expected["commits"] + 1
    restored = stage_worker()
    restored.restore(pickle.loads(pickle.dumps(snapshot, protocol=5)))
    assert_state_is(restored, expected)


def test_the_copy_path_is_chosen_by_device():
    assert copy_path(torch.device("cpu")) == "host"
    assert copy_path("cuda") == copy_path(torch.device("cuda", 1)) == "cuda"


def test_a_gpu_worker_stages_on_the_cuda_path(monkeypatch):
    """The worker's snapshot goes through the one staging function, with its device, pinned
    buffers and its own side stream (recorded here: this machine has no CUDA)."""
    calls, streams = [], []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: streams.append(device) or f"stream on {device}")
    monkeypatch.setattr(checkpointing, "stage_to_host",
                        lambda state, device, buffers, stream: calls.append((device, buffers.pinned, stream))
                        or host_copy.HostCopy(state))
    worker = stage_worker()
    worker.device = torch.device("cuda", 0)
    worker.host_snapshot()
    worker.host_snapshot()
    assert calls == [(torch.device("cuda", 0), True, "stream on cuda:0")] * 2  # one stream, kept
    assert streams == [torch.device("cuda", 0)]


def test_stage_to_host_dispatches_a_cuda_device_to_the_side_stream(monkeypatch):
    seen = []
    monkeypatch.setattr(host_copy, "_stage_on_side_stream",
                        lambda state, device, buffers, stream: seen.append((device, buffers.pinned, stream)))
    stage_to_host({"w": torch.ones(2)}, "cuda:0", stream="side")
    stage_to_host({"w": torch.ones(2)}, "cpu")
    assert seen == [(torch.device("cuda", 0), True, "side")]


def pointers(state):
    return {t.data_ptr() for t in tensors_in(state)}


def test_buffers_are_used_again_once_the_last_copy_is_dropped():
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": [torch.ones(4), 7]}
    buffers = HostBuffers(pinned=False)
    first = stage_to_host(state, "cpu", buffers).wait()
    first_pointers = pointers(first)
    state["a"].add_(1)
    second = stage_to_host(state, "cpu", buffers).wait()
    assert not pointers(second) & first_pointers  # the first is still held: it keeps its memory
    assert torch.equal(first["a"], torch.arange(6.0).reshape(2, 3))  # and its values
    second_pointers = pointers(second)
    del first, second
    third = stage_to_host(state, "cpu", buffers).wait()
    assert pointers(third) == second_pointers  # dropped: used again
    assert torch.equal(third["a"], state["a"]) and torch.equal(third["b"][0], state["b"][0]) and third["b"][1] == 7
    del third
    state["a"] = torch.zeros(3)  # another shape: a buffer of its own
    fourth = stage_to_host(state, "cpu", buffers).wait()
    assert fourth["a"].shape == (3,) and torch.equal(fourth["a"], state["a"]) and len(buffers) == 2


def test_restore_copies_into_the_existing_tensors_bitwise():
    worker = stage_worker()
    train(worker, 2)
    expected = reference_state(worker)
    snapshot = pickle.loads(pickle.dumps(worker.snapshot(), protocol=5))
    train(worker, 2, seed=7)
    parameters = {name: (id(p), p.data_ptr()) for name, p in worker.layers.state_dict(keep_vars=True).items()}
    optimizer_state = {(id(p), key): (id(t), t.data_ptr()) for p, state in worker.optimizer.state.items()
                       for key, t in state.items()}
    groups = [id(group) for group in worker.optimizer.param_groups]
    worker.restore(snapshot)
    assert_state_is(worker, expected)
    assert {name: (id(p), p.data_ptr()) for name, p in worker.layers.state_dict(keep_vars=True).items()} == parameters
    assert {(id(p), key): (id(t), t.data_ptr()) for p, state in worker.optimizer.state.items()
            for key, t in state.items()} == optimizer_state
    assert [id(group) for group in worker.optimizer.param_groups] == groups


def test_restore_on_a_fresh_worker_matches_torchs_own_load():
    """No optimizer state yet: in place does not fit, torch's load places it (the same result)."""
    trained = stage_worker()
    train(trained, 3)
    saved = pickle.loads(pickle.dumps(trained.snapshot(), protocol=5))
    ours, torchs = stage_worker(), stage_worker()
    assert not load_optimizer_in_place(ours.optimizer, saved["optimizer"])
    torchs.optimizer.load_state_dict(saved["optimizer"])
    expected = reference_state(torchs)["optimizer"]
    got = reference_state(ours)["optimizer"]
    assert got["param_groups"] == expected["param_groups"]
    for key, values in expected["state"].items():
        for name, value in values.items():
            assert torch.equal(got["state"][key][name], value) and got["state"][key][name].dtype == value.dtype


@pytest.mark.parametrize("factory", [
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=False, amsgrad=True),
], ids=["adamw", "sgd-momentum", "adamw-amsgrad"])
def test_in_place_load_matches_torchs_own_load(factory):
    source, ours, torchs = stage_worker(factory), stage_worker(factory), stage_worker(factory)
    for worker in (source, ours, torchs):
        train(worker, 1, seed=3)  # every optimizer has state to copy into
    train(source, 2, seed=4)
    saved = pickle.loads(pickle.dumps(source.snapshot(), protocol=5))["optimizer"]
    assert load_optimizer_in_place(ours.optimizer, saved)
    torchs.optimizer.load_state_dict(saved)
    expected, got = torchs.optimizer.state_dict(), ours.optimizer.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    for key, values in expected["state"].items():
        for name, value in values.items():
            mine = got["state"][key][name]
            assert torch.equal(mine, value) and (mine.dtype, mine.device) == (value.dtype, value.device), (key, name)


def gpu_worker():
    scheduler = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # noqa: E731
    return StageWorker(WorkerSpec(0, 1, layers(), (0, 1, 2), raypipe.PipelineConfig(num_stages=1),
                                  optimizer_factory=adamw, scheduler_factory=scheduler,
                                  loss_fn=nn.functional.mse_loss, use_gpu=True))


def train_on_gpu(worker, steps, seed=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        with torch.no_grad():
            worker.layers[1](torch.randn(5, 16, generator=generator, device="cuda"))
        for parameter in worker.layers.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator, device="cuda")
        worker.optimizer.step()
        worker.scheduler.step()
        worker.commits += 1


@pytest.mark.gpu
def test_a_gpu_snapshot_is_pinned_host_memory_copied_on_a_side_stream_and_restores_in_place():
    worker = gpu_worker()
    train_on_gpu(worker, 2)
    saved = worker.optimizer.state_dict()["state"]
    expected = {"layers": {k: v.cpu() for k, v in worker.layers.state_dict().items()},
                "state": {k: {n: v.cpu() for n, v in state.items()} for k, state in saved.items()}}
    staged = worker.host_snapshot()
    assert staged.event is not None
    # the next step's compute may go on; its commit waits for the copy on the device
    staged.order_before(torch.cuda.current_stream())
    snapshot = staged.wait()
    shipped = tensors_in(snapshot)
    assert shipped and all(t.device.type == "cpu" for t in shipped)
    assert all(t.is_pinned() for t in shipped if t.numel())
    assert not {t.untyped_storage().data_ptr() for t in shipped} & live_storages(worker)
    for name, tensor in expected["layers"].items():
        assert torch.equal(snapshot["layers"][name], tensor), name
    snapshot = pickle.loads(pickle.dumps(worker.snapshot(), protocol=5))  # as Ray ships it
    train_on_gpu(worker, 1, seed=5)
    pointers_before = {name: p.data_ptr() for name, p in worker.layers.state_dict(keep_vars=True).items()}
    allocated = torch.cuda.memory_allocated()
    worker.restore(snapshot)
    assert torch.cuda.memory_allocated() <= allocated  # no second copy of the state on the device
    assert {name: p.data_ptr() for name, p in worker.layers.state_dict(keep_vars=True).items()} == pointers_before
    for name, tensor in expected["layers"].items():
        assert torch.equal(worker.layers.state_dict()[name].cpu(), tensor), name
    for key, values in expected["state"].items():
        for name, value in values.items():
            assert torch.equal(worker.optimizer.state_dict()["state"][key][name].cpu(), value), (key, name)
