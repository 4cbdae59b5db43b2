"""raypipe vs torch.distributed.pipelining + DTensor tensor parallelism (what torchtitan
composes) on the same LLaMA, stages, t and micro-batches, CPU over gloo.

The model is :func:`raypipe.models.llama.llama_layers` of a small LLaMA (default: vocabulary
1024, dim 256, 4 blocks of 8 heads, FFN 704; batch 8 x 128 tokens, m = 4: a step of
~0.3 s of compute in one process), cut into p = 2 stages of equal layer counts (embedding
+ 2 blocks, 2 blocks + head), each stage split over t = 2 tensor-parallel ranks with
sequence parallelism (raypipe's default at t > 1): 4 processes on each side, fp32, AdamW,
one torch thread per process. Both sides build every layer with
``raypipe.models.layers.build_layer(spec, index, seed=0)`` (the same initial weights in every
process) and split it with ``raypipe.models.tensor_parallel.parallelize_layer`` and the
layer spec's ``tp_plan`` over the stage's 1-D tensor-parallel mesh: the same DTensor code on
both sides, so what differs is the pipeline runtime.

Contenders, alive for a whole schedule's phase and taking turns round by round (round r:
N steps of each raypipe variant, then N steps of PiPPy; the other way round on odd rounds),
so load from other users of the shared CPU hits all alike; one phase per ``--schedules``
entry (default 1f1b and gpipe):

* raypipe ``PipelineTrainer(llama_layers(...), llama_loss, adamw, PipelineConfig(
  num_stages=2, tensor_parallel=2, num_micro_batches=m, schedule=...))`` on a private local
  Ray instance (one logical CPU per worker), one per ``--snapshot-every`` entry (default:
  PipelineConfig's cadence, a snapshot of every worker's state each step, and 0: none, as
  PiPPy keeps none) and per ``--clip`` entry;
* PiPPy: 4 spawned gloo ranks, a 2-D ``init_device_mesh("cpu", (2, 2),
  mesh_dim_names=("pp", "tp"))`` as torchtitan builds it, rank r holding stage r // 2 as
  tensor-parallel rank r % 2; ``PipelineStage(module, stage, 2, cpu,
  group=mesh["pp"].get_group())`` and ``Schedule1F1B`` / ``ScheduleGPipe`` with
  ``llama_loss``, the last stage's step inside ``loss_parallel_scope()`` (torch's
  ``loss_parallel()``: vocabulary-parallel cross entropy over the ``Shard(-1)`` logits, its
  backward inside too); after the schedule's step each rank puts its gradients into their
  parameters' layouts (``redistribute_gradients``: the RMSNorms' partial gradients summed over
  TP, the row-parallel embedding's cut to its rows: what raypipe does, and what AdamW over
  DTensors would otherwise do implicitly); its "clip" variant clips by the global norm as
  torchtitan does (``get_total_norm`` of the DTensor gradients, ``full_tensor()`` over TP, an
  all-reduce of the p-th powers over the "pp" group, ``clip_grads_with_norm_``).

The figure for each raypipe variant is the median over rounds of median(raypipe steps in
the round) / median(PiPPy steps in the round), with the min-max spread over rounds. A
PiPPy step is timed on rank 0 between two barriers of all 4 ranks and includes
``optimizer.step()``; a raypipe step is ``trainer.step()`` wall time, which includes the
commit (global gradient norm, clipping, optimizer step) on every worker. Printed beside:
raypipe's driver overhead (step time minus the longest worker task,
``StepResult.stages[i].task_seconds``) and, per worker, its task, its timeline summed by op
(F, B, optimizer, waits to receive, the others, the task outside any op) and the bytes it
sends a step (``sent_bytes``). With ``--op-times`` PiPPy's ranks time their forwards,
losses, backwards and optimizer steps too (printed per rank at the end). The first step's
loss of both sides is printed: same weights, same data, they must agree.

Ray starts its workers at nice 15 and PiPPy's processes run at nice 0: on a shared machine
run it as ``RAY_worker_niceness=0 python benchmarks/bench_vs_pippy_tp.py ...``.

    RAY_worker_niceness=0 python benchmarks/bench_vs_pippy_tp.py --rounds 5 --steps 3
    RAY_worker_niceness=0 python benchmarks/bench_vs_pippy_tp.py --schedules 1f1b --clip off on --micro-batches 8
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import platform
import statistics
import time

import torch

from alternate import (add_round_arguments, command_line, print_round_ms, print_table, round_medians, round_ratios,
                       run_rounds, spread)
from bench_vs_pippy import PippyRunner, RaypipeRunner, driver_overhead, make_optimizer, start_ray, timed_steps

NUM_STAGES, TENSOR_PARALLEL = 2, 2
NUM_RANKS = NUM_STAGES * TENSOR_PARALLEL  # processes on each side
SEED = 0  # PipelineConfig.seed's default: the per-layer seeding both sides build from
PIPPY_SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}  # raypipe schedule -> its PiPPy counterpart
CLIP_MODES = {"off": None, "on": 1.0}  # name -> max norm (raypipe's clip_grad_norm)
TARGET = 1.05  # issue 59's acceptance: raypipe's step <= 1.05x PiPPy's


def model_config(args: argparse.Namespace):
    from raypipe.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       ffn_dim=args.ffn_dim, max_seq_len=args.seq_len)


def balance(args: argparse.Namespace) -> list[int]:
    """Layers a stage (embedding + blocks + head, cut into equal counts): the same cut on both sides."""
    total = args.layers + 2
    return [total // NUM_STAGES + (stage < total % NUM_STAGES) for stage in range(NUM_STAGES)]


def make_batch(args: argparse.Namespace, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, (batch, seq_len) each; the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# -- PiPPy side: 4 gloo processes on a ("pp", "tp") mesh ------------------------------
def build_stage_module(args: argparse.Namespace, stage: int, tp_mesh) -> torch.nn.Sequential:
    """Stage ``stage``'s layers, built as raypipe builds them and split over ``tp_mesh`` by their plans."""
    from raypipe.models.layers import build_layer
    from raypipe.models.llama import llama_layers
    from raypipe.models.tensor_parallel import parallelize_layer

    specs = llama_layers(model_config(args), seq_len=args.seq_len)
    start = sum(balance(args)[:stage])
    indices = range(start, start + balance(args)[stage])
    layers = []
    for index in indices:
        layer = build_layer(specs[index], index, SEED)
        layers.append(parallelize_layer(layer, specs[index].tp_plan, tp_mesh, sequence_parallel=True,
                                        first_layer=index == 0, final_layer=index == len(specs) - 1,
                                        after_boundary=index == indices[0], before_boundary=index == indices[-1]))
    return torch.nn.Sequential(*layers)


def clip_like_torchtitan(parameters: list, max_norm: float, pp_group) -> None:
    """Global-norm clipping as torchtitan's ``dist_utils.clip_grad_norm_``: the norm of this stage's
    DTensor gradients made whole over TP, its square summed over the pipeline's stages."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    grads = [p.grad for p in parameters if p.grad is not None]
    total = get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    total = total.float().pow(2)
    dist.all_reduce(total, group=pp_group)
    clip_grads_with_norm_(parameters, max_norm, total.sqrt())


def pippy_tp_worker(rank: int, port: int, args: argparse.Namespace, commands: list, results) -> None:
    """One of PiPPy's 4 ranks: holds every schedule's copy of its stage (each takes its own
    optimizer steps); runs ``(steps, (schedule, max_norm))`` commands (PippyRunner's protocol)."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh

    from raypipe.models.llama import llama_loss
    from raypipe.models.tensor_parallel import loss_parallel_scope, redistribute_gradients

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=NUM_RANKS)
    try:
        mesh = init_device_mesh("cpu", (NUM_STAGES, TENSOR_PARALLEL), mesh_dim_names=("pp", "tp"))
        stage_index = mesh["pp"].get_local_rank()
        pp_group = mesh["pp"].get_group()
        first, last = stage_index == 0, stage_index == NUM_STAGES - 1
        inputs, targets = make_batch(args)
        runs = {}  # schedule name -> (schedule, module, parameters, optimizer)
        op_seconds: dict = collections.defaultdict(float)  # --op-times: (schedule, op) -> seconds so far
        per_step: dict = collections.defaultdict(list)  # (schedule, op) -> seconds a step, per command
        for name in args.schedules:
            module = build_stage_module(args, stage_index, mesh["tp"])
            parameters = list(module.parameters())
            stage = pipelining.PipelineStage(module, stage_index, NUM_STAGES, torch.device("cpu"), group=pp_group)
            optimizer = make_optimizer("adamw")(parameters)
            loss_fn = time_ops(name, stage, optimizer, llama_loss, op_seconds) if args.op_times else llama_loss
            schedule = getattr(pipelining, PIPPY_SCHEDULES[name])(stage, n_microbatches=args.micro_batches,
                                                                   loss_fn=loss_fn)
            runs[name] = (schedule, module, parameters, optimizer)
        # the last stage's forwards, loss and backwards run inside loss parallelism (process-global)
        scope = loss_parallel_scope if last else contextlib.nullcontext
        while (command := commands[rank].get()) is not None:
            count, (name, max_norm) = command
            schedule, module, parameters, optimizer = runs[name]
            before = dict(op_seconds)

            def step(losses: list[torch.Tensor]) -> None:
                with scope():
                    schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                                  losses=losses if last else None)
                redistribute_gradients(module)
                if max_norm is not None:
                    clip_like_torchtitan(parameters, max_norm, pp_group)

            step_times, losses = timed_steps(count, step, optimizer, last)
            for key, seconds in op_seconds.items():
                if key[0] == name:
                    per_step[key].append((seconds - before.get(key, 0.0)) / count)
            per_step[(name, "step")].append(statistics.median(step_times))
            results.put((rank, step_times, losses))
        if args.op_times:  # one line per rank: its ops' seconds a step, median over commands (warm-ups included)
            def line(name: str) -> str:
                return f"{name} " + " ".join(f"{op} {1e3 * statistics.median(per_step[(name, op)]):.0f}"
                                             for op in ("F", "loss", "B", "optimizer", "step") if per_step[(name, op)])

            print(f"PiPPy rank {rank} (stage {stage_index}, tp_rank {mesh['tp'].get_local_rank()}) ms a step: "
                  + "; ".join(map(line, args.schedules)), flush=True)
    finally:
        dist.destroy_process_group()


def time_ops(name: str, stage, optimizer: torch.optim.Optimizer, loss_fn, op_seconds: dict):
    """``--op-times``: add the seconds of each of ``stage``'s forwards and backwards (a micro-batch's
    forward_one_chunk and backward_one_chunk, the loss's backward in B), of each loss (its forward)
    and of each optimizer step to ``op_seconds[(name, "F" | "B" | "loss" | "optimizer")]``; returns
    ``loss_fn`` timed."""
    def timed(key: tuple[str, str], function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                op_seconds[key] += time.perf_counter() - start
        return run

    stage.forward_one_chunk = timed((name, "F"), stage.forward_one_chunk)
    stage.backward_one_chunk = timed((name, "B"), stage.backward_one_chunk)
    optimizer.step = timed((name, "optimizer"), optimizer.step)
    return timed((name, "loss"), loss_fn)


# -- raypipe side ---------------------------------------------------------------
class TensorParallelRaypipe(RaypipeRunner):
    """One PipelineTrainer of the LLaMA at p = 2, t = 2 (steps and shutdown as bench_vs_pippy's runner)."""

    def __init__(self, args: argparse.Namespace, schedule: str, snapshot_every: int, max_norm: float | None) -> None:
        # not super().__init__: another model, loss and config
        import raypipe
        from raypipe.models.llama import llama_layers, llama_loss

        config = raypipe.PipelineConfig(num_stages=NUM_STAGES, tensor_parallel=TENSOR_PARALLEL,
                                        num_micro_batches=args.micro_batches, balance=balance(args), schedule=schedule,
                                        clip_grad_norm=max_norm, snapshot_every=snapshot_every, seed=SEED)
        self.trainer = raypipe.PipelineTrainer(llama_layers(model_config(args), seq_len=args.seq_len), llama_loss,
                                               optimizer=make_optimizer("adamw"), config=config)
        self.inputs, self.targets = make_batch(args)
        self.results: list = []  # every StepResult, warm-up included


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=5, steps=3, warmup=3)
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--ffn-dim", type=int, default=704, help="SwiGLU hidden width (default 704)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens a sequence (default 128)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences a step (default 8)")
    parser.add_argument("--micro-batches", type=int, default=4, help="m (default 4)")
    parser.add_argument("--schedules", nargs="+", choices=sorted(PIPPY_SCHEDULES), default=["1f1b", "gpipe"],
                        help="one phase each (default: 1f1b gpipe)")
    parser.add_argument("--snapshot-every", type=int, nargs="+", default=None,
                        help="raypipe's snapshot_every, one trainer each (default: PipelineConfig's, a snapshot "
                             "every step, and 0: none, as PiPPy, which keeps no state to heal from)")
    parser.add_argument("--clip", nargs="+", choices=sorted(CLIP_MODES), default=["off"],
                        help="clip_grad_norm off (None) and/or on (1.0), on both sides (default: off)")
    parser.add_argument("--op-times", action="store_true",
                        help="PiPPy's ranks time their forwards, backwards and optimizer steps and print them "
                             "per rank at the end, beside raypipe's timeline (printed always)")
    parser.set_defaults(inline_bytes=None)  # bench_vs_pippy.start_ray's knob: Ray's default here
    args = parser.parse_args()
    if args.snapshot_every is None:
        from raypipe import PipelineConfig

        args.snapshot_every = [PipelineConfig.snapshot_every, 0]
    if args.batch_size % args.micro_batches:
        parser.error(f"--batch-size {args.batch_size} must divide into --micro-batches {args.micro_batches}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    config = model_config(args)
    from raypipe.models.llama import num_parameters

    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; LLaMA vocab {config.vocab_size}, dim {config.dim}, "
          f"{config.n_layers} blocks, {config.n_heads} heads, FFN {config.ffn_dim} "
          f"({num_parameters(config) / 1e6:.2f}M parameters); batch {args.batch_size} x {args.seq_len} tokens, "
          f"m={args.micro_batches}; p={NUM_STAGES} (layers {balance(args)}) x t={TENSOR_PARALLEL}, sequence "
          f"parallel, fp32, adamw; raypipe snapshot_every {args.snapshot_every}, clip {args.clip}", flush=True)
    variants = [(snapshot, clip) for snapshot in args.snapshot_every for clip in args.clip]
    pippy = PippyRunner(args, pippy_tp_worker, NUM_RANKS)
    start_ray(args, len(variants), NUM_RANKS)  # one logical CPU per worker of every trainer alive at once
    times, results, first_losses = {}, {}, {}
    try:
        for schedule in args.schedules:  # a phase each: only one schedule's trainers are alive at a time
            phase_times, phase_results, first_losses[schedule] = run_phase(args, schedule, variants, pippy)
            times |= phase_times
            results |= phase_results
    finally:
        import ray

        ray.shutdown()
        pippy.close()
    report(args, times, results, first_losses)


def run_phase(args: argparse.Namespace, schedule: str, variants: list, pippy: PippyRunner
              ) -> tuple[dict, dict, tuple[float, float]]:
    """One schedule's alternating rounds: its raypipe trainers (shut down at the end) against PiPPy."""
    runners: dict = {}
    try:
        runners = {variant: TensorParallelRaypipe(args, schedule, variant[0], CLIP_MODES[variant[1]])
                   for variant in variants}
        # Same weights, same data: the first step's loss must agree (the two compute the same thing).
        first_raypipe = next(iter(runners.values())).run(1)[1][0]
        first_pippy = pippy.run(1, (schedule, CLIP_MODES[variants[0][1]]))[1][0]
        print(f"{schedule}: first-step loss raypipe {first_raypipe:.6f}  pippy {first_pippy:.6f}  "
              f"(relative difference {abs(first_raypipe - first_pippy) / abs(first_pippy):.1e})", flush=True)
        contenders = {(schedule, "raypipe", f"snapshot_every={snapshot}", clip):
                      (lambda count, r=runner: r.run(count)[0]) for (snapshot, clip), runner in runners.items()}
        contenders |= {(schedule, "pippy", "-", clip):
                       (lambda count, c=clip: pippy.run(count, (schedule, CLIP_MODES[c]))[0]) for clip in args.clip}
        times = run_rounds(contenders, args.rounds, args.steps, args.warmup, print_round_ms(args.steps),
                           reverse_odd_rounds=True)
    finally:
        for runner in runners.values():
            runner.close()
    results = {(schedule, "raypipe", f"snapshot_every={snapshot}", clip): runner.results[-args.rounds * args.steps:]
               for (snapshot, clip), runner in runners.items()}
    return times, results, (first_raypipe, first_pippy)


PROFILED_OPS = ("F", "B", "optimizer", "recv")  # the timeline's op kinds given a column each


def op_milliseconds(result, stage: int, tp_rank: int) -> dict[str, float]:
    """One worker's milliseconds in each kind of timeline event of a step."""
    totals: dict[str, float] = collections.defaultdict(float)
    for event in result.timeline:
        if event.stage == stage and event.tp_rank == tp_rank and event.replica == 0:
            totals[event.op] += 1e3 * (event.end - event.start)
    return totals


def report(args: argparse.Namespace, times: dict, results: dict, first_losses: dict) -> None:
    rows, profile = [], []
    for key, values in times.items():
        schedule, side, snapshot, clip = key
        if side != "raypipe":
            continue
        pippy_times = times[(schedule, "pippy", "-", clip)]
        ratios = round_ratios(values, pippy_times, args.steps)
        steps = results[key]
        overhead = driver_overhead(steps)
        share = [o / r.step_time for o, r in zip(overhead, steps)]
        rows.append([schedule, snapshot.split("=")[1], clip, spread(ratios),
                     f"{1e3 * statistics.median(round_medians(values, args.steps)):.0f}",
                     f"{1e3 * statistics.median(round_medians(pippy_times, args.steps)):.0f}",
                     f"{1e3 * statistics.median(overhead):.1f} ms ({100 * statistics.median(share):.1f}%)",
                     "met" if statistics.median(ratios) <= TARGET else "MISSED"])
        for index in range(len(steps[0].stages)):
            stats = [r.stages[index] for r in steps]
            ops = [op_milliseconds(r, stats[0].stage, stats[0].tp_rank) for r in steps]
            columns = [f"{statistics.median(o.get(kind, 0.0) for o in ops):.0f}" for kind in PROFILED_OPS]
            others = sorted({kind for o in ops for kind in o} - set(PROFILED_OPS))
            outside = [1e3 * s.task_seconds - sum(o.values()) for s, o in zip(stats, ops)]  # the task, in no event
            profile.append([schedule, snapshot.split("=")[1], clip, f"({stats[0].stage}, {stats[0].tp_rank})",
                            f"{1e3 * statistics.median(s.task_seconds for s in stats):.0f}", *columns,
                            ", ".join(f"{kind} {statistics.median(o.get(kind, 0.0) for o in ops):.0f}"
                                      for kind in others),
                            f"{statistics.median(outside):.0f}",
                            f"{statistics.median(s.sent_bytes or 0 for s in stats):,.0f}"])
    print()
    for schedule, (raypipe_loss, pippy_loss) in first_losses.items():
        print(f"first-step loss, {schedule}: raypipe {raypipe_loss:.6f}, PiPPy {pippy_loss:.6f}")
    print_table(["schedule", "snapshot_every", "clip_grad_norm", "raypipe/PiPPy (median [min-max] of per-round ratios)",
                 "raypipe ms", "PiPPy ms", "driver overhead (median, share)", f"<= {TARGET:.2f}"], rows)
    print("(ms columns: median of per-round medians, for orientation only; the machine is shared)")
    print()
    print("raypipe's workers, ms a step (median over the timed steps; the timeline's events summed by op):")
    print_table(["schedule", "snapshot_every", "clip_grad_norm", "worker (stage, tp_rank)", "task", *PROFILED_OPS,
                 "other events", "outside events", "sent bytes a step"], profile)
    print(command_line())


if __name__ == "__main__":
    main()
