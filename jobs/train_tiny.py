"""Train the tiny LLaMA on the Python standard library, on CPU, in a few minutes.

    python jobs/train_tiny.py [--stages 2] [--replicas 1 | --replicas 1:2] [--micro-batches 8] [--steps 200]
                              [--pack] [--out runs/tiny]

Prepares the corpus if missing, starts a local Ray instance (or joins
RAY_ADDRESS), trains on pipeline stages and writes summary.json, loss.png,
trace.json, timeline.png and checkpoints into --out.

--steps is the run's total. By default (--resume) the job first loads the
newest intact checkpoint in --checkpoint-dir with its data position and trains
only the steps still missing: running the same command again after the driver
(or the Ray instance) died finishes the same run, bitwise, with no sample seen
twice; it redoes the steps since that checkpoint (--checkpoint-every). The
outputs of a resumed invocation cover the steps it trained (summary.json:
first_step, resumed_from_step).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from jobs.job_summary import print_summary  # noqa: E402
from raypipe.config import (STEP_CALLS, TRANSPORTS, PipelineConfig, activation_arguments,  # noqa: E402
                            add_activation_arguments, add_schedule_arguments, add_slow_worker_arguments,
                            add_heal_arguments, add_tensor_parallel_arguments, parse_balance, parse_replicas,
                            heal_arguments, replicas_for_config, schedule_arguments, slow_worker_arguments,
                            tensor_parallel_arguments)
from raypipe.core.ops import BOUNDARY_SHAPES  # noqa: E402
from raypipe.run import RunConfig, train  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (one CPU each)")
    parser.add_argument("--replicas", type=parse_replicas, default=1, metavar="N|MIN:MAX",
                        help="data-parallel copies of the pipeline (stages x replicas CPUs); MIN:MAX runs elastic "
                             "between MIN and MAX, with the global batch of MAX")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="ZeRO-1: shard the optimizer state (and in bf16 the fp32 main weights) over the replicas")
    parser.add_argument("--balance", type=parse_balance, default="parameters", metavar="parameters|time|N,N,...",
                        help="how layers are split into stages: 'parameters' (equal parameter counts), 'time' "
                             "(equal predicted compute: the LLaMA layers' flops at --seq-len), or layers per stage "
                             "like 3,3,2 (default: parameters)")
    # 8 of 2 sequences, not 4 of 4: the same 16 a step, and GPipe's bubble on 2 stages, (p - 1) / (m + p - 1),
    # shrinks from 1/5 to 1/9 of the step (4.9% more tokens/s here: benchmarks/RESULTS.md, 2026-12-02, 12:45)
    add_schedule_arguments(parser)
    add_tensor_parallel_arguments(parser)
    parser.add_argument("--micro-batches", type=int, default=8,
                        help="micro-batches per step and replica (elastic: per replica of MAX)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=200,
                        help="optimizer steps of the run in total, resumed steps included")
    parser.add_argument("--eval-every", type=int, default=50, help="evaluate every N steps")
    add_activation_arguments(parser)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--transport", default=PipelineConfig.transport, choices=TRANSPORTS,
                        help=f"executor/transport between stages (default {PipelineConfig.transport})")
    parser.add_argument("--step-calls", default=PipelineConfig.step_calls, choices=(*STEP_CALLS, "direct"),
                        help="how the driver starts each p2p step: over a connection to each worker, or as "
                             "actor tasks (\"direct\": the old name of \"connections\", deprecated) "
                             f"(default {PipelineConfig.step_calls})")
    parser.add_argument("--boundary-shapes", default=PipelineConfig.boundary_shapes, choices=BOUNDARY_SHAPES,
                        help="p2p: each boundary's dtype and shape sent once and learned, or a header before every "
                             f"activation (for models whose boundary shapes change) (default "
                             f"{PipelineConfig.boundary_shapes})")
    add_heal_arguments(parser)
    add_slow_worker_arguments(parser)
    parser.add_argument("--data", default=None, help="prepared dataset, made from the stdlib if missing "
                                                     "(default: in $RAYPIPE_CACHE or ~/.cache/raypipe)")
    parser.add_argument("--pack", action="store_true",
                        help="packed documents: each attends only to itself, at its own positions (the default "
                             "dataset is prepared packed, in its own cache directory; a --data must be packed, "
                             "`raypipe prepare --pack`)")
    parser.add_argument("--out", default="runs/tiny", help="output directory")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoints (default: OUT/checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=50,
                        help="checkpoint every N steps of the run (and at the end); a rerun after a crash redoes "
                             "the steps since the newest one (default: 50)")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                        help="continue from the newest intact checkpoint in --checkpoint-dir and train the steps "
                             "missing up to --steps (default: on)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def run_config(args: argparse.Namespace) -> RunConfig:
    """The run config of these flags."""
    return RunConfig(
        model="tiny", data=args.data, pack=args.pack, steps=args.steps, micro_batch_size=args.micro_batch_size,
        eval_every=args.eval_every, out=args.out, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume, progress=not args.no_progress,
        pipeline={"num_stages": args.stages, "num_replicas": replicas_for_config(args.replicas),
                  "shard_optimizer": args.shard_optimizer, "num_micro_batches": args.micro_batches,
                  **schedule_arguments(args), **tensor_parallel_arguments(args),
                  "balance": args.balance, **activation_arguments(args), "precision": args.precision,
                  "transport": args.transport, "step_calls": args.step_calls, "metrics_port": args.metrics_port,
                  "boundary_shapes": args.boundary_shapes, **heal_arguments(args),
                  **slow_worker_arguments(args)})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = train(run_config(args), on_start=lambda first_step: print(_resume_line(first_step, args), flush=True))
    print_summary(summary, args.out)
    return 0


def _resume_line(first_step: int, args: argparse.Namespace) -> str:
    if first_step == args.steps:
        return f"nothing to do: the checkpoints hold step {first_step} of --steps {args.steps}"
    return f"resuming from the checkpoint of step {first_step}" if first_step else "starting at step 0"


if __name__ == "__main__":
    raise SystemExit(main())
