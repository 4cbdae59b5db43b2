"""What activation checkpointing costs and saves: tiny LLaMA, 2 stages, GPipe, CPU.

Three trainers on the same model, batch and seed live side by side and take
turns, round by round (their actors sit idle while another one steps, so each
gets the two cores alone and load from other users of the CPU hits all alike):

* ``activation_checkpoint="never"``: every stage keeps each micro-batch's autograd graph;
* ``activation_checkpoint="always"``: only the stage inputs; backward recomputes the forward;
* ``activation_checkpoint="always", offload_activations=True``: the kept inputs live in Ray's object store.

Printed: median step time per mode and the ratio always/never (theory 4/3 when
a backward costs two forwards: F + B + F over F + B; target <= 1.40), the mean
F and B op times per mode from the measured timeline, and per stage the peak
bytes held for backward (``StepResult.stages``) and their ratio always/never;
for offload also the bytes offloaded to the object store.

    python benchmarks/bench_recompute.py --rounds 5 --steps 3
"""
from __future__ import annotations

import argparse
import statistics

import ray
import torch

import raypipe
from alternate import add_round_arguments, run_alternating
from raypipe.models.llama import get_config, llama_layers, llama_loss

MODES = {  # name -> PipelineConfig fields
    "never": {"activation_checkpoint": "never"},
    "always": {"activation_checkpoint": "always"},
    "always+offload": {"activation_checkpoint": "always", "offload_activations": True},
}
NUM_STAGES = 2


def make_batch(args: argparse.Namespace, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets, ``micro_batches * micro_batch_size`` sequences."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (args.micro_batches * args.micro_batch_size, args.seq_len + 1),
                           generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_trainer(args: argparse.Namespace, mode: dict) -> raypipe.PipelineTrainer:
    model = get_config("tiny").replace(n_layers=args.layers, max_seq_len=args.seq_len)
    config = raypipe.PipelineConfig(num_stages=NUM_STAGES, num_micro_batches=args.micro_batches, **mode)
    return raypipe.PipelineTrainer(llama_layers(model), llama_loss,
                                   optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), config=config)


def op_means(results: list[raypipe.StepResult], op: str) -> float:
    """Mean duration in ms of the ``op`` events (F or B) over all stages and steps."""
    durations = [e.end - e.start for r in results for e in r.timeline if e.op == op]
    return 1e3 * statistics.mean(durations)


def print_round(index: int, results: dict[str, list[raypipe.StepResult]], steps: int) -> None:
    latest = {name: statistics.median(r.step_time for r in res[-steps:]) for name, res in results.items()}
    print(f"round {index + 1}: " + "  ".join(f"{n} {1e3 * t:.1f} ms" for n, t in latest.items()))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=5, steps=3, warmup=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks of the tiny LLaMA")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    # One logical CPU per stage actor of every trainer; only one trainer computes at a time.
    ray.init(num_cpus=NUM_STAGES * len(MODES), include_dashboard=False, logging_level="WARNING")
    print(f"torch {torch.__version__}, ray {ray.__version__}; tiny LLaMA ({args.layers} blocks, dim 128), "
          f"{NUM_STAGES} stages, m={args.micro_batches}, micro-batch {args.micro_batch_size}x{args.seq_len} tokens")
    trainers = {name: make_trainer(args, mode) for name, mode in MODES.items()}
    inputs, targets = make_batch(args, get_config("tiny").vocab_size)
    results = run_alternating(trainers, {name: (inputs, targets) for name in trainers}, args,
                              on_round=lambda index, results: print_round(index, results, args.steps))
    report(results)


def report(results: dict[str, list[raypipe.StepResult]]) -> None:
    medians = {name: statistics.median(r.step_time for r in res) for name, res in results.items()}
    for name, res in results.items():
        print(f"{name:15s} median step {1e3 * medians[name]:7.1f} ms over {len(res)} steps; "
              f"mean F {op_means(res, 'F'):6.1f} ms, mean B {op_means(res, 'B'):6.1f} ms")
    ratio = medians["always"] / medians["never"]
    print(f"step-time ratio always/never = {ratio:.3f} (theory 4/3 = 1.333; target <= 1.40: "
          f"{'met' if ratio <= 1.40 else 'MISSED'})")
    print(f"step-time ratio always+offload/never = {medians['always+offload'] / medians['never']:.3f}")
    for stage in range(NUM_STAGES):
        # Peaks are the same every step (same shapes); take the last step's.
        held = {name: res[-1].stages[stage].held_for_backward_bytes for name, res in results.items()}
        offloaded = results["always+offload"][-1].stages[stage].offloaded_bytes
        print(f"stage {stage}: held for backward never {held['never'] / 2**20:.2f} MiB, "
              f"always {held['always'] / 2**20:.2f} MiB (ratio always/never {held['always'] / held['never']:.3f}), "
              f"always+offload {held['always+offload'] / 2**20:.2f} MiB held + {offloaded / 2**20:.2f} MiB offloaded")


if __name__ == "__main__":
    main()
