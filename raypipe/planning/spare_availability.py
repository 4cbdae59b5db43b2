"""Whether a warm spare is up when a failure comes: the share of failures that find one and the
mean recovery of that mix, for Poisson failures and for a benchmark's one kill per block of steps.
Pure arithmetic; no Ray, no torch.

One failure's worth of spares (a node's workers when a node fails); a failure that uses it has its
replacement's refill come up ``T_replenish`` seconds after that heal (``raypipe/runtime/spares.py``:
a new spare starts ``REFILL_DELAY_S`` after the heal, then its process starts). A failure finds a
spare only if the last failure that used one was that long ago; one that finds none recovers as
without spares (``raypipe``) and leaves the refill going. Per use of the spare, ``m`` failures find
none on average (the failures within the refill), so a share ``1 / (1 + m)`` of failures finds one
(renewal-reward, :func:`spare_ready_fraction`), and the segment model
(:mod:`raypipe.planning.segment_model`) takes the mean recovery of that mix
(:func:`spare_mixed_recovery_s`). For Poisson failures with the clock running in recoveries, ``m = l
(R_spare + T_replenish)`` exactly (Erlang's loss formula for one server; more spare sets would be
Erlang B, not modelled). The mean recovery is exact in the form where the clock stops in recoveries;
where it runs, failures during a recovery find the spare gone or back, which the mean in ``exp(l
R)`` does not see, so it is right to first order in ``l R`` (the Monte Carlo, which draws each
failure's spare, reads 0.4 point higher at a failure every 20 s, 3 points at one every 6 s; the same
at real rates). At real rates (hours between failures) the spare is back for all but ~1e-4 of
failures; at one every few seconds it is not.
"""
from __future__ import annotations

import math
from collections.abc import Callable

FailuresWithin = Callable[[int, float], float]
"""``(k, t)`` -> the chance that the ``k``-th failure after one that used the spare comes within
``t`` seconds of failure clock after that failure's recovery."""


def poisson_failures_within(failure_rate: float) -> FailuresWithin:
    """Poisson failures: the ``k``-th within ``t`` is Poisson(``l t``) >= k (a gamma's CDF)."""
    def within(k: int, t: float) -> float:
        mean = failure_rate * t
        if mean <= 0:
            return 0.0
        # 1 - P(fewer than k in t), the terms summed in log space so a large mean does not underflow
        fewer = sum(math.exp(-mean + j * math.log(mean) - math.lgamma(j + 1)) for j in range(k))
        return max(0.0, 1.0 - fewer)
    return within


def block_failures_within(block_s: float) -> FailuresWithin:
    """One failure per block of ``block_s`` seconds at a uniform moment in it (bench_goodput's
    ``--every-steps``): failure ``i`` at ``(i + U_i) block_s``, so ``k`` failures on, the gap is
    ``(k + U_k - U_0) block_s``, the difference of two uniforms being triangular on [-1, 1]. For
    k = 1 the interval is triangular on [0, 2 block_s] with mode ``block_s``: its chance to exceed
    ``t`` is ``1 - t^2 / (2 a^2)`` for ``t <= a`` and ``(2a - t)^2 / (2 a^2)`` above (``a = block_s``).
    Treats the failure that used the spare as any failure (its phase ``U_0`` uniform), whereas one
    that found a spare followed a longer interval, so tends to sit late in its block and the next
    interval to be short: that biases the ready share up, by 2.6 points at bench_goodput's K = 20
    with a 7 s refill (0.622 against 0.596 in a long simulation of that kill process; a 200-step
    run, whose first kill always finds the spare, reads 0.620)."""
    def within(k: int, t: float) -> float:
        x = t / block_s - k  # where t falls in the triangular spread of U_k - U_0
        if x <= -1:
            return 0.0
        if x <= 0:
            return (1 + x) ** 2 / 2
        if x <= 1:
            return 1 - (1 - x) ** 2 / 2
        return 1.0
    return within


def spare_ready_fraction(replenish_s: float, failures_within: FailuresWithin,
                         recovery_without_spare_s: float = 0.0) -> float:
    """The long-run share of failures that find a warm spare up, with one spare (one failure's
    worth) whose replacement is up ``replenish_s`` after the heal that used it (see the module
    docstring). Between two uses, the failures that find none are the ``k``-th after the use for
    every ``k`` that comes before the refill is up: each such failure's recovery (without a spare,
    ``recovery_without_spare_s``) lets the refill go on while the failure clock stops, so the
    ``k``-th misses if it comes within ``replenish_s - (k - 1) recovery_without_spare_s`` of clock.
    With ``m`` such misses per use on average, the share is ``1 / (1 + m)`` (renewal-reward; exact
    for Poisson failures). Where the failure clock runs in recoveries, pass 0 for
    ``recovery_without_spare_s`` and the spare's own recovery added to ``replenish_s``:
    ``m = l (R_spare + T_replenish)``."""
    if replenish_s <= 0:
        return 1.0
    misses, k = 0.0, 1
    while k <= 1_000_000:
        window = replenish_s - (k - 1) * recovery_without_spare_s
        chance = failures_within(k, window) if window > 0 else 0.0
        if chance < 1e-12:  # later failures come later still, and their windows only shrink
            break
        misses += chance
        k += 1
    return 1.0 / (1.0 + misses)


def poisson_spare_ready_fraction(failure_rate: float, replenish_s: float, recovery_with_spare_s: float,
                                 recovery_without_spare_s: float, failures_during_recovery: bool = True) -> float:
    """:func:`spare_ready_fraction` for Poisson failures at ``failure_rate``. With the failure clock
    running in recoveries (the scale model's), ``1 / (1 + l (R_spare + T_replenish))``; stopped
    (bench_goodput's kills), the refill goes on through the recoveries without a spare."""
    if failures_during_recovery:
        return 1.0 / (1.0 + failure_rate * (recovery_with_spare_s + replenish_s))
    return spare_ready_fraction(replenish_s, poisson_failures_within(failure_rate), recovery_without_spare_s)


def spare_mixed_recovery_s(ready_fraction: float, recovery_with_spare_s: float,
                           recovery_without_spare_s: float) -> float:
    """A failure's mean recovery when a share ``ready_fraction`` of failures finds a spare up."""
    return ready_fraction * recovery_with_spare_s + (1.0 - ready_fraction) * recovery_without_spare_s
