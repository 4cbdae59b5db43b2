"""ZB-V's order where the paper's fixed V idles: list scheduling at unit op times. No Ray, no torch.

With F = I = W (each chunk op one unit) a ZB-V step can be no shorter than the work bound
6m + p - 1 units: every worker runs 6m chunk ops, and the last worker cannot start before the
first micro-batch's forward has crossed the p - 1 workers ahead of it. The paper's V
(:func:`raypipe.core.schedule.v_shaped_zbv`, torch's ``ScheduleZBVZeroBubble`` op for op)
reaches that bound once 2m >= 3p - 1 (:func:`raypipe.core.schedule.zbv_schedule` picks between the two). Below it the V's fixed warm-up leaves its step at
4(m + p) - 2 units: 62 against the bound's 55 at p = 8, m = 8.

:func:`list_scheduled_zbv` builds an order for those shapes by running the V's ops in unit
time, each worker taking, at each unit, the most urgent op it can run:

1. an input gradient (I), the chunk nearer the loss first (chunk 1): the backward's chain
   waits on it, worker by worker;
2. a forward (F), chunk 1 first, which carries a micro-batch on towards the loss, while the
   worker holds fewer than 2p chunk-activations (the paper's V holds at most as many);
3. a weight gradient (W), chunk 1 first: nothing waits on one, so W ops fill the units
   the others leave.

Ops of one kind and chunk run in micro-batch order, as in every schedule here. The same rule
with messages free is the timed simulator's (:func:`raypipe.core.timed_simulation.simulate_timed`
with unit op times) for the resulting order: the step it returns is that simulation's.
"""
from __future__ import annotations

import math

from raypipe.core.ops import V_SHAPED, F, I, Op, W, virtual_stage

# (kind, chunk), most urgent first
URGENCY = ((I, 1), (I, 0), (F, 1), (F, 0), (W, 1), (W, 0))
HELD_FROM_F_UNTIL_W = {F: 1, W: -1}  # an I frees part of a chunk-activation only: held until its W


def list_scheduled_zbv(num_stages: int, num_micro_batches: int) -> tuple[list[list[Op]], int]:
    """A ZB-V order for ``num_stages`` workers (two chunks each, in a V) and ``num_micro_batches``,
    list-scheduled at unit op times (see the module's docstring), and its step in those units."""
    p, m = num_stages, num_micro_batches
    stages = [[virtual_stage(worker, chunk, p, V_SHAPED) for chunk in (0, 1)] for worker in range(p)]
    completed: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, micro-batch) -> unit it completed at
    next_micro_batch = [dict.fromkeys(URGENCY, 0) for _ in range(p)]
    held = [0] * p
    schedule: list[list[Op]] = [[] for _ in range(p)]
    remaining, now = 6 * p * m, 0
    while remaining:
        chosen = []
        for worker in range(p):
            for kind, chunk in URGENCY:
                micro_batch = next_micro_batch[worker][(kind, chunk)]
                if micro_batch < m and (kind != F or held[worker] < 2 * p) and _ready(
                        kind, stages[worker][chunk], micro_batch, now, completed, 2 * p - 1):
                    chosen.append((worker, kind, chunk, micro_batch))
                    break
        if not chosen:  # every op chosen so far has completed: nothing could ever run again
            raise RuntimeError(f"list scheduling ZB-V at p={p}, m={m} stopped with {remaining} ops left")
        for worker, kind, chunk, micro_batch in chosen:
            schedule[worker].append(Op(kind, micro_batch, chunk))
            next_micro_batch[worker][(kind, chunk)] += 1
            completed[(kind, stages[worker][chunk], micro_batch)] = now + 1
            held[worker] += HELD_FROM_F_UNTIL_W.get(kind, 0)
        remaining -= len(chosen)
        now += 1
    return schedule, now


def _ready(kind: str, stage: int, micro_batch: int, now: int, completed: dict[tuple[str, int, int], int],
           last_stage: int) -> bool:
    """Whether the op's inputs are in at unit ``now``: a forward's activation from the virtual stage
    before, an input gradient's forward and the gradient from the stage after (the last stage's
    comes from its own loss), a weight gradient's input gradient."""
    def done(*key: int | str) -> bool:
        return completed.get(key, math.inf) <= now

    if kind == F:
        return stage == 0 or done(F, stage - 1, micro_batch)
    if kind == I:
        return done(F, stage, micro_batch) and (stage == last_stage or done(I, stage + 1, micro_batch))
    return done(I, stage, micro_batch)
