"""Seeded faults of tensor-parallel ranks mid-step, each healed bitwise (run by
tests/executor/test_tensor_parallel_faults.py: (1, 2, 2) on the session's Ray instance;
(2, 2, 2), eight workers, more than that instance has CPUs for, in a subprocess with a Ray
instance of its own: ``python -m tests.executor.tp_kills_run OUT.json REPLICAS [R,S,T]``,
R,S,T the worker hung).

One trainer of ``REPLICAS`` replicas of two stages at t = 2 runs two steps, then one step per
fault: in each, one worker drawn from every (replica, stage, tp_rank) by a seeded generator
gets a signal after a seeded fraction of a step's time (a ``threading.Timer``, as a machine
fails while the step runs): SIGKILL :data:`KILLS` times, then SIGSTOP (a hang) of a given worker.
The test compares each step's loss and norm and the final state with the same layout's
uninterrupted run (:class:`tests.gloo_pipeline.GlooPipeline`) bit for bit. Writes what it
checks as JSON, with where each fault landed (the step that healed it and its failure events).
The optimizer, the batches and the one-process reference serve the tensor-parallel runs on
multi-node clusters too (tp_node_loss_run.py, tp_elastic_run.py).
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

import raypipe
from raypipe.models.layers import build_layer
from raypipe.models.llama import llama_layers, llama_loss
from tests.executor.cluster_run import as_lists
from tests.reference import reference_step

KILLS, SEED = 6, 60
CLEAN_STEPS = 2  # before the faults: the second one's time is a step's (the first's has first-time costs)
BATCH, SEQ_LEN = 4, 8  # 2 micro-batches per replica; the sequence divides by t = 2 (sequence parallel)


@dataclass(frozen=True)
class Fault:
    """``signal_name`` sent to worker ``place`` (replica, stage, tp_rank) ``fraction`` of a step's
    time into step ``step``."""

    step: int
    place: tuple[int, int, int]
    fraction: float
    signal_name: str = "SIGKILL"


def config(replicas: int, **fields) -> raypipe.PipelineConfig:
    """(replicas, 2, 2), 1f1b, sequence parallel, clipping, a hang detected after 5 s; ``fields`` on top."""
    return raypipe.PipelineConfig(num_stages=2, num_micro_batches=2, num_replicas=replicas, schedule="1f1b",
                                  tensor_parallel=2, clip_grad_norm=0.5, hang_timeout_s=5.0, max_failures=None,
                                  **fields)


def adamw(params) -> torch.optim.AdamW:
    """AdamW with state that must carry over every heal (the tensor-parallel tests' eps)."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-3)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    tokens = [torch.randint(0, 259, (BATCH, SEQ_LEN + 1), generator=generator) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def one_process(config: raypipe.PipelineConfig, steps: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """The reference of the runs that change layout: ``steps`` of the same layers (the per-layer
    seeding builds the same initial weights), unsplit, in this process, each a global batch over
    ``config``'s micro-batches of a step (tests/reference.py's loop); each step's (loss, norm
    before clipping) and the final state."""
    model = nn.Sequential(*(build_layer(spec, index, config.seed) for index, spec in enumerate(llama_layers("tiny"))))
    optimizer = adamw(model.parameters())
    results = [reference_step(model, optimizer, llama_loss, x, y, config.micro_batches_per_step, config.clip_grad_norm)
               for x, y in steps]
    return results, model.state_dict()


def seeded_faults(replicas: int, stopped: tuple[int, int, int] | None = None) -> list[Fault]:
    """One fault a step from step :data:`CLEAN_STEPS` on, each at a seeded moment: :data:`KILLS`
    SIGKILLs of seeded places, then a SIGSTOP of worker ``stopped`` (if given)."""
    generator = random.Random(SEED * 10 + replicas)
    places = [(replica, stage, tp_rank) for replica in range(replicas) for stage in range(2) for tp_rank in range(2)]
    faults = [Fault(CLEAN_STEPS + index, generator.choice(places), generator.random()) for index in range(KILLS)]
    if stopped is not None:
        faults.append(Fault(CLEAN_STEPS + KILLS, stopped, generator.random(), "SIGSTOP"))
    return faults


def steps_of(faults: list[Fault]) -> int:
    """The steps of a run with ``faults``: up to the step after the last one's (a fault landing
    after its step's end is healed in the next)."""
    return max(fault.step for fault in faults) + 2


def _signal(pid: int, signum: int) -> None:
    """``os.kill``, where the victim may be gone already: a heal of the fault before (landed late,
    in this step) replaced it before its moment came."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def train(config: raypipe.PipelineConfig, faults: list[Fault]) -> dict:
    """The run with ``faults``; each fault's delay is its fraction of step 1's wall time (step 1
    has no fault; a step's time on the driver, so a late fault may land in the step's snapshot or
    just after it, where it is healed as well)."""
    by_step = {fault.step: fault for fault in faults}
    record: dict = {"steps": [], "step_seconds": [], "hits": []}
    with raypipe.PipelineTrainer(llama_layers("tiny"), llama_loss, adamw, config) as trainer:
        for step, (x, y) in enumerate(batches(steps_of(faults))):
            fault, timer = by_step.get(step), None
            if fault is not None:
                victim = next(worker for worker in trainer.workers
                              if (worker.replica, worker.stage, worker.tp_rank) == fault.place)
                delay = fault.fraction * record["step_seconds"][1]
                timer = threading.Timer(delay, _signal, (victim.pid, getattr(signal, fault.signal_name)))
                timer.start()
            start = time.monotonic()
            result = trainer.step(x, y)
            seconds = time.monotonic() - start
            record["step_seconds"].append(seconds)
            record["steps"].append([result.loss, result.grad_norm])
            if timer is not None:
                timer.join()
                record["hits"].append({"step": step, "place": fault.place, "signal": fault.signal_name,
                                       "delay_s": delay, "pid": victim.pid,
                                       "failures": result.failures})
        record["failures"] = trainer.failures
        record["sources"] = [recovered.source for recovered in trainer.recoveries]
        record["pids_at_end"] = [worker.pid for worker in trainer.workers]
        record["state"] = as_lists(trainer.state_dict())
    return record


def main(out: str, replicas: int, stopped: tuple[int, int, int] | None) -> None:
    """The run of ``replicas`` with :data:`KILLS` kills and a hang of ``stopped`` on a Ray instance of
    its own, a CPU per worker."""
    import json

    import ray
    from ray import cloudpickle

    import tests.executor.tp_kills_run as this
    from raypipe.runtime.cluster import LOCAL_SYSTEM_CONFIG

    cloudpickle.register_pickle_by_value(this)  # the workers cannot import the tests
    ray.init(address="local", num_cpus=4 * replicas, include_dashboard=False, logging_level="WARNING",
             _system_config=LOCAL_SYSTEM_CONFIG)
    try:
        record = train(config(replicas), seeded_faults(replicas, stopped))
    finally:
        ray.shutdown()
    with open(out, "w") as file:
        json.dump(record, file)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), tuple(map(int, sys.argv[3].split(","))) if len(sys.argv) > 3 else None)
