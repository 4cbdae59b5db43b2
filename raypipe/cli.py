"""`raypipe train | plan | prepare`."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raypipe", description="pipeline-parallel training on Ray")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train from a YAML run config")
    train.add_argument("--config", required=True, help="YAML file with RunConfig fields (see configs/tiny.yaml)")
    train.add_argument("--steps", type=int, help="override the config's steps")
    train.add_argument("--out", help="override the config's output directory")

    from raypipe.data import add_prepare_arguments
    from raypipe.planning.plan import add_plan_arguments

    add_plan_arguments(commands.add_parser("plan", help="predict per-stage memory of a model and pipeline"))
    add_prepare_arguments(commands.add_parser("prepare", help="turn a text corpus into Parquet token shards"))

    args = parser.parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command == "plan":
        from raypipe.planning.plan import run_plan

        return run_plan(args)
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


if __name__ == "__main__":
    sys.exit(main())
