"""Micro-batches as task arguments: rebuilt exactly (dtype, shape, values) on a
real Ray worker, as writable tensors of their own, whatever the layout."""
from __future__ import annotations

import pickle

import pytest
import ray
import torch

from raypipe.comm.task_tensors import TaskTensor, TaskTensors, as_task_argument

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
