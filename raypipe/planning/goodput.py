"""Goodput at scale: the share of wall time a run spends on useful steps when its nodes fail,
for three ways of recovering. Pure arithmetic and a seeded Monte Carlo; no Ray, no torch.

**Failures**: each node fails as a Poisson process of rate ``1 / node_mtbf_hours``, so a job
on ``n`` nodes fails at rate ``n / H`` (job MTTF ``M = H / n``). arXiv 2410.21680 (Kokolis et
al., Meta, HPCA 2025) reports a job MTTF of 7.9 h at 1,024 GPUs (128 nodes of 8):
``H = 7.9 x 128 ~ 1011`` node-hours (:data:`PAPER_NODE_MTBF_HOURS`). A failure may strike
during a recovery too.

**Segments** (methods a and b): work is done in segments of ``T`` wall seconds that a failure
throws away whole, each failure followed by a recovery of ``R`` seconds; goodput = useful
seconds of the segment / its expected wall time (Daly 2006: :mod:`raypipe.planning.segment_model`).

(a) **raypipe** (``raypipe`` / ``raypipe_warm_spare``): every ``k = snapshot_every`` steps end
with an in-memory snapshot, so a segment is ``k`` steps plus the snapshot copy's exposed part
``c`` (useful time: the ``k`` steps without it), ``k`` by default at Young's interval for ``c``,
``round(sqrt(2 c M) / step)`` and at least 1 (``raypipe plan`` predicts ``c`` with
``snapshot_every=1``); ``R = detection + replacement start + state transfer`` — the failed node's workers replaced
(a warm spare or a started process), each given its stage's state (weights + optimizer state)
over the inter-node link, the steps since the snapshot redone. Where a data-parallel sibling
holds each lost stage's state (d >= 2, no ZeRO-1, no node holding every replica), raypipe heals
from it and replays nothing (``control/controller.py``): a segment is then one step, the
snapshot's cost spread over its ``k`` steps, and only the partial step is lost.

**The snapshot keeper** (``RunShape.keeper_state_bytes``, ``keeper_copy_s``): a lost node takes
the snapshots of its workers with it, so with workers off the driver's node one keeper actor on
the driver's node copies every worker's snapshot there (``runtime/snapshot_keeper.py``), and a
new snapshot is not taken before the keeper has the one before (``control/snapshots.py``). So
snapshots are at least ``ceil(keeper_copy_s / step)`` steps apart, whatever ``k`` asks, and a
heal from a snapshot (not from a sibling) loads every worker's state from the keeper's copies
(the workers' own are tried first, and a lost node lost some of them): the state transfer is
``keeper_state_bytes`` through the driver's node's one link, not one worker's state through
its own. Both grow with the whole run's state (d copies of the weights), not a worker's:
at scale the keeper, not the snapshot's copy, sets raypipe's cadence and recovery.

(b) **full restart from a checkpoint** (``checkpoint_restart``): a blocking checkpoint of
``C`` seconds every ``tau = sqrt(2 C M)`` seconds of work (Young 1974), so ``T = tau + C``
and ``R = job relaunch + checkpoint load``. On average half an interval is lost per failure.

(c) **dropping the failed replica's step** (``replica_drop``, as torchft does): the replicas
with a GPU on the failed node drop out, the others go on after the failure is detected (the
whole job waits ``detection_s``); each dropped replica loses its partial step and rejoins at
the first step boundary after its replacement and state transfer. Expected replica-seconds
lost per failure: ``k (S + replacement + transfer)`` for ``k`` replicas on the node (the
partial step plus the wait for a boundary average one step exactly), so to first order::

    goodput = 1 - l detection - l k (S + replacement + transfer) / d

(the Monte Carlo counts a replica failing again while already out once). Needs d >= 2.

**Warm spares** (``raypipe_warm_spare``): one failure's worth of spares (a node's workers when a
node fails), whose refill comes up ``spare_replenish_s`` after the heal that used it; a failure
within that finds none and recovers as without spares. The share that finds one, and the mean
recovery of the mix the segment model takes: :mod:`raypipe.planning.spare_availability`. At real
rates (hours between failures) the spare is back for all but ~1e-4 of failures; at one every few
seconds it is not.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from raypipe.planning.segment_model import segment_goodput, simulate_segments
from raypipe.planning.spare_availability import poisson_spare_ready_fraction, spare_mixed_recovery_s

HOUR_S = 3600.0

# -- figures the defaults come from ---------------------------------------------------------

PAPER_JOB_MTTF_HOURS_AT_1024_GPUS = 7.9
"""arXiv 2410.21680 (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning
Research Clusters"): the job mean time to failure projected at 1,024 GPUs."""
PAPER_NODE_MTBF_HOURS = PAPER_JOB_MTTF_HOURS_AT_1024_GPUS * 1024 / 8
"""The per-node MTBF that gives that job MTTF on 128 nodes of 8 GPUs (~1011 h)."""

BENCH_RECOVERY_WITH_SPARE_S = 0.36
"""Seconds from SIGKILL to the hit step done with a warm spare (``spare_workers=1``), median of 8,
tiny LLaMA on 2 CPU stages, quiet: benchmarks/RESULTS.md, 2026-12-04 09:35 (``bench_recovery.py
--spares --kills 8``; 0.76 s on 2026-12-03 14:14)."""
BENCH_RECOVERY_WITHOUT_SPARE_S = 3.14
"""The same without a spare (a replacement process started), median of 8, same run (6.15 s on
2026-12-03 14:14 and 6.3 s on 2026-11-30, 3.5 s on 2026-12-01; ``bench_goodput.py``'s kills of
2026-12-04 08:17 cost 3.0 s each, this figure's)."""
BENCH_STEP_S = 0.254
"""That benchmark's tiny-LLaMA step (the step redone inside the two figures above):
benchmarks/RESULTS.md, 2026-12-02 16:34 ("254 ms a step without")."""
BENCH_SPARE_REFILL_DELAY_S = 3.0
"""``REFILL_DELAY_S`` of ``raypipe/runtime/spares.py``: a new spare starts this long after the heal
that used the last one (so that its start does not slow the step redone). Not imported from there:
this module stays free of Ray."""
BENCH_SPARE_START_S = 4.0
"""A new spare's start to up (a process, torch and ``torch._dynamo`` imported) on that 2-core CPU
while the trainer steps: a stage actor's start in CPU seconds (RESULTS.md, 2026-12-03 22:12:
3.9-4.1 s). ``bench_goodput.py --every-steps`` measured take-to-up 6.6 and 7.1 s, medians of 5 and 4
(RESULTS.md, 2026-12-04 08:17), the 7 s of :data:`BENCH_SPARE_REPLENISH_S`."""
BENCH_SPARE_REPLENISH_S = BENCH_SPARE_REFILL_DELAY_S + BENCH_SPARE_START_S
"""From a heal that used the warm spare to a new spare up: 7 s, the delay plus the start above."""
BENCH_DETECTION_S = 0.5
"""Detection of a killed worker: "well under a second" (its peers fail at once, Ray sees the
process gone): benchmarks/RESULTS.md, 2026-11-30."""


@dataclass(frozen=True)
class GoodputAssumptions:
    """What the goodput model assumes; every time in seconds. Defaults: raypipe's measured
    recovery (``bench_recovery.py`` on CPU) and common figures for checkpoint storage."""

    node_mtbf_hours: float = PAPER_NODE_MTBF_HOURS
    """Mean hours between failures of one node (its GPUs, host, NIC, software): each node fails as
    a Poisson process of rate 1/H. Default ~1011 h, from arXiv 2410.21680's 7.9 h at 1,024 GPUs."""
    gpus_per_node: int = 8
    """GPUs of a node; a node's failure takes all of them (the cluster file's ``gpus_per_node``)."""
    detection_s: float = BENCH_DETECTION_S
    """From a failure to raypipe (or a replica-dropping trainer) acting on it. Default 0.5 s: a
    killed process as measured; a hang waits for the watchdog's timeout instead."""
    replacement_with_spare_s: float = max(0.0, BENCH_RECOVERY_WITH_SPARE_S - BENCH_DETECTION_S - BENCH_STEP_S)
    """A warm spare taking a failed worker's place and the group re-formed, without the state
    transfer. Default 0 s: 0.36 s measured is less than detection and the step redone (CPU; on a GPU a spare
    also holds its CUDA context already). Only for the failures that find a spare up: see
    ``spare_replenish_s``."""
    replacement_without_spare_s: float = BENCH_RECOVERY_WITHOUT_SPARE_S - BENCH_DETECTION_S - BENCH_STEP_S
    """A replacement process started from the worker's spec (Python, torch, the stage built), without
    the transfer. Default 2.4 s = 3.14 s measured - detection - the step redone (CPU; a GPU adds its
    CUDA context and communicator set-up, seconds)."""
    spare_replenish_s: float = BENCH_SPARE_REPLENISH_S
    """From a heal that used the warm spare to its replacement spare up; a failure within it finds
    none and recovers as without spares. One failure's worth of spares is assumed. Default 7 s: the
    pool's 3 s refill delay plus ~4 s to start a spare on the CPU (6.6-7.1 s measured in all; a GPU
    adds the spare's CUDA context). At real failure rates it moves goodput by ~1e-5."""
    job_relaunch_s: float = 300.0
    """A full restart's relaunch: the scheduler requeues the job, every node starts its processes,
    the communicators form. Default 5 min, an assumption (minutes at scale), not measured here."""
    storage_bytes_per_s_per_node: float = 5e9
    """Checkpoint write and read bandwidth of one node to shared storage. Default 5 GB/s."""
    storage_bytes_per_s_total: float = 1e12
    """The storage system's aggregate bandwidth, which caps all nodes together. Default 1 TB/s
    (Llama 3's cluster reports 2 TB/s sustained over 24k GPUs)."""
    checkpoint_write_s: float | None = None
    """The blocking part of one checkpoint save; None: the model's state (weights and optimizer,
    one copy) over the storage bandwidth (the nodes' or the aggregate, the smaller)."""
    snapshot_every: int | None = None
    """raypipe's steps between in-memory snapshots; None: Young's interval for the snapshot's exposed
    copy, at least 1 (a failure redoes the steps since the last snapshot)."""
    run_hours: float | None = None
    """The simulated run's useful length; None: 2,000 job MTTFs (so ~2,000 failures)."""
    seed: int = 0
    """The Monte Carlo's seed."""

    def __post_init__(self) -> None:
        for name in ("node_mtbf_hours", "storage_bytes_per_s_per_node", "storage_bytes_per_s_total"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value!r} must be a finite number > 0")
        for name in ("detection_s", "replacement_with_spare_s", "replacement_without_spare_s", "spare_replenish_s",
                     "job_relaunch_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")
        if self.snapshot_every is not None and (not isinstance(self.snapshot_every, int) or self.snapshot_every < 1):
            raise ValueError(f"snapshot_every={self.snapshot_every!r} must be an int >= 1 (or None: Young's interval)")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node!r} must be an int >= 1")


def num_nodes(num_gpus: int, gpus_per_node: int) -> int:
    return -(-num_gpus // gpus_per_node)


def job_mttf_hours(num_gpus: int, node_mtbf_hours: float, gpus_per_node: int = 8) -> float:
    """A job's mean time to failure: ``H / nodes`` (each node a Poisson process of rate 1/H)."""
    return node_mtbf_hours / num_nodes(num_gpus, gpus_per_node)


def node_mtbf_from_job_mttf(job_mttf: float, num_gpus: int, gpus_per_node: int = 8) -> float:
    """The per-node MTBF that gives ``job_mttf`` (same unit) on ``num_gpus`` GPUs."""
    return job_mttf * num_nodes(num_gpus, gpus_per_node)


def young_interval_s(checkpoint_write_s: float, mttf_s: float) -> float:
    """Young's optimal work between checkpoints: ``sqrt(2 C M)``."""
    return math.sqrt(2.0 * checkpoint_write_s * mttf_s)


# -- replica drop (c) --------------------------------------------------------------------------

def replicas_per_node(num_replicas: int, num_stages: int, gpus_per_node: int) -> list[int]:
    """Per node, the replicas with a GPU on it (replica r on GPUs r*p .. r*p+p-1)."""
    gpus = num_replicas * num_stages
    counts = []
    for node in range(num_nodes(gpus, gpus_per_node)):
        first, last = node * gpus_per_node, min(gpus, (node + 1) * gpus_per_node) - 1
        counts.append(last // num_stages - first // num_stages + 1)
    return counts


def replica_drop_goodput(step_s: float, rejoin_s: float, detection_s: float, failure_rate: float,
                         num_replicas: int, mean_replicas_hit: float) -> float:
    """Closed form of (c) to first order (see the module docstring)."""
    return 1.0 - failure_rate * detection_s - failure_rate * mean_replicas_hit * (step_s + rejoin_s) / num_replicas


def simulate_replica_drop(step_s: float, rejoin_s: float, detection_s: float, failure_rate: float,
                          num_replicas: int, hits: Sequence[int], num_stages: int, gpus_per_node: int,
                          useful_s: float, rng: random.Random) -> tuple[float, int]:
    """Monte Carlo of (c): failures on uniformly drawn nodes; each stalls the job ``detection_s``
    (stalls queue up), the node's replicas are out from their step's start to the first step
    boundary ``rejoin_s`` of job time after the failure. Returns (goodput, failures)."""
    del hits  # the nodes are drawn here; ``hits`` is for the closed form's mean
    out_until = [0.0] * num_replicas  # job time (stalls excluded) until which each replica is out
    job = wall = stall_left = lost = 0.0
    failures = 0
    gpus = num_replicas * num_stages
    nodes = num_nodes(gpus, gpus_per_node)
    while job < useful_s:
        gap = rng.expovariate(failure_rate)
        wall += gap
        stalled = min(gap, stall_left)
        stall_left -= stalled
        job += gap - stalled
        failures += 1
        stall_left += detection_s
        node = rng.randrange(nodes)
        first, last = node * gpus_per_node, min(gpus, (node + 1) * gpus_per_node) - 1
        step_start = math.floor(job / step_s) * step_s
        back = math.ceil((job + rejoin_s) / step_s - 1e-12) * step_s
        for replica in range(first // num_stages, last // num_stages + 1):
            start = max(step_start, out_until[replica])
            if back > start:
                lost += back - start
                out_until[replica] = back
    # the last gap overshoots: count the run to its end, replicas out past it included up to it
    overshoot = sum(max(0.0, until - job) for until in out_until)
    useful = num_replicas * job - (lost - overshoot)
    return useful / (num_replicas * (wall + stall_left)), failures


# -- a configuration's goodput ---------------------------------------------------------------------

@dataclass(frozen=True)
class RunShape:
    """What goodput needs of a configuration: its step, its replicas and stages, and its state."""

    num_gpus: int
    num_replicas: int
    num_stages: int
    step_s: float  # the predicted (or measured) step, its exposed snapshot copy included
    snapshot_exposed_s: float  # the part of step_s that raypipe's per-step snapshot adds
    largest_worker_state_bytes: float  # one worker's weights + optimizer state (what a replacement receives)
    model_state_bytes: float  # one copy of the whole model's weights + optimizer state (what a checkpoint holds)
    inter_node_bytes_per_s: float  # per GPU, to another node
    shard_optimizer: bool = False  # ZeRO-1: replicas hold different optimizer parts (no healing from a sibling)
    # one snapshot of every worker (every replica's weights, all optimizer state), which the snapshot keeper
    # copies onto the driver's node and a heal from a snapshot loads back from there; 0: no keeper
    keeper_state_bytes: float = 0.0
    keeper_copy_s: float = 0.0  # the keeper's copy of one snapshot; the next snapshot waits for it


@dataclass(frozen=True)
class MethodGoodput:
    """One recovery method's goodput: simulated (Monte Carlo) and closed form."""

    method: str
    goodput: float | None  # simulated; None where the method does not apply
    closed_form: float | None
    downtime_per_failure_s: float | None  # the recovery R (a warm spare's: its mean), replica_drop: a rejoin
    failures_simulated: int
    save_interval_s: float | None = None  # work between saves: snapshots (raypipe) or checkpoints
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


METHODS = ("raypipe_warm_spare", "raypipe", "checkpoint_restart", "replica_drop")


def checkpoint_write_s(shape: RunShape, assumptions: GoodputAssumptions) -> float:
    """The blocking save: the model's state over the smaller of the nodes' and the aggregate bandwidth."""
    if assumptions.checkpoint_write_s is not None:
        return assumptions.checkpoint_write_s
    nodes = num_nodes(shape.num_gpus, assumptions.gpus_per_node)
    bandwidth = min(nodes * assumptions.storage_bytes_per_s_per_node, assumptions.storage_bytes_per_s_total)
    return shape.model_state_bytes / bandwidth


def raypipe_snapshot_every(shape: RunShape, mttf_s: float, assumptions: GoodputAssumptions) -> int:
    """Steps between raypipe's snapshots: the assumption's, or Young's interval for the exposed copy,
    and never fewer than the keeper's copy of one snapshot lasts (:func:`keeper_snapshot_every`)."""
    plain_step = shape.step_s - shape.snapshot_exposed_s
    if assumptions.snapshot_every is not None:
        asked = assumptions.snapshot_every
    elif shape.snapshot_exposed_s <= 0:
        asked = 1
    else:
        asked = max(1, round(young_interval_s(shape.snapshot_exposed_s, mttf_s) / plain_step))
    return max(asked, keeper_snapshot_every(shape))


def keeper_snapshot_every(shape: RunShape) -> int:
    """The fewest steps between two snapshots that the keeper allows: a new one waits until the keeper
    has copied the one before (``keeper_copy_s``), and the steps run on meanwhile. 1 without a keeper."""
    plain_step = shape.step_s - shape.snapshot_exposed_s
    return max(1, math.ceil(shape.keeper_copy_s / plain_step - 1e-9))


STRAGGLER_POLICIES = ("report", "replace", "rebalance")  # ``on_slow``'s values


def straggler_goodput(shape: RunShape, assumptions: GoodputAssumptions, slow_share: float, slow_factor: float,
                      slow_steps: int = 10, run_hours: float = 24.0, can_rebalance: bool = True
                      ) -> dict[str, float | None]:
    """Goodput (the share of the unslowed pace) of a run whose nodes are each, independently, slow
    by ``slow_factor`` with probability ``slow_share`` for the whole run (a persistent straggler:
    a throttled GPU, a bad NIC), under each policy of :data:`STRAGGLER_POLICIES` over ``run_hours``.

    A slow node slows every worker on it, and a pipeline runs at the pace of its slowest stage (the
    replicas wait for each other at the reduction): with any slow node the whole step takes
    ``slow_factor`` times as long. ``report`` keeps that pace: ``(1 - P) + P / f`` in expectation,
    ``P = 1 - (1 - share)^nodes``. ``replace`` finds each slow node's workers after ``slow_steps``
    slow steps and swaps them for warm spares (a heal's replacement with a spare and its state
    transfer, no step redone): each of the ``share x nodes`` slow nodes costs
    ``slow_steps x step x (f - 1) + swap`` once; a spare is assumed healthy. ``rebalance`` pays the
    same slow steps and a restart of every worker in its bundle (a replacement without a spare and
    the state transfer) once per slow node, and then runs at :func:`rebalanced_pace` for the
    ``k = min(p, gpus_per_node)`` stages a slow node holds (in stage slots at t > 1) (as if the slow nodes' stages were one
    node's: the likely case while ``share x nodes`` is small); None where raypipe does not rebalance
    (``can_rebalance`` False: model chunks)."""
    if not 0 <= slow_share <= 1:
        raise ValueError(f"slow_share={slow_share!r} must be in [0, 1]")
    if not slow_factor >= 1:
        raise ValueError(f"slow_factor={slow_factor!r} must be >= 1")
    nodes = num_nodes(shape.num_gpus, assumptions.gpus_per_node)
    any_slow = 1 - (1 - slow_share) ** nodes
    report = (1 - any_slow) + any_slow / slow_factor
    transfer_s = shape.largest_worker_state_bytes / shape.inter_node_bytes_per_s
    swap_s = assumptions.detection_s + assumptions.replacement_with_spare_s + transfer_s
    slow_s = slow_steps * shape.step_s * (slow_factor - 1)
    run_s = run_hours * HOUR_S
    lost_s = slow_share * nodes * (slow_s + swap_s)
    out: dict[str, float | None] = {"report": report, "replace": run_s / (run_s + lost_s), "rebalance": None}
    if can_rebalance:
        restart_s = assumptions.detection_s + assumptions.replacement_without_spare_s + transfer_s
        pace = rebalanced_pace(shape.num_stages, min(shape.num_stages, assumptions.gpus_per_node), slow_factor)
        lost_s = slow_share * nodes * (slow_s + restart_s)
        out["rebalance"] = ((1 - any_slow) + any_slow * pace) * run_s / (run_s + lost_s)
    return out


def rebalanced_pace(num_stages: int, stages_slowed: int, slow_factor: float) -> float:
    """The share of the unslowed pace once the layers moved away from ``stages_slowed`` of ``num_stages``
    stages slowed ``slow_factor`` times: with layers as finely divisible, each slow stage keeps ``1/f`` of a
    well stage's work and every stage takes the same time, ``(p - k + k/f) / p``; ``1/f`` when every stage
    is slowed (a whole replica slowed alike: no worker is blamed)."""
    if stages_slowed >= num_stages:
        return 1 / slow_factor
    return (num_stages - stages_slowed + stages_slowed / slow_factor) / num_stages


def goodput_by_method(shape: RunShape, assumptions: GoodputAssumptions) -> dict[str, MethodGoodput]:
    """Goodput of each method of :data:`METHODS` for ``shape`` (see the module docstring)."""
    mttf_s = job_mttf_hours(shape.num_gpus, assumptions.node_mtbf_hours, assumptions.gpus_per_node) * HOUR_S
    rate = 1.0 / mttf_s
    useful_s = (assumptions.run_hours * HOUR_S) if assumptions.run_hours else 2000 * mttf_s
    transfer_s = shape.largest_worker_state_bytes / shape.inter_node_bytes_per_s
    plain_step = shape.step_s - shape.snapshot_exposed_s
    out = {}
    every = raypipe_snapshot_every(shape, mttf_s, assumptions)
    hits = replicas_per_node(shape.num_replicas, shape.num_stages, assumptions.gpus_per_node)
    from_sibling = shape.num_replicas > 1 and not shape.shard_optimizer and max(hits) < shape.num_replicas
    if from_sibling:  # one step lost at most; the snapshot (a fallback) costs its share of each step
        work, segment = plain_step, plain_step + shape.snapshot_exposed_s / every
        heal_transfer_s = transfer_s  # each lost worker's state from a sibling, over its own link
    else:  # the steps since the snapshot are redone, every worker's state loaded from the keeper's copies
        work, segment = every * plain_step, every * plain_step + shape.snapshot_exposed_s
        heal_transfer_s = max(transfer_s, shape.keeper_state_bytes / shape.inter_node_bytes_per_s)
    keeper_note = (f" (the keeper's copy of one snapshot {shape.keeper_copy_s:.3g} s: at least "
                   f"{keeper_snapshot_every(shape)})" if shape.keeper_copy_s > 0 else "")
    with_spare = assumptions.detection_s + assumptions.replacement_with_spare_s + heal_transfer_s
    without_spare = assumptions.detection_s + assumptions.replacement_without_spare_s + heal_transfer_s
    ready = poisson_spare_ready_fraction(rate, assumptions.spare_replenish_s, with_spare, without_spare)
    for method, recovery, spare in (("raypipe_warm_spare", with_spare, True), ("raypipe", without_spare, False)):
        # the same failure stream for both (common random numbers): they differ only by the recovery
        rng = random.Random(f"{assumptions.seed}:raypipe")
        simulated, failures = simulate_segments(
            work, segment, recovery, rate, useful_s, rng,
            recovery_without_spare_s=without_spare if spare else None, spare_replenish_s=assumptions.spare_replenish_s)
        mean_recovery = spare_mixed_recovery_s(ready, with_spare, without_spare) if spare else recovery
        out[method] = MethodGoodput(method, simulated, segment_goodput(work, segment, mean_recovery, rate),
                                    mean_recovery, failures, work,
                                    f"{'from a sibling, ' if from_sibling else ''}snapshot_every={every}"
                                    f"{keeper_note}, transfer {heal_transfer_s:.3g} s"
                                    + (f", a spare up for {ready:.4%} of failures" if spare else ""))
    write = checkpoint_write_s(shape, assumptions)
    load = write  # read back at the same bandwidth
    tau = max(young_interval_s(write, mttf_s), plain_step)
    restart = assumptions.job_relaunch_s + load
    rng = random.Random(f"{assumptions.seed}:checkpoint_restart")
    simulated, failures = simulate_segments(tau, tau + write, restart, rate, useful_s, rng)
    out["checkpoint_restart"] = MethodGoodput(
        "checkpoint_restart", simulated, segment_goodput(tau, tau + write, restart, rate), restart, failures, tau,
        f"checkpoint {write:.3g} s every {tau / 60:.3g} min")
    if shape.num_replicas < 2:
        out["replica_drop"] = MethodGoodput("replica_drop", None, None, None, 0, None, "needs >= 2 replicas")
        return out
    rejoin = assumptions.replacement_without_spare_s + transfer_s
    rng = random.Random(f"{assumptions.seed}:replica_drop")
    simulated, failures = simulate_replica_drop(plain_step, rejoin, assumptions.detection_s, rate,
                                                shape.num_replicas, hits, shape.num_stages,
                                                assumptions.gpus_per_node, useful_s, rng)
    mean_hit = sum(hits) / len(hits)
    note = f"{mean_hit:.3g} of {shape.num_replicas} replicas out per failure"
    if max(hits) >= shape.num_replicas:
        note += "; a node holds every replica: the job stops (a full restart in practice)"
    out["replica_drop"] = MethodGoodput(
        "replica_drop", simulated, replica_drop_goodput(plain_step, rejoin, assumptions.detection_s, rate,
                                                        shape.num_replicas, mean_hit), rejoin, failures,
        plain_step, note)
    return out
