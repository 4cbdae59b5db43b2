"""Goodput over segments of work that a failure throws away: the closed form and its Monte
Carlo, for any recovery. Pure arithmetic; no Ray, no torch. :mod:`raypipe.planning.goodput`
applies it to raypipe's heal (with and without warm spares) and to a checkpoint restart.

Work is done in segments of ``T`` wall seconds that a failure
throws away whole (what was done since the segment began is lost), each failure followed by a
recovery of ``R`` seconds (restarted if a failure strikes during it). For a failure rate
``l``, the expected wall time of one segment is, exactly (Daly 2006, eq. 11)::

    E[X] = (exp(l T) - 1) exp(l R) / l

and goodput = useful seconds of the segment / E[X].
"""
from __future__ import annotations

import math
import random


def segment_goodput(work_s: float, segment_s: float, recovery_s: float, failure_rate: float,
                    failures_during_recovery: bool = True) -> float:
    """Closed form: ``work_s`` useful seconds per segment of ``segment_s`` wall seconds, a failure
    losing the segment and costing ``recovery_s`` (rate per second). A failure during a recovery
    restarts it; with ``failures_during_recovery=False`` none strikes one (the failure clock stops),
    ``E[X] = (exp(l T) - 1)(1/l + R)`` (the two agree to first order in ``l R``)."""
    if failure_rate == 0:
        return work_s / segment_s
    if failures_during_recovery:
        expected = math.expm1(failure_rate * segment_s) * math.exp(failure_rate * recovery_s) / failure_rate
    else:
        expected = math.expm1(failure_rate * segment_s) * (1.0 / failure_rate + recovery_s)
    return work_s / expected


def simulate_segments(work_s: float, segment_s: float, recovery_s: float, failure_rate: float,
                      useful_s: float, rng: random.Random, failures_during_recovery: bool = True,
                      recovery_without_spare_s: float | None = None, spare_replenish_s: float = 0.0
                      ) -> tuple[float, int]:
    """Monte Carlo of :func:`segment_goodput`: run until ``useful_s`` seconds of work are done, one
    draw per failure; returns (goodput, failures). With ``recovery_without_spare_s``, ``recovery_s``
    is a warm spare's recovery: one spare, up at the start, whose replacement is up
    ``spare_replenish_s`` wall seconds after the heal that used it; a failure before then recovers
    in ``recovery_without_spare_s`` (the refill goes on meanwhile). The closed form with the mean
    recovery of :func:`raypipe.planning.spare_availability.spare_ready_fraction` is its long-run figure."""
    wall = done = 0.0
    failures = 0
    spare_back_at = 0.0  # wall time from which a spare is up

    def recovery_of_failure_at(moment: float) -> float:
        nonlocal spare_back_at
        if recovery_without_spare_s is None:
            return recovery_s
        if moment < spare_back_at:
            return recovery_without_spare_s
        spare_back_at = moment + recovery_s + spare_replenish_s  # its refill counts from the heal's end
        return recovery_s

    while True:
        gap = rng.expovariate(failure_rate)  # from a segment boundary (after a recovery) to the next failure
        whole = math.floor(gap / segment_s)
        if done + whole * work_s >= useful_s:
            needed = math.ceil((useful_s - done) / work_s - 1e-9)
            return (done + needed * work_s) / (wall + needed * segment_s), failures
        done += whole * work_s
        wall += gap  # the whole segments, then the lost part of the next
        failures += 1
        recovery = recovery_of_failure_at(wall)  # what is left of the recovery
        while True:  # the recovery, restarted when a failure strikes during it
            gap = rng.expovariate(failure_rate) if failures_during_recovery else math.inf
            if gap >= recovery:
                wall += recovery
                break
            wall += gap
            failures += 1
            # another worker lost: its replacement (a spare only if one is up) and the one under way
            # both have to be done, so a spare's short recovery does not cut a started process's
            recovery = max(recovery - gap, recovery_of_failure_at(wall))
