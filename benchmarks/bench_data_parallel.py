"""Data parallelism on CPU: what the gradient reduction adds to a step, and what
ZeRO-1 saves per worker.

Three trainers of the tiny LLaMA on one stage (p=1), alternating round by round
on one local Ray instance, each replica doing the same work (m micro-batches of
the same size; the global batch grows with d):

* ``d=1``: one worker;
* ``d=2``: two replicas, gradients all-reduced once per step;
* ``d=2 zero1``: two replicas with ``shard_optimizer=True`` (gradients
  reduce-scattered onto each parameter's owner, then the owners' new compute
  weights all-gathered; in bf16 each owner alone keeps its fp32 main weights).

Printed: per round the step-time ratios ``d=2 / d=1`` and ``zero1 / d=2`` (median
and min-max over rounds); from the timeline, the ``reduce`` event (start of the
bucketed reduction to its end, waiting for the other replica included), the part
of it after the last backward of any replica (what the reduction adds to the
step) and its share of the step; and per worker the optimizer state's and the
weights' tensor bytes, measured (``StageStats.optimizer_bytes``, ``weights_bytes``)
against the memory model (:func:`raypipe.planning.memory.estimate_stage`).

    python benchmarks/bench_data_parallel.py --rounds 8 --steps 3 [--precision bf16]
"""
from __future__ import annotations

import argparse
import statistics

import ray
import torch

import raypipe
from alternate import add_round_arguments, command_line, print_table, round_medians, round_ratios, run_alternating, spread
from raypipe.models.llama import get_config, llama_layers, llama_loss
from raypipe.planning.memory import estimate_stage

MODEL = "tiny"


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def tokens(rows: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, vocab, (rows, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return data[:, :-1], data[:, 1:]


def reduce_seconds(result: raypipe.StepResult) -> float:
    return max((e.end - e.start for e in result.timeline if e.op == "reduce"), default=0.0)


def exposed_seconds(result: raypipe.StepResult) -> float:
    """The reduction's time after the last backward of any replica ended: what it adds
    to the step (the rest of a ``reduce`` event is a replica waiting while another
    still runs its backward)."""
    reductions = [e for e in result.timeline if e.op == "reduce"]
    if not reductions:
        return 0.0
    last_backward = max(e.end for e in result.timeline if e.op == "B")
    return max(0.0, max(e.end for e in reductions) - last_backward)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=8, steps=3, warmup=2)
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per replica (default 2)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch (default 4)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="default fp32")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    print(command_line())
    config = get_config(MODEL)
    seq_len, m, size = config.max_seq_len, args.micro_batches, args.micro_batch_size
    setups = {"d=1": (1, False), "d=2": (2, False), "d=2 zero1": (2, True)}
    ray.init(num_cpus=6, include_dashboard=False, logging_level="WARNING")
    print(f"torch {torch.__version__}, ray {ray.__version__}; {MODEL} LLaMA, 1 stage, m={m} x {size} x {seq_len} "
          f"tokens per replica, {args.precision}, AdamW, clip 1.0; {args.rounds} rounds x {args.steps} steps",
          flush=True)
    trainers = {name: raypipe.PipelineTrainer(
        llama_layers(config), llama_loss, adamw,
        raypipe.PipelineConfig(num_stages=1, num_micro_batches=m, num_replicas=d, shard_optimizer=shard,
                               clip_grad_norm=1.0, precision=args.precision, use_gpu=False))
        for name, (d, shard) in setups.items()}
    batches = {name: tokens(d * m * size, seq_len, config.vocab_size) for name, (d, _) in setups.items()}
    results = run_alternating(trainers, batches, args, on_round=lambda i, _: print(f"round {i + 1} done", flush=True))

    def times(name):
        return [r.step_time for r in results[name]]

    def busy(name):  # the slowest worker's F and B time in the step
        return [max(stats.busy_seconds for stats in r.stages) for r in results[name]]

    print()
    print_table(["ratio", "median [min-max] of per-round ratios"], [
        ["step time d=2 / d=1 (same work per replica)", spread(round_ratios(times("d=2"), times("d=1"), args.steps))],
        ["step time d=2 zero1 / d=2", spread(round_ratios(times("d=2 zero1"), times("d=2"), args.steps))],
        ["F+B compute time of the slowest worker d=2 / d=1", spread(round_ratios(busy("d=2"), busy("d=1"),
                                                                                 args.steps))],
    ])
    print()
    rows = []
    for name in ("d=2", "d=2 zero1"):
        exposed = [exposed_seconds(r) / r.step_time for r in results[name]]
        overlapped = [1 - exposed_seconds(r) / reduce_seconds(r) for r in results[name] if reduce_seconds(r)]
        rows.append([name, f"{1e3 * statistics.median(reduce_seconds(r) for r in results[name]):.1f}",
                     f"{1e3 * statistics.median(exposed_seconds(r) for r in results[name]):.1f}",
                     spread([100 * v for v in round_medians(exposed, args.steps)], 1),
                     f"{100 * statistics.median(overlapped):.0f}%"])
    print_table(["trainer", "reduce event ms (longest, median)", "exposed ms: after the last backward (median)",
                 "exposed share of step %, per-round [min-max]", "reduce event spent during a backward"], rows)
    print()
    layers = range(config.n_layers + 2)
    rows = []
    for name, (d, shard) in setups.items():
        predicted = estimate_stage(config, layers, num_micro_batches=m, micro_batch_size=size, seq_len=seq_len,
                                   precision=args.precision, optimizer="adamw", optimizer_shards=d if shard else 1)
        weights = predicted.parameters_bytes + predicted.master_bytes
        for stats in results[name][-1].stages:
            rows.append([name, stats.replica, *(f"{value / 2**20:.3f}" for value in (
                stats.optimizer_bytes, predicted.optimizer_bytes, stats.weights_bytes, weights)),
                f"{stats.optimizer_bytes / predicted.optimizer_bytes:.3f}", f"{stats.weights_bytes / weights:.3f}"])
    print_table(["trainer", "replica", "optimizer MiB", "model", "weights MiB", "model", "optimizer measured / model",
                 "weights measured / model"], rows)
    print(command_line())


if __name__ == "__main__":
    main()
