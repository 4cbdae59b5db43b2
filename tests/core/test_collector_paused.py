"""The cyclic garbage collector paused over the lowering, the dry-run and the timed run, and left
as it was found: no Ray, no torch (the planner's search: tests/planning/test_predict.py)."""
import gc

import pytest

from raypipe.core import simulator, timed_simulation
from raypipe.core.collector_paused import collector_paused
from raypipe.core.lowering import lower
from raypipe.core.schedule import PLACEMENT, interleaved_1f1b_schedule
from raypipe.core.timed_simulation import simulate_timed


def test_a_pause_turns_the_collector_off_and_back_on_even_after_an_error(collector_on):
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


def test_lowering_and_timing_a_long_schedule_run_with_the_collector_off(collector_on, monkeypatch):
    # interleaved 1F1B at p = 6, m = 9 (rounds of 9): a lowering no other test asks for, so not cached;
    # its dry-runs make ~10^5 tuples: dozens of the collector's passes, some of them full, were it on
    on_at_each = []  # whether the collector was on, at each sweep of a dry-run and each posting of the timed run
    for owner, name in ((simulator._Run, "sweep"), (timed_simulation, "_posting_end")):
        def recording(*args, _real=getattr(owner, name), **kwargs):
            on_at_each.append(gc.isenabled())
            return _real(*args, **kwargs)
        monkeypatch.setattr(owner, name, recording)
    schedule = interleaved_1f1b_schedule(6, 9, 2)
    lowered = lower(schedule, PLACEMENT["interleaved_1f1b"])
    run = simulate_timed(lowered, {"F": 1.0, "B": 2.0}, placement=PLACEMENT["interleaved_1f1b"])
    assert run.step_s > 0 and gc.isenabled()
    assert len(on_at_each) > 1000 and not any(on_at_each)
