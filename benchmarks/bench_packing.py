"""Packed documents against today's rows: tokens/s, and the loss per token after the same tokens.

The corpus is the Python standard library (documents from an empty ``__init__.py``
to several hundred KB). Every ``--hold-out``-th file is held out; the rest is
prepared twice from the same files, once as today's rows (documents back to back,
attention and positions running across them) and once packed (``pack=True``: the
same rows, the same order, each document attending only to itself at its own
positions, no target crossing into the next document). Two trainers, same tiny
LLaMA, seed, batch, learning-rate schedule, take turns, round by round
(:mod:`alternate`), each on its own dataset, stepping through it in the same row
order: after every round both have trained on the same number of tokens.

Printed:

* tokens/s per contender (input tokens, rows x seq_len, the same for both; and the
  targets the loss counts, fewer when packed: a document's last token predicts nothing)
  per round, and the ratio packed/unpacked, median [min-max] over rounds;
* the training loss of each contender's last round;
* the loss per token on the held-out documents, each run ALONE through the model (batch
  of one, positions from 0, nothing before it), so neither contender gets context from
  another document: over the first ``seq_len + 1`` tokens of every held-out document,
  and over the held-out documents short enough to be evaluated whole.

    python benchmarks/bench_packing.py --rounds 10 --steps 20 --warmup 5 --seed 1
"""
from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import raypipe
from alternate import add_round_arguments, command_line, print_table, round_medians, round_ratios, spread
from raypipe.data import TokenDataset, prepare
from raypipe.data.corpus import read_documents, stdlib_corpus_files
from raypipe.data.tokenizer import ByteTokenizer
from raypipe.models.llama import get_config, llama_layers, llama_loss
from raypipe.run import llama_count_tokens, warmup_cosine

CONTENDERS = ("unpacked", "packed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_arguments(parser, rounds=8, steps=20, warmup=5)
    parser.add_argument("--stages", type=int, default=2,
                        help="pipeline stages (default 2; packed micro-batches cross stage boundaries as trees)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0,
                        help="the model's initial weights and the row order, the same for both (default 0)")
    parser.add_argument("--hold-out", type=int, default=10, metavar="K",
                        help="every K-th stdlib file is a held-out document (default 10)")
    parser.add_argument("--train-every", type=int, default=3, metavar="J",
                        help="of the other files, every J-th is prepared for training (default 3: plenty of rows "
                             "for the steps run, without preparing the whole library)")
    parser.add_argument("--work", default=None, help="where the two datasets go (default: a temporary directory)")
    return parser.parse_args(argv)


def split_corpus(hold_out: int, train_every: int) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library, by position in its sorted list."""
    files = stdlib_corpus_files()
    held = [path for index, path in enumerate(files) if index % hold_out == 0]
    rest = [path for index, path in enumerate(files) if index % hold_out]
    return rest[::train_every], held


def held_out_sequences(files: list[Path], seq_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per held-out document its BOS + bytes + EOS: (first seq_len + 1 tokens of each, the whole short ones)."""
    tokenizer = ByteTokenizer()
    first, whole = [], []
    for _path, text, _size in read_documents(files, None):
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        document = torch.from_numpy(np.concatenate([[tokenizer.bos_id], ids, [tokenizer.eos_id]]))
        if len(document) < 3:  # an empty file: BOS, EOS
            continue
        first.append(document[: seq_len + 1])
        if len(document) <= seq_len + 1:
            whole.append(document)
    return first, whole


@torch.no_grad()
def alone_loss(model: torch.nn.Module, documents: list[torch.Tensor]) -> float:
    """Loss per predicted token over ``documents``, each run by itself (positions from 0)."""
    total, count = 0.0, 0
    for document in documents:
        if len(document) < 2:
            continue
        logits = model(document[None, :-1])
        total += float(F.cross_entropy(logits[0].float(), document[1:], reduction="sum"))
        count += len(document) - 1
    return total / count


def local_model(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = torch.nn.Sequential(*(spec.build() for spec in llama_layers(get_config("tiny"))))
    model.load_state_dict(state)
    return model.eval()


def make_trainer(args: argparse.Namespace, total_steps: int) -> raypipe.PipelineTrainer:
    config = raypipe.PipelineConfig(num_stages=args.stages, num_micro_batches=args.micro_batches, seed=args.seed)
    optimizer = lambda params: torch.optim.AdamW(params, lr=args.learning_rate, betas=(0.9, 0.95),  # noqa: E731
                                                 weight_decay=0.1)
    return raypipe.PipelineTrainer(llama_layers(get_config("tiny")), llama_loss, optimizer, config,
                                   loss_count_fn=llama_count_tokens,
                                   lr_scheduler=warmup_cosine(max(1, total_steps // 10), total_steps, 0.1))


def stepper(trainer: raypipe.PipelineTrainer, dataset: TokenDataset, log: list):
    """``run(n)``: n steps over the dataset's next rows (the driver reads them); per step (seconds,
    input tokens, counted targets); the training losses go to ``log``."""
    def run(count: int) -> list[tuple[float, int, int]]:
        out = []
        for _ in range(count):
            step = dataset.next_step
            parts = [dataset.get(step, index) for index in range(dataset.num_micro_batches)]
            inputs, targets = [p[0] for p in parts], [p[1] for p in parts]
            start = time.perf_counter()
            result = trainer.step(inputs, targets)
            seconds = time.perf_counter() - start
            dataset.advance()
            log.append(result.loss)
            out.append((seconds, sum(t.numel() for t in targets), sum(llama_count_tokens(t) for t in targets)))
        return out
    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray
    from alternate import run_rounds

    train_files, held = split_corpus(args.hold_out, args.train_every)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_packing-"))
    datasets, prepare_s = {}, {}
    for name in CONTENDERS:
        start = time.perf_counter()
        path = prepare(work / name, corpus=train_files, seq_len=args.seq_len, val_fraction=0.0,
                       pack=name == "packed")
        prepare_s[name] = time.perf_counter() - start
        datasets[name] = TokenDataset(path, "train", args.micro_batch_size, args.micro_batches, seed=args.seed)
    first, whole = held_out_sequences(held, args.seq_len)
    total_steps = args.warmup + args.rounds * args.steps
    rows = datasets["unpacked"].num_rows
    print(f"corpus: {len(train_files)} training files ({rows} rows of {args.seq_len}+1 tokens; "
          f"{total_steps * datasets['unpacked'].rows_per_step} used), {len(held)} held-out documents "
          f"({len(whole)} of them at most {args.seq_len + 1} tokens); prepared in "
          + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in prepare_s.items()), flush=True)
    if total_steps > datasets["unpacked"].steps_per_epoch:
        print(f"note: {total_steps} steps run past one epoch ({datasets['unpacked'].steps_per_epoch} steps)")

    ray.init(num_cpus=max(2, 2 * args.stages), include_dashboard=False, log_to_driver=False)
    losses: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    trainers = {name: make_trainer(args, total_steps) for name in CONTENDERS}
    try:
        contenders = {name: stepper(trainers[name], datasets[name], losses[name]) for name in CONTENDERS}

        def on_round(index: int, results: dict) -> None:
            line = "  ".join(f"{name} {statistics.median(s for s, _, _ in results[name][-args.steps:]) * 1e3:.0f} ms "
                             f"loss {statistics.mean(losses[name][-args.steps:]):.3f}" for name in CONTENDERS)
            print(f"round {index + 1:2d}: {line}", flush=True)

        results = run_rounds(contenders, args.rounds, args.steps, args.warmup, on_round, reverse_odd_rounds=True)
        states = {name: trainers[name].state_dict() for name in CONTENDERS}
    finally:
        for trainer in trainers.values():
            trainer.shutdown()
        ray.shutdown()

    tokens_per_s = {name: [tokens / seconds for seconds, tokens, _ in results[name]] for name in CONTENDERS}
    counted_per_s = {name: [counted / seconds for seconds, _, counted in results[name]] for name in CONTENDERS}
    counted_share = {name: sum(c for _, _, c in results[name]) / sum(t for _, t, _ in results[name])
                     for name in CONTENDERS}
    evals = {name: (alone_loss(local_model(states[name]), first), alone_loss(local_model(states[name]), whole))
             for name in CONTENDERS}
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    trained_tokens = total_steps * datasets["unpacked"].tokens_per_step
    print()
    print(command_line())
    print(f"tiny LLaMA, {args.stages} stage(s), {args.micro_batches} x {args.micro_batch_size} x {args.seq_len} "
          f"tokens a step, seed {args.seed}, {total_steps} steps each ({trained_tokens:,} input tokens), fp32, CPU")
    header = ["", "input tokens/s", "counted targets/s", "targets counted", "train loss (last round)",
              f"held-out loss, first {args.seq_len + 1} tokens of {len(first)} docs, each alone",
              f"held-out loss, {len(whole)} whole short docs, each alone"]
    rows_out = []
    for name in CONTENDERS:
        rows_out.append([name, spread(round_medians(tokens_per_s[name], args.steps), 0),
                         spread(round_medians(counted_per_s[name], args.steps), 0),
                         f"{counted_share[name]:.2%}", f"{statistics.mean(losses[name][-args.steps:]):.4f}",
                         f"{evals[name][0]:.4f}", f"{evals[name][1]:.4f}"])
    rows_out.append(["packed / unpacked", spread(round_ratios(tokens_per_s["packed"], tokens_per_s["unpacked"],
                                                              args.steps)),
                     spread(round_ratios(counted_per_s["packed"], counted_per_s["unpacked"], args.steps)), "",
                     "", f"{evals['packed'][0] - evals['unpacked'][0]:+.4f}",
                     f"{evals['packed'][1] - evals['unpacked'][1]:+.4f}"])
    print_table(header, rows_out)
    print(f"(uniform over bytes: ln 256 = {math.log(256):.4f}; loss differences in nats per token, "
          "negative: packed trains better per token)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
