"""The predictor's timed pipeline (raypipe.planning.pipeline_timing) against the timed simulation
whose figures it evaluates without the dry-run: equal to the last bit."""
import math
import random
from dataclasses import replace

import pytest

from raypipe.core.lowering import lower
from raypipe.core.simulator import ScheduleError
from raypipe.core.timed_simulation import simulate_timed
from raypipe.planning.cluster_spec import Cluster, Link
from raypipe.planning.pipeline_prediction import StageTimes, pipeline_timers, schedule_ops
from raypipe.planning.pipeline_timing import time_buffered_pipeline
from raypipe.planning.predict import StepShape


def unit_cluster(**changes) -> Cluster:
    cluster = Cluster(name="unit", peak_flops={"bf16": 1e12}, memory_bytes=10**15, memory_bandwidth_bytes_per_s=60e9,
                      gpus_per_node=8, intra_node=Link(8e9, 0.0), inter_node=Link(8e9, 0.0),
                      host_copy_bytes_per_s=8e9, achievable_fraction=1.0)
    return replace(cluster, **changes)


def _figures_of_simulate_timed(lowered, op_seconds, message_seconds):
    run = simulate_timed([list(ops) for ops in lowered], op_seconds, message_seconds, buffered_sends=True)
    num_stages = len(lowered)
    last_compute, first_wait, compute_ops = [0.0] * num_stages, [math.inf] * num_stages, 0
    for timed in run.timeline:
        if timed.op.kind in ("F", "B", "I", "W"):
            last_compute[timed.stage] = max(last_compute[timed.stage], timed.end)
            compute_ops += 1
        if any(part.kind in ("RECV_ACT", "RECV_GRAD") for part in timed.op.unbatched()):
            first_wait[timed.stage] = min(first_wait[timed.stage], timed.start)
    return run.step_s, run.busy_s, tuple(last_compute), tuple(first_wait), compute_ops


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("num_stages, num_micro_batches", [(1, 1), (1, 3), (2, 2), (3, 7), (4, 4), (5, 10), (8, 32)])
def test_the_same_figures_as_simulate_timed(schedule, num_stages, num_micro_batches):
    rng = random.Random(f"{schedule}{num_stages}{num_micro_batches}")
    lowered = lower(schedule_ops(schedule, num_stages, num_micro_batches))

    def stage_values():
        return tuple(rng.choice([0.0, rng.random(), rng.random() * 1e-3, 1 / 3]) for _ in range(num_stages))

    for recompute in ("never", "always", "except_last"):
        forward, backward_input = stage_values(), stage_values()
        backward = tuple(i + rng.random() for i in backward_input)
        times = StageTimes(forward, backward, forward if recompute != "never" else (0.0,) * num_stages,
                            tuple(rng.choice([0, 1e6, 3e8]) for _ in range(num_stages)), backward_input)
        shape = StepShape(num_stages=num_stages, num_micro_batches=num_micro_batches, schedule=schedule,
                          activation_checkpoint=recompute)
        for cluster in (unit_cluster(gpus_per_node=2, inter_node=Link(1e9, 1e-4), intra_node=Link(3e10, 1e-6)),
                        unit_cluster(gpus_per_node=3, op_overhead_s=2e-4)):
            for first_gpu in (0, 1):
                op_seconds, message_seconds = pipeline_timers(times, shape, cluster, first_gpu)
                fast = time_buffered_pipeline(lowered, op_seconds, message_seconds)
                expected = _figures_of_simulate_timed(lowered, op_seconds, message_seconds)
                assert (fast.step_s, fast.busy_s, fast.last_compute, fast.first_wait, fast.compute_ops) == expected


def test_a_deadlock_raises():
    lowered = lower(schedule_ops("gpipe", 2, 2))
    lowered[0] = [op for op in lowered[0] if op.kind != "SEND_ACT"]  # stage 1 waits for activations never sent
    with pytest.raises(ScheduleError, match="deadlock"):
        time_buffered_pipeline(lowered, lambda stage, op: 1.0, lambda sender, receiver, op: 0.5)
