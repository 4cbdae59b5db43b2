"""Micro-batches as task arguments and a worker's state as a task result: rebuilt
exactly (dtype, shape, values) on a real Ray worker, as writable tensors of their
own, whatever the layout."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import ray
import torch

from raypipe.comm.task_tensors import TaskTensor, TaskTensors, as_shipped_state, as_task_argument

BASE = torch.arange(60, dtype=torch.float32).reshape(6, 10)
TENSORS = {
    "float": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
    "row view of a larger batch": BASE[2:4],
    "transposed": BASE.t(),
    "column": BASE[:, 3],
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0, 5),
    "bfloat16": torch.linspace(-2, 2, 6).to(torch.bfloat16).reshape(2, 3),
    "int64 token ids": torch.arange(12).reshape(3, 4),
    "bool": torch.tensor([True, False, True]),
}


@pytest.mark.parametrize("name", TENSORS)
def test_round_trip_through_pickle(name):
    tensor = TENSORS[name]
    rebuilt = pickle.loads(pickle.dumps(as_task_argument(tensor), protocol=5))
    assert isinstance(rebuilt, torch.Tensor) and rebuilt.dtype == tensor.dtype and rebuilt.shape == tensor.shape
    torch.testing.assert_close(rebuilt, tensor, rtol=0, atol=0)


def test_a_list_round_trips_as_one_buffer():
    tensors = list(TENSORS.values())
    shipped = as_task_argument(tensors)
    assert isinstance(shipped, TaskTensors)
    rebuilt = pickle.loads(pickle.dumps(shipped, protocol=5))
    assert [(t.dtype, t.shape) for t in rebuilt] == [(t.dtype, t.shape) for t in tensors]
    for got, tensor in zip(rebuilt, tensors):
        torch.testing.assert_close(got, tensor, rtol=0, atol=0)
    rebuilt[0].add_(1)  # each tensor has its own bytes in the shared buffer
    torch.testing.assert_close(rebuilt[1], TENSORS["row view of a larger batch"], rtol=0, atol=0)


def test_a_view_ships_only_its_own_bytes():
    view = torch.zeros(1000, 100)[:2]
    assert len(pickle.dumps(as_task_argument(view), protocol=5)) < 2000
    assert len(pickle.dumps(view, protocol=5)) > 400_000  # what a plain view costs


def test_small_buffers_travel_in_the_pickle_and_large_ones_out_of_band():
    def out_of_band(value):
        buffers = []
        pickle.dumps(as_task_argument(value), protocol=5, buffer_callback=buffers.append)
        return len(buffers)

    assert out_of_band([torch.zeros(4, 64)] * 4) == 0  # 4 KiB: inside the pickle, as Ray inlines it
    assert out_of_band([torch.zeros(512, 64)] * 4) == 1  # 512 KiB: one buffer Ray maps without a copy


def test_non_tensors_pass_unchanged():
    assert as_task_argument(3) == 3 and as_task_argument(None) is None


@ray.remote
def _echo_and_modify(tensors: list) -> list:
    for tensor in tensors:
        if tensor.is_floating_point():
            tensor.add_(1)  # the worker's own copy: writable
    return [(str(t.dtype), tuple(t.shape), t.tolist()) for t in tensors]


def test_round_trip_through_a_ray_task(ray_cluster):
    tensors = list(TENSORS.values()) + [torch.randn(200, 200)]  # the last one goes through the object store
    got = ray.get(_echo_and_modify.remote(as_task_argument(tensors)))
    for tensor, (dtype, shape, values) in zip(tensors, got):
        expected = tensor + 1 if tensor.is_floating_point() else tensor
        assert dtype == str(tensor.dtype) and shape == tuple(tensor.shape)
        torch.testing.assert_close(torch.tensor(values, dtype=tensor.dtype).reshape(shape), expected,
                                   rtol=0, atol=0)
    assert isinstance(as_task_argument(tensors[0]), TaskTensor)
    [(_, _, values)] = ray.get(_echo_and_modify.remote([as_task_argument(tensors[0])]))
    torch.testing.assert_close(torch.tensor(values), tensors[0] + 1, rtol=0, atol=0)


def _optimizer_state() -> dict:
    layer = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 64, generator=torch.Generator().manual_seed(1))).sum().backward()
    optimizer.step()
    return {"layers": layer.state_dict(), "optimizer": optimizer.state_dict(), "commits": 1}


def test_a_state_round_trips_with_its_structure():
    state = _optimizer_state()
    rebuilt = pickle.loads(pickle.dumps(as_shipped_state(state), protocol=5))
    assert rebuilt["commits"] == 1 and rebuilt["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert type(rebuilt["layers"]) is type(state["layers"])  # an OrderedDict with load_state_dict's _metadata
    assert rebuilt["layers"]._metadata == state["layers"]._metadata
    for name, tensor in state["layers"].items():
        torch.testing.assert_close(rebuilt["layers"][name], tensor, rtol=0, atol=0)
    for index, per_parameter in state["optimizer"]["state"].items():
        for key, tensor in per_parameter.items():  # exp_avg, exp_avg_sq and the 0-d step
            got = rebuilt["optimizer"]["state"][index][key]
            assert got.shape == tensor.shape
            torch.testing.assert_close(got, tensor, rtol=0, atol=0)


def test_a_large_state_tensor_ships_its_own_memory_out_of_band():
    weight = torch.randn(512, 256)
    buffers = []
    pickle.dumps(as_shipped_state({"weight": weight}), protocol=5, buffer_callback=buffers.append)
    [buffer] = buffers  # no intermediate copy: the serializer reads the tensor itself
    assert np.frombuffer(buffer.raw(), dtype=np.uint8).ctypes.data == weight.data_ptr()


def test_a_state_through_the_object_store_comes_back_writable_and_its_own(ray_cluster):
    state = _optimizer_state()
    ref = ray.put(as_shipped_state(state))
    first, second = ray.get(ref), ray.get(ref)
    layer = torch.nn.Linear(64, 32)
    layer.load_state_dict(first["layers"])
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    optimizer.load_state_dict(first["optimizer"])  # keeps these tensors as its state, updated in place
    layer(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    for key, tensor in state["optimizer"]["state"][0].items():
        torch.testing.assert_close(second["optimizer"]["state"][0][key], tensor, rtol=0, atol=0)
    assert not torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])


def test_a_tensor_off_the_host_is_refused_as_a_task_tensor():
    on_device = torch.empty(2, 3, device="meta")  # a device this machine has: what a GPU tensor would meet
    for wrap in (TaskTensor, lambda tensor: TaskTensors([torch.ones(1), tensor])):
        with pytest.raises(ValueError, match="^a task tensor must be in host memory, not on meta"):
            wrap(on_device)


@pytest.mark.gpu
def test_a_gpu_tensor_ships_as_host_bytes():
    """A CUDA tensor in a state or a task argument is copied to the host before it ships:
    what arrives is a host tensor that a process without CUDA can unpickle."""
    on_gpu = torch.randn(300, 200, device="cuda")
    for shipped in (as_shipped_state({"w": on_gpu})["w"], as_task_argument(on_gpu), as_task_argument([on_gpu])):
        assert isinstance(shipped, (TaskTensor, TaskTensors))
        assert b"cuda" not in pickle.dumps(shipped, protocol=5)
        rebuilt = pickle.loads(pickle.dumps(shipped, protocol=5))
        rebuilt = rebuilt[0] if isinstance(rebuilt, list) else rebuilt
        assert rebuilt.device.type == "cpu" and torch.equal(rebuilt, on_gpu.cpu())
