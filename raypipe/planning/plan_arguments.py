"""The flags of ``raypipe plan`` (the memory plan's and ``--cluster``'s) and ``--gpu-memory``'s type."""
from __future__ import annotations

import argparse

from raypipe.config import add_activation_arguments, parse_replicas
from raypipe.core.schedule import SCHEDULES
from raypipe.models.llama import CONFIGS
from raypipe.planning.memory import AMP_STYLES, PRECISIONS, RAYPIPE_AMP
from raypipe.units import parse_bytes


def memory_size(text: str) -> int:
    """``--gpu-memory``'s type: :func:`~raypipe.units.parse_bytes`, its error as argparse shows one."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``raypipe plan``."""
    parser.add_argument("--model", default="llama-7b", choices=sorted(CONFIGS), help="named model config")
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step and replica (default 1)")
    parser.add_argument("--replicas", type=parse_replicas, default=1, metavar="N|MIN:MAX",
                        help="data-parallel copies of the pipeline (default 1); MIN:MAX plans an elastic run at MIN, "
                             "where each replica runs the most micro-batches")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="ZeRO-1: each replica of a stage keeps 1/replicas of the optimizer state "
                             "(and in bf16 of the fp32 main weights); elastic: 1/MIN")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's max)")
    parser.add_argument("--precision", default=None, choices=PRECISIONS,
                        help="(default: fp32; bf16 with --cluster)")
    add_activation_arguments(parser)
    parser.add_argument("--fused-attention", action=argparse.BooleanOptionalAction, default=True,
                        help="flash-style attention that saves no (s x s) probabilities (default: on)")
    parser.add_argument("--schedule", default="gpipe", choices=SCHEDULES,
                        help="(default gpipe); interleaved_1f1b and zbv hold --virtual-stages chunks a stage")
    parser.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                        help="model chunks per stage: >= 2 for interleaved_1f1b, 2 for zbv, 1 for the others "
                             "(default 1); each stage row then sums its chunks")
    parser.add_argument("--amp", default=None, choices=AMP_STYLES,
                        help="bf16/fp16 style (default: what raypipe runs, "
                             + ", ".join(f"{p}: {s}" for p, s in RAYPIPE_AMP.items()) + "): "
                             "'main_weights' = bf16 compute weights + fp32 main weights and grads (18 B/param); "
                             "'autocast' = fp32 weights under torch.autocast (weight copies per micro-batch); "
                             "'standard' = 2-byte weights and grads + fp32 master (the common 16 B/param)")
    parser.add_argument("--gpu-memory", type=memory_size, default=None, metavar="SIZE",
                        help="device memory per stage, e.g. 80GB or 80GiB; enables fits/suggestions")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cluster = parser.add_argument_group(
        "predicted step time (--cluster)",
        "search replicas x stages = --gpus, micro-batches, schedule (gpipe, 1f1b, zb_h1), recompute and ZeRO-1 for the "
        "highest predicted tokens/s that fits; --stages, --replicas, --micro-batches, --schedule, "
        "--activation-checkpoint and --shard-optimizer are searched, not taken")
    cluster.add_argument("--cluster", metavar="h100|h200|FILE",
                         help="a preset (raypipe/planning/clusters/NAME.json) or a JSON file of that form")
    cluster.add_argument("--gpus", type=int, default=None, metavar="N", help="GPUs of the run (replicas x stages)")
    cluster.add_argument("--global-batch", type=int, default=None, metavar="SEQUENCES",
                         help="fix sequences per step (replicas x micro-batches x micro-batch size); default: "
                              "micro-batches from {stages, 2 x stages, 4 x stages}")
    cluster.add_argument("--top", type=int, default=3, metavar="K", help="configurations printed (default 3)")
    cluster.add_argument("--node-mtbf-hours", type=float, default=None, metavar="H",
                         help="mean hours between failures of one node (a Poisson process per node): adds each "
                              "configuration's goodput per recovery method (raypipe's stage replacement with and "
                              "without warm spares, a full restart from checkpoints, dropping the failed replica's "
                              "step); arXiv 2410.21680's 7.9 h job MTTF at 1,024 GPUs is H ~ 1011")
