"""The stage's GPU is the one Ray assigned, as torch numbers the visible devices."""
import pytest
import torch

from raypipe.stage.device import local_cuda_index, stage_device


@pytest.mark.parametrize(("gpu_ids", "visible", "index"), [
    ([], None, None),  # no GPU assigned: keep torch's current device
    ([], "3", None),
    ([3], "3", 0),  # Ray narrowed CUDA_VISIBLE_DEVICES to the actor's GPU: torch sees it as 0
    (["3"], "3", 0),  # ids are strings when the node's CUDA_VISIBLE_DEVICES was set before Ray
    ([5], "2,5,7", 1),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the id's place in the list
    ([5, 7], " 2, 5 ,7", 1),  # two GPUs: the first; spaces tolerated
    ([2], None, 2),  # every GPU visible: the id is the index
    (["GPU-8f2a"], "GPU-1c3d,GPU-8f2a", 1),  # UUIDs
])
def test_local_index_is_the_ids_place_among_the_visible_devices(gpu_ids, visible, index):
    assert local_cuda_index(gpu_ids, visible) == index


def test_a_gpu_this_process_cannot_see_is_named():
    with pytest.raises(RuntimeError, match=r"^Ray assigned GPU '4', which is not among CUDA_VISIBLE_DEVICES"):
        local_cuda_index([4], "0,1")
    with pytest.raises(RuntimeError, match=r"^Ray assigned GPU 'GPU-8f2a', which is not an index"):
        local_cuda_index(["GPU-8f2a"], None)


def test_a_cpu_stage_computes_on_the_cpu():
    assert stage_device(False) == torch.device("cpu")


@pytest.mark.gpu
def test_a_gpu_stage_outside_ray_keeps_the_current_device():
    device = stage_device(True)
    assert device == torch.device("cuda", torch.cuda.current_device())
