"""The cyclic garbage collector paused over the lowering, the dry-run, the timed run and the
planner's search, and left as it was found: no Ray, no torch."""
import gc

import pytest

from raypipe.core.collector_paused import collector_paused
from raypipe.core.lowering import lower
from raypipe.core.schedule import PLACEMENT, interleaved_1f1b_schedule
from raypipe.core.timed_simulation import simulate_timed


@pytest.fixture
def passes():
    """The collector's passes while the test runs (gc.callbacks), the collector on to start with."""
    started = []

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])

    was_on = gc.isenabled()
    gc.enable()
    gc.callbacks.append(count)
    yield started
    gc.callbacks.remove(count)
    if not was_on:
        gc.disable()


def test_a_pause_turns_the_collector_off_and_back_on_even_after_an_error(passes):
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # a pause inside a pause leaves it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), collector_paused():
        1 / 0
    assert gc.isenabled()
    gc.disable()  # where the caller turned it off, it stays off
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_lowering_and_timing_a_long_schedule_make_no_collector_pass_on_the_way(passes):
    # interleaved 1F1B at p = 6, m = 9 (rounds of 9): a lowering no other test asks for, so not cached;
    # its dry-runs make ~10^5 tuples: dozens of passes, some of them full, with the collector left on
    schedule = interleaved_1f1b_schedule(6, 9, 2)
    gc.collect()  # the schedule's own ops are built with the collector on: its counts start afresh
    passes.clear()
    lowered = lower(schedule, PLACEMENT["interleaved_1f1b"])
    run = simulate_timed(lowered, {"F": 1.0, "B": 2.0}, placement=PLACEMENT["interleaved_1f1b"])
    assert run.step_s > 0 and gc.isenabled()
    # at most the one young pass each pause's end lets run (the allocations counted meanwhile)
    assert len(passes) <= 2 and set(passes) <= {0}, passes
