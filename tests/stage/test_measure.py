"""What a stage holds for backward: metered on a stage's first step (and every SAVED_BYTES_EVERY-th,
and for a new shape), recalled in between, the same figure either way (no Ray: the step runner in
one process)."""
import pytest
import torch
from torch import nn

import raypipe
from raypipe.stage import measure
from tests.reference import in_process, make_mlp, random_batches


class CountedMeter(measure.SavedTensorMeter):
    made = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CountedMeter.made += 1


@pytest.fixture
def counted(monkeypatch):
    monkeypatch.setattr(measure, "SavedTensorMeter", CountedMeter)
    CountedMeter.made = 0
    return CountedMeter


def held_bytes(batches, activation_checkpoint="never", schedule="gpipe"):
    """Each step's held-for-backward bytes per stage, and the meters made by the end of each step."""
    config = raypipe.PipelineConfig(num_stages=2, num_micro_batches=4, schedule=schedule,
                                    activation_checkpoint=activation_checkpoint)
    held, meters = [], []
    with in_process(list(make_mlp()), nn.MSELoss(), lambda params: torch.optim.SGD(params, lr=0.1), config) as trainer:
        for inputs, targets in batches:
            held.append([stage.held_for_backward_bytes for stage in trainer.step(inputs, targets).stages])
            meters.append(CountedMeter.made)
    return held, meters


@pytest.mark.parametrize("activation_checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_held_bytes_are_metered_on_the_first_step_and_recalled_after(counted, activation_checkpoint, schedule):
    held, meters = held_bytes(random_batches(8, steps=3), activation_checkpoint, schedule)
    assert all(bytes_ > 0 for bytes_ in held[0])
    assert held[1] == held[2] == held[0]
    assert meters[0] > 0 and meters[2] == meters[1] == meters[0]  # no hook on a saved tensor after the first step


def test_held_bytes_are_metered_again_every_saved_bytes_every_steps(counted, monkeypatch):
    monkeypatch.setattr(measure, "SAVED_BYTES_EVERY", 2)
    held, meters = held_bytes(random_batches(8, steps=4))
    assert meters[1] == meters[0] and meters[2] == 2 * meters[0] and meters[3] == meters[2]
    assert held == [held[0]] * 4


def test_a_new_shape_is_metered_at_once(counted):
    """Micro-batches of another size hold other bytes: measured on the step they come, as a new worker measures."""
    small, large = random_batches(8, steps=1), random_batches(16, steps=1)
    held, _ = held_bytes(small + large + small)
    alone, _ = held_bytes(large)
    assert held[1] == alone[0] != held[0]
    assert held[2] == held[0]


def test_the_resident_set_is_this_process_own_read_again_in_a_forked_child():
    """rss_bytes() reads /proc/self/statm on a descriptor it keeps: psutil's figure, and a forked
    child (the gloo harness forks stage processes) opens and reads its own file, not its parent's."""
    import gc
    import os

    import psutil

    assert measure.rss_bytes() == pytest.approx(psutil.Process().memory_info().rss, rel=0.05)
    grown = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched: resident in this process
    parent = measure.rss_bytes()
    assert parent >= 64 * 2**20
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child frees the 64 MiB its copy of the parent holds, then reads its own figure
        try:
            del grown  # nothing is imported in the child: another thread may have held the import lock at the fork
            gc.collect()
            own = measure.rss_bytes()
            os.write(write, f"{own} {psutil.Process().memory_info().rss} {measure._statm[0] == os.getpid()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    own, by_psutil, reopened = os.read(read, 200).decode().split()
    os.waitpid(child, 0)
    assert reopened == "True" and int(own) == pytest.approx(int(by_psutil), rel=0.05)
    del grown
