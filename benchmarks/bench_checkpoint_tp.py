"""A checkpoint's write at t = 2 beside t = 1 (issue 60, item 3): what gathering split layers whole costs.

Two trainers of the same LLaMA (default: vocabulary 8192, dim 512, 4 blocks of 8 heads, FFN 1408:
~21M parameters, ~250 MB of weights and AdamW moments) on 2 stages, one at ``tensor_parallel=1``
and one at ``tensor_parallel=2`` (sequence parallel), alive together on one private local Ray
instance and taking turns round by round: each round steps each trainer once and then times its
``save_checkpoint(uri, wait=True)`` (the workers' host copy, the gather of each split tensor over
the stage's ranks at t = 2, tp_rank 0's write, the manifest). Checkpoints at t > 1 hold whole
layers (the files of t = 1, loadable into any layout), so the extra cost at t = 2 is the gather;
the alternative, slices per rank, would make every load read t files per layer.

    RAY_worker_niceness=0 python benchmarks/bench_checkpoint_tp.py --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray
import torch

import raypipe
from alternate import command_line
from raypipe.models.llama import LlamaConfig, llama_layers, llama_loss


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(command_line())
    config = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=8,
                         ffn_dim=1408, max_seq_len=64)
    ray.init(address="local", num_cpus=6, include_dashboard=False, logging_level="WARNING")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (4, 65), generator=generator)
    x, y = tokens[:, :-1], tokens[:, 1:]
    trainers = {t: raypipe.PipelineTrainer(llama_layers(config), llama_loss, adamw,
                                           raypipe.PipelineConfig(num_stages=2, num_micro_batches=2,
                                                                  tensor_parallel=t, snapshot_every=0))
                for t in (1, 2)}
    seconds: dict[int, list[float]] = {1: [], 2: []}
    try:
        for trainer in trainers.values():
            trainer.step(x, y)
        with tempfile.TemporaryDirectory() as root:
            for round_number in range(args.rounds):
                order = (1, 2) if round_number % 2 == 0 else (2, 1)
                for t in order:
                    trainers[t].step(x, y)
                    start = time.perf_counter()
                    trainers[t].save_checkpoint(f"{root}/t{t}-{round_number}", wait=True)
                    seconds[t].append(time.perf_counter() - start)
                print(f"round {round_number}: t=1 {seconds[1][-1]:.3f} s, t=2 {seconds[2][-1]:.3f} s", flush=True)
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
        ray.shutdown()
    ratios = [two / one for one, two in zip(seconds[1], seconds[2])]
    parameters = sum(p.numel() for spec in llama_layers(config) for p in spec.build("meta").parameters())
    print(f"{parameters / 1e6:.1f}M parameters; save_checkpoint(wait=True) median t=1 "
          f"{statistics.median(seconds[1]):.3f} s [{min(seconds[1]):.3f}-{max(seconds[1]):.3f}], t=2 "
          f"{statistics.median(seconds[2]):.3f} s [{min(seconds[2]):.3f}-{max(seconds[2]):.3f}]; t=2 / t=1 per round "
          f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
