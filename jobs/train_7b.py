"""Train LLaMA-7B with pipeline parallelism on a Ray cluster: one GPU per stage.

    ray job submit --working-dir . -- python jobs/train_7b.py \\
        --stages 8 --micro-batches 32 --micro-batch-size 1 --seq-len 2048 --steps 1000 \\
        --data s3://bucket/tokens --checkpoint-dir s3://bucket/checkpoints --metrics-port 8090

The ``7b`` preset is the ``llama-7b`` config in bf16 with activation
checkpointing ("always": each stage keeps only its inputs and recomputes the
forward in backward), 8 stages of one GPU each; attention runs flash-attn where
it is installed. ``--preset tiny`` runs the same code path with the tiny model
on CPU (2 stages), for CI and laptops.

The job connects to the cluster like any Ray job (``RAY_ADDRESS``; without
one it starts a local Ray instance). ``--data`` is a prepared dataset
(``raypipe prepare``): a local path, prepared from the Python standard library
if missing (by default in ``$RAYPIPE_CACHE`` or ``~/.cache/raypipe``, outside
the job's working directory), or an ``s3://`` / ``gs://`` URI read through
``pyarrow.fs``. The first and last stages read it themselves: before step 0
each checks it can open the dataset where it runs; a stage that cannot gets
a local dataset's shards through Ray's object store, up to
``--ship-data-limit-mb``; above that, use a URI or a shared filesystem.

``--steps`` is the run's total: by default (``--resume``) the job loads the
newest intact checkpoint in ``--checkpoint-dir`` (skipping a damaged one) with
its data position and trains only the steps still missing, so running the same
command again after the driver or the head died (a KubeRay ``backoffLimit``
retry does exactly that) finishes the same run, bitwise, with no sample seen
twice; the steps since that checkpoint are trained again. The outputs of a
resumed invocation (summary.json's losses, loss.png, trace.json) cover the
steps it trained (summary.json: ``first_step``, ``resumed_from_step``).
Without a progress bar (not a terminal, or ``--no-progress``) it prints one
line per step, for job logs.

``--replicas MIN:MAX`` (e.g. ``1:4``) runs elastic: the run starts with as many
replicas as fit (at least MIN), drops one whose worker cannot be replaced
(``--replace-timeout``), and adds one at a step boundary when resources for it
appear; it asks the autoscaler for MAX replicas' resources. A step is always
``--micro-batches`` x MAX micro-batches, shared by the replicas running it, so
the numbers do not change with the replica count.

``--init-from DIR`` starts from a Hugging Face LLaMA checkpoint (safetensors,
local or ``s3://`` / ``gs://``) instead of the preset's random weights; each
stage reads only its own layers. ``--tokenizer DIR`` prepares the data with
that Hugging Face tokenizer (``tokenizer.json``) instead of bytes.

``--pack`` trains on packed documents (``raypipe prepare --pack``): each
document attends only to itself, at its own positions, and never predicts the
next one's first token. The default dataset is then prepared packed, in a cache
directory of its own; a ``--data`` given must have been prepared with ``--pack``.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from jobs.job_summary import print_summary  # noqa: E402
from raypipe.config import (PipelineConfig, activation_arguments, add_activation_arguments,  # noqa: E402
                            add_schedule_arguments, add_slow_worker_arguments, add_heal_arguments,
                            add_tensor_parallel_arguments, max_replicas, parse_balance, parse_replicas,
                            replicas_for_config, schedule_arguments,
                            heal_arguments, slow_worker_arguments, tensor_parallel_arguments)
from raypipe.core.ops import BOUNDARY_SHAPES  # noqa: E402
from raypipe.errors import ConfigError  # noqa: E402
from raypipe.core.result import StepResult  # noqa: E402
from raypipe.models.llama import get_config  # noqa: E402
from raypipe.run import RunConfig, dataset_path, train  # noqa: E402


@dataclass(frozen=True)
class Preset:
    """The defaults of one kind of run; every field but ``model`` and ``use_gpu`` has a flag."""

    model: str
    use_gpu: bool
    stages: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    steps: int
    precision: str
    activation_checkpoint: str  # recompute activations in backward: "never" | "always" | "except_last"
    learning_rate: float
    eval_every: int
    checkpoint_every: int
    placement_timeout: float  # seconds


PRESETS = {
    # 8 x 80 GB GPUs: a stage holds ~0.84e9 of the ~6.7e9 parameters, with fp32
    # master weights, grads and AdamW state (16 bytes each, bf16 is autocast
    # compute) ~13.5 GB; activation checkpointing keeps only the 32 micro-batches'
    # stage inputs (32 MB each, fp32 at 2048 tokens). GPU nodes may take minutes to be
    # added by the autoscaler, hence the long placement timeout.
    "7b": Preset(model="llama-7b", use_gpu=True, stages=8, micro_batches=32, micro_batch_size=1, seq_len=2048,
                 steps=1000, precision="bf16", activation_checkpoint="always", learning_rate=3e-4, eval_every=100,
                 checkpoint_every=100, placement_timeout=900.0),
    # the same code path on CPU, small enough for CI
    "tiny": Preset(model="tiny", use_gpu=False, stages=2, micro_batches=4, micro_batch_size=4, seq_len=256,
                   steps=20, precision="bf16", activation_checkpoint="always", learning_rate=3e-3, eval_every=0,
                   checkpoint_every=0, placement_timeout=60.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The job's flags; those left unset take the preset's values (see :func:`apply_preset`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="7b",
                        help="7b: llama-7b, bf16, one GPU per stage; tiny: the tiny model on CPU (default: 7b)")
    parser.add_argument("--init-from", metavar="DIR",
                        help="Hugging Face LLaMA directory or s3:// / gs:// URI to start from (its shape, "
                             "not the preset's)")
    parser.add_argument("--untie-embeddings", action="store_true",
                        help="with --init-from: accept tied embeddings, the head starting as a copy of the embedding")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="Hugging Face tokenizer directory (tokenizer.json) preparing --data (default: bytes)")
    parser.add_argument("--stages", type=int, help="pipeline stages, one GPU each with the 7b preset (7b: 8)")
    parser.add_argument("--replicas", type=parse_replicas, default=1, metavar="N|MIN:MAX",
                        help="data-parallel copies of the pipeline: stages x replicas GPUs; MIN:MAX runs elastic, "
                             "shrinking to MIN when nodes are lost and growing to MAX when they come, with the "
                             "global batch of MAX replicas (default: 1)")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="ZeRO-1: each replica of a stage keeps 1/replicas of the optimizer state "
                             "(and in bf16 of the fp32 main weights); an elastic run re-assigns it at each resize")
    parser.add_argument("--balance", type=parse_balance, default="parameters", metavar="parameters|time|N,N,...",
                        help="how layers are split into stages: 'parameters' (equal parameter counts), 'time' "
                             "(equal predicted compute: the LLaMA layers' flops at --seq-len), or layers per stage "
                             "like 3,3,2 (default: parameters)")
    parser.add_argument("--keep-last", type=int, default=None, metavar="K",
                        help="keep only the newest K checkpoints (default: all)")
    parser.add_argument("--max-failures", type=int, default=3,
                        help="worker failures healed (replaced, rolled back, step redone) before giving up; "
                             "-1: unlimited (default: 3)")
    add_heal_arguments(parser)
    parser.add_argument("--hang-timeout", type=float, default=30.0,
                        help="seconds without a heartbeat before a worker counts as hung (default: 30)")
    parser.add_argument("--replace-timeout", type=float, default=60.0,
                        help="seconds to wait for the resources of a replacement worker, e.g. while Ray declares a "
                             "lost node dead and the autoscaler adds one (default: 60)")
    add_slow_worker_arguments(parser)
    parser.add_argument("--boundary-shapes", default="learned", choices=BOUNDARY_SHAPES,
                        help="each boundary's dtype and shape sent once and learned, or a header before every "
                             "activation (for models whose boundary shapes change) (default: learned)")
    add_schedule_arguments(parser)
    add_tensor_parallel_arguments(parser)
    parser.add_argument("--micro-batches", type=int,
                        help="micro-batches per optimizer step and replica; elastic: per replica of MAX (7b: 32)")
    parser.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (7b: 1)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence, at most the model's max_seq_len (7b: 2048)")
    parser.add_argument("--steps", type=int, help="total optimizer steps of the run, resumed steps included (7b: 1000)")
    parser.add_argument("--learning-rate", type=float, help="AdamW peak learning rate (7b: 3e-4)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="linear warm-up steps, then cosine decay over --steps (default: 10%% of --steps)")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], help="(default: bf16)")
    add_activation_arguments(parser, default=None)  # None: the preset's
    parser.add_argument("--eval-every", type=int, help="validation loss every N steps; 0: at the end only")
    parser.add_argument("--data", help="prepared dataset: local path (prepared from the Python stdlib if "
                                       "missing) or s3:// / gs:// URI (default: the stdlib, prepared in "
                                       "$RAYPIPE_CACHE or ~/.cache/raypipe)")
    parser.add_argument("--pack", action="store_true",
                        help="packed documents: each attends only to itself, at its own positions; the default "
                             "dataset is prepared packed (in its own cache directory), a given --data must be "
                             "packed (`raypipe prepare --pack`)")
    parser.add_argument("--ship-data-limit-mb", type=int, default=1024, metavar="MB",
                        help="a local --data that a stage's node cannot open goes through Ray's object store up to "
                             "this size; above it the run stops before step 0 (default: 1024)")
    parser.add_argument("--checkpoint-dir", help="checkpoints, local or s3:// / gs:// (default: OUT/checkpoints)")
    parser.add_argument("--checkpoint-every", type=int,
                        help="checkpoint every N steps of the run (and at the end); a lost driver or head costs "
                             "the steps since the newest checkpoint (7b: 100)")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                        help="continue from the newest intact checkpoint in --checkpoint-dir and train the steps "
                             "missing up to --steps, so a rerun finishes the same run (default: on)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address the metrics server listens on; 0.0.0.0 to be scraped from outside the pod")
    parser.add_argument("--placement-timeout", type=float,
                        help="seconds to wait for the stages' resources, e.g. while the autoscaler adds GPU nodes")
    parser.add_argument("--out",
                        help="summary.json, loss.png, trace.json, timeline.png (default: runs/train_7b-PRESET)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar instead of a line per step (default: when stdout is a terminal)")
    args = parser.parse_args(argv)
    apply_preset(args)
    _check(parser, args)
    return args


def apply_preset(args: argparse.Namespace) -> None:
    """Fill the flags left unset from ``PRESETS[args.preset]`` and derive the default paths."""
    preset = PRESETS[args.preset]
    for name, value in asdict(preset).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.data is None:
        args.data = dataset_path(None, args.seq_len, args.tokenizer, pack=args.pack)
    if args.out is None:
        args.out = f"runs/train_7b-{args.preset}"
    if args.checkpoint_dir is None:
        args.checkpoint_dir = str(Path(args.out) / "checkpoints")
    if args.progress is None:
        args.progress = sys.stdout.isatty()


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("stages", "micro_batches", "micro_batch_size", "seq_len", "steps"):  # --replicas: parse_replicas
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("eval_every", "checkpoint_every", "ship_data_limit_mb"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    max_seq_len = get_config(args.model).max_seq_len
    if args.init_from is None and args.seq_len > max_seq_len:
        parser.error(f"--seq-len {args.seq_len} exceeds the max_seq_len of {args.model} ({max_seq_len})")
    if isinstance(args.balance, list) and len(args.balance) != args.stages:
        parser.error(f"--balance {','.join(map(str, args.balance))} needs one entry per stage (--stages {args.stages})")
    if args.untie_embeddings and args.init_from is None:
        parser.error("--untie-embeddings only applies with --init-from")
    if not (args.learning_rate > 0 and math.isfinite(args.learning_rate)):
        parser.error(f"--learning-rate must be a finite number > 0, got {args.learning_rate}")
    if not args.placement_timeout > 0:
        parser.error(f"--placement-timeout must be > 0 seconds, got {args.placement_timeout}")
    if args.keep_last is not None and args.keep_last < 1:
        parser.error(f"--keep-last must be >= 1, got {args.keep_last}")
    if args.spare_workers < 0:
        parser.error(f"--spare-workers must be >= 0, got {args.spare_workers}")
    try:  # the config's own checks of the slow-worker knobs, as usage errors
        PipelineConfig(spare_workers=args.spare_workers, **slow_worker_arguments(args)).validate()
    except ConfigError as error:
        parser.error(f"--{error.field.replace('_', '-')}: {error}")
    if args.max_failures < -1 or args.snapshot_every < 0 or not args.hang_timeout > 0 or not args.replace_timeout > 0:
        parser.error("--max-failures must be >= -1, --snapshot-every >= 0, --hang-timeout and --replace-timeout > 0, "
                     f"got {args.max_failures}, {args.snapshot_every}, {args.hang_timeout} and {args.replace_timeout}")


def run_config(args: argparse.Namespace) -> RunConfig:
    """The shared run config of these flags: ``--steps`` in total, resumed steps included."""
    return RunConfig(
        model=args.model, init_from=args.init_from, untie_embeddings=args.untie_embeddings, tokenizer=args.tokenizer,
        data=args.data, pack=args.pack, seq_len=args.seq_len, steps=args.steps,
        micro_batch_size=args.micro_batch_size, learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10),
        lr_decay_steps=args.steps,  # the whole run's schedule; a resumed scheduler continues it
        eval_every=args.eval_every or args.steps, out=args.out, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, keep_last=args.keep_last, resume=args.resume, progress=args.progress,
        ship_data_limit_bytes=args.ship_data_limit_mb * 2**20,
        pipeline={"num_stages": args.stages, "num_replicas": replicas_for_config(args.replicas),
                  "shard_optimizer": args.shard_optimizer, "num_micro_batches": args.micro_batches,
                  **schedule_arguments(args), **tensor_parallel_arguments(args),
                  "balance": args.balance, "precision": args.precision, **activation_arguments(args),
                  "use_gpu": args.use_gpu,
                  "clip_grad_norm": 1.0, "placement_timeout_s": args.placement_timeout,
                  "metrics_port": args.metrics_port, "metrics_host": args.metrics_host,
                  "max_failures": None if args.max_failures == -1 else args.max_failures,
                  "hang_timeout_s": args.hang_timeout, "replace_timeout_s": args.replace_timeout,
                  **heal_arguments(args), **slow_worker_arguments(args),
                  "boundary_shapes": args.boundary_shapes})


def replicas_text(replicas: int | tuple[int, int]) -> str:
    """``2`` for a fixed run, ``1-2`` for an elastic one."""
    return f"{replicas[0]}-{replicas[1]}" if isinstance(replicas, tuple) else str(replicas)


def format_step(result: StepResult, total_steps: int) -> str:
    """One log line per step: ``step 3/1000 loss 4.1234 grad_norm 0.81 tokens/s 1,234 time 0.52s``."""
    line = (f"step {result.step + 1}/{total_steps} loss {result.loss:.4f} grad_norm {result.grad_norm:.3g} "
            f"tokens/s {result.tokens_per_second:,.0f} time {result.step_time:.2f}s")
    if result.mfu is not None:
        line += f" mfu {result.mfu:.1%}"
    if result.eval_loss is not None and not math.isnan(result.eval_loss):
        line += f" eval_loss {result.eval_loss:.4f}"
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"training {args.init_from or args.model} for {args.steps} steps: "
          f"{replicas_text(args.replicas)} x {args.stages} stages "
          f"({'one GPU' if args.use_gpu else 'one CPU'} each), a step of {args.micro_batches} x "
          f"{max_replicas(args.replicas)} micro-batches of {args.micro_batch_size} x {args.seq_len} tokens, "
          f"{args.precision}, "
          f"activation_checkpoint={args.activation_checkpoint}, "
          f"data {args.data}", flush=True)

    def log_step(result: StepResult) -> None:
        print(format_step(result, args.steps), flush=True)

    summary = train(run_config(args), callback=None if args.progress else log_step,
                    on_start=lambda first_step: print(resume_line(first_step, args), flush=True))
    print_summary(summary, args.out)
    return 0


def resume_line(first_step: int, args: argparse.Namespace) -> str:
    """What this invocation trains, once the newest intact checkpoint (if any) is loaded."""
    if first_step == args.steps:
        return f"nothing to do: {args.checkpoint_dir} holds step {first_step} of --steps {args.steps}"
    if first_step:
        return (f"resuming from the checkpoint of step {first_step} in {args.checkpoint_dir}: "
                f"training steps {first_step + 1}..{args.steps}")
    return f"training steps 1..{args.steps}"


if __name__ == "__main__":
    raise SystemExit(main())
