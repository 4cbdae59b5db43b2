"""Python's cyclic garbage collector paused over a pure computation that allocates
millions of small objects and makes no reference cycle: the lowering and dry-runs of
a schedule, the timed run, the planner's search.

The collector runs a pass each time allocations outnumber frees by a threshold (700
by default), and a full pass over every tracked object once enough have survived: a
dry-run's events, ops and postings, each a tuple, keep it passing over a heap that only
grows, all of which stays reachable and is freed by reference counting once dropped.
With the collector off in a freshly started process against on, the same code (machine J,
2026-12-07): ``make_schedule`` of interleaved 1F1B at p = 32, m = 128 took 0.75 s of CPU
against 1.37 (medians of six), the planner's search for llama3-405b on 16,384 H100s at
t = 1 6.8-8.6 s against 11.1-12.0, at the same peak memory.

gc.disable() is the interpreter's switch, for every thread: a pass another thread's
allocations would have caused waits until the pause ends (the computations here take
seconds); a pause inside a pause, or where the caller turned the collector off, leaves
it as it found it.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off for the ``with`` block, back on after it if it was on before."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
