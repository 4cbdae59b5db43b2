"""Train the tiny LLaMA on the Python standard library, on CPU, in a few minutes.

    python jobs/train_tiny.py [--stages 2] [--replicas 1] [--micro-batches 4] [--steps 200] [--out runs/tiny]

Prepares the corpus if missing, starts a local Ray instance (or joins
RAY_ADDRESS), trains on pipeline stages and writes summary.json, loss.png,
trace.json, timeline.png and the final checkpoint into --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from raypipe.config import TRANSPORTS, PipelineConfig, activation_arguments, add_activation_arguments  # noqa: E402
from raypipe.run import RunConfig, train  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (one CPU each)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="data-parallel copies of the pipeline (stages x replicas CPUs)")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="ZeRO-1: shard the optimizer state over the replicas")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step and replica")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--eval-every", type=int, default=50, help="evaluate every N steps")
    add_activation_arguments(parser)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--transport", default=PipelineConfig.transport, choices=TRANSPORTS,
                        help=f"executor/transport between stages (default {PipelineConfig.transport})")
    parser.add_argument("--data", default=None, help="prepared dataset, made from the stdlib if missing "
                                                     "(default: in $RAYPIPE_CACHE or ~/.cache/raypipe)")
    parser.add_argument("--out", default="runs/tiny", help="output directory")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = RunConfig(
        model="tiny", data=args.data, steps=args.steps, micro_batch_size=args.micro_batch_size,
        eval_every=args.eval_every, out=args.out, progress=not args.no_progress,
        pipeline={"num_stages": args.stages, "num_replicas": args.replicas,
                  "shard_optimizer": args.shard_optimizer, "num_micro_batches": args.micro_batches,
                  **activation_arguments(args), "precision": args.precision,
                  "transport": args.transport, "metrics_port": args.metrics_port})
    summary = train(run)
    shown = {k: summary[k] for k in ("steps", "initial_loss", "final_loss", "final_eval_loss", "tokens_per_second")}
    print(json.dumps(shown, indent=2))
    print(f"outputs in {args.out}: summary.json loss.png trace.json timeline.png checkpoints/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
