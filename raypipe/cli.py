"""`raypipe train | plan | prepare | verify-data | export`."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raypipe", description="pipeline-parallel training on Ray")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train from a YAML run config")
    train.add_argument("--config", required=True, help="YAML file with RunConfig fields (see configs/tiny.yaml)")
    train.add_argument("--steps", type=int, help="override the config's steps (the run's total)")
    train.add_argument("--out", help="override the config's output directory")

    from raypipe.data import add_prepare_arguments
    from raypipe.data.verify import add_verify_arguments
    from raypipe.planning.plan import add_plan_arguments

    add_plan_arguments(commands.add_parser("plan", help="predict per-stage memory of a model and pipeline; with "
                                                    "--cluster, search the fastest shape on N GPUs"))
    add_prepare_arguments(commands.add_parser("prepare", help="turn a text corpus into Parquet token shards"))
    add_verify_arguments(commands.add_parser("verify-data", help="read every shard of a prepared dataset and check "
                                                                 "it against its manifest"))
    export = commands.add_parser("export", help="convert a LLaMA checkpoint into a Hugging Face model directory")
    export.add_argument("--checkpoint", required=True, metavar="ROOT", help="checkpoint root (path or URI)")
    export.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    export.add_argument("--out", required=True, metavar="DIR", help="new directory for config.json and shards")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="weights' dtype (default: as trained, i.e. the fp32 main weights, which compute "
                             "exactly what the trainer did; files are twice the size of bf16's)")

    args = parser.parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command == "plan":
        from raypipe.planning.plan import run_plan

        return run_plan(args)
    if args.command == "export":
        return _export(args)
    if args.command == "verify-data":
        from raypipe.data.verify import run_verify

        return run_verify(args)
    from raypipe.data import run_prepare

    return run_prepare(args)


def _train(args: argparse.Namespace) -> int:
    import json

    from raypipe.config import load_yaml
    from raypipe.run import RunConfig, train

    try:
        values = load_yaml(args.config)
        if args.steps is not None:
            values["steps"] = args.steps
        if args.out is not None:
            values["out"] = args.out
        run = RunConfig.from_dict(values)
    except ValueError as error:  # ConfigError included
        print(f"raypipe train: error in {args.config}: {error}", file=sys.stderr)
        return 2
    summary = train(run)
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    from raypipe.checkpoint.hf_export import export_checkpoint
    from raypipe.checkpoint.store import latest_checkpoint

    try:
        step = latest_checkpoint(args.checkpoint) if args.step is None else args.step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint under {args.checkpoint}")
        export_checkpoint(args.checkpoint, step, args.out, args.dtype)
    except (ValueError, OSError) as error:
        print(f"raypipe export: error: {error}", file=sys.stderr)
        return 2
    from raypipe.models.hf.weights import CONFIG, read_json

    print(f"exported step {step} of {args.checkpoint} to {args.out} ({read_json(args.out, CONFIG)['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
