"""A training run from a flat config: data, LLaMA model, trainer, outputs.

Shared by ``jobs/train_tiny.py``, ``jobs/train_7b.py`` and ``raypipe train``.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raypipe.config import PipelineConfig
from raypipe.core.validation import check_bool, check_int, from_mapping

logger = logging.getLogger(__name__)


@dataclass
class RunConfig:
    """Everything one training run needs; ``pipeline`` holds PipelineConfig fields."""

    model: str = "tiny"  # a named config (raypipe.models.llama.CONFIGS); ignored with init_from
    init_from: str | None = None  # a Hugging Face LLaMA directory (or s3:// / gs:// URI) to start from
    untie_embeddings: bool = False  # with init_from: accept tie_word_embeddings, training the head apart
    tokenizer: str | None = None  # Hugging Face tokenizer directory preparing ``data``; None: bytes
    data: str | None = None  # prepared dataset (local path or s3:// / gs:// URI); None: the stdlib, in the cache
    prepare_if_missing: bool = True  # prepare the stdlib corpus at ``data`` if absent
    pack: bool = False  # packed documents (``raypipe prepare --pack``): each attends only to itself; the default
    # stdlib dataset is prepared packed, in its own cache directory; a given ``data`` must be packed
    steps: int = 200  # the run's total: a resumed run trains the steps its checkpoint does not hold yet
    seq_len: int | None = None  # tokens per sequence; None: the model's max_seq_len
    micro_batch_size: int = 2
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 10  # linear warm-up, then cosine decay to min_lr_ratio * learning_rate
    lr_decay_steps: int | None = None  # None: decay over ``steps``
    min_lr_ratio: float = 0.1
    eval_every: int = 50
    eval_steps: int = 2
    out: str = "runs/tiny"
    checkpoint_dir: str | None = None  # default: OUT/checkpoints
    checkpoint_every: int = 0
    keep_last: int | None = None  # checkpoints kept (the newest); None: all
    resume: bool = True  # continue from the newest intact checkpoint in checkpoint_dir, so a rerun finishes the run
    progress: bool = True
    ship_data_limit_bytes: int | None = None  # a local dataset a stage cannot open is shipped up to this; None: 1 GiB
    pipeline: dict[str, Any] = field(default_factory=lambda: {"num_stages": 2, "num_micro_batches": 8})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """Build from a mapping (e.g. a YAML file); unknown keys, here or in ``pipeline``, and the
        renamed activation-checkpointing keys raise a ConfigError naming them."""
        run = from_mapping(cls, values, "run config")
        run.validate()
        PipelineConfig.from_dict(run.pipeline)  # fail now, before any data is prepared
        return run

    def validate(self) -> None:
        """The checks a run config can make before any data is prepared (ConfigError naming the field)."""
        check_bool("pack", self.pack)


def llama_count_tokens(targets: torch.Tensor) -> int:
    """The tokens the LLaMA loss averages over (those not ignored)."""
    from raypipe.models.llama import IGNORE_INDEX

    return int((targets != IGNORE_INDEX).sum())


def train(run: RunConfig, callback: Callable[[Any], None] | None = None,
          on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train the run up to ``run.steps`` steps in total and write summary.json, the loss curve, trace and
    checkpoints to ``run.out``.

    With ``run.resume`` (the default) it first loads the newest intact checkpoint in the checkpoint
    directory with its data position, so running the same config again after a crash (of the driver,
    the head, the whole cluster) finishes the same run: the steps since that checkpoint are trained
    again, each on its own data, and the result is bitwise that of a run never interrupted. The
    outputs then cover only the steps this call trained (``first_step`` on); ``steps`` is the run's
    total. A checkpoint already at ``run.steps`` leaves nothing to do: no step runs and no output is
    rewritten (the summary says ``steps_run: 0``).

    ``on_start(first_step)`` is called once the trainer is ready (after any resume), and
    ``callback(result)`` with each step's StepResult (e.g. to log a line per step where there is no
    progress bar).
    """
    from raypipe.models.llama import llama_loss
    from raypipe.models.llama_costs import with_llama_costs
    from raypipe.trainer import PipelineTrainer

    check_int("steps", run.steps, 1, allowed="must be an int >= 1 (the run's total optimizer steps)")
    run.validate()
    pipeline = PipelineConfig.from_dict(run.pipeline)
    layers, model, seq_len = _model(run)
    # costs for the run's sequences and precision, which balance="time" splits the stages by
    layers = with_llama_costs(layers, model, seq_len, pipeline.precision)
    data, datasets = _datasets(run, pipeline, model, seq_len)
    out = Path(run.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = run.checkpoint_dir or str(out / "checkpoints")
    _check_checkpoint_dir(checkpoint_dir, run)
    optimizer = _adamw(run.learning_rate, run.weight_decay)
    schedule = warmup_cosine(run.warmup_steps, run.lr_decay_steps or run.steps, run.min_lr_ratio)
    with PipelineTrainer(layers, llama_loss, optimizer, pipeline,
                         loss_count_fn=llama_count_tokens, lr_scheduler=schedule) as trainer:
        first_step = _resume(trainer, datasets[0], checkpoint_dir) if run.resume else 0
        if on_start is not None:
            on_start(first_step)
        if first_step == run.steps:
            return {"steps": run.steps, "steps_run": 0, "first_step": first_step, "resumed_from_step": first_step,
                    "checkpoint_dir": checkpoint_dir, "data": data}
        results = trainer.fit(datasets[0], run.steps - first_step, validation=datasets[1], eval_every=run.eval_every,
                              eval_steps=run.eval_steps, checkpoint_dir=checkpoint_dir,
                              checkpoint_every=run.checkpoint_every, keep_last=run.keep_last, progress=run.progress,
                              callback=callback, ship_data_limit_bytes=run.ship_data_limit_bytes)
        placement = _placement(trainer)
    summary = {**_summary(run, results, trainer.num_parameters, checkpoint_dir, first_step), "data": data,
               **placement}
    _write_outputs(out, results, summary)
    return summary


def _datasets(run: RunConfig, pipeline: PipelineConfig, model: Any, seq_len: int) -> tuple[str, list]:
    """The dataset's path (prepared if missing and allowed) and its train and validation readers."""
    from raypipe.data import TokenDataset, prepare

    data = dataset_path(run.data, seq_len, run.tokenizer, pack=run.pack)
    if run.prepare_if_missing and "://" not in data and not (Path(data) / "manifest.json").exists():
        # only when absent: re-preparing would replace a dataset made from another corpus with the stdlib
        prepare(data, seq_len=seq_len, tokenizer=_tokenizer(run.tokenizer), pack=run.pack)
    per_step = pipeline.micro_batches_per_step  # whoever runs them
    datasets = [TokenDataset(data, split, run.micro_batch_size, per_step, seed=pipeline.seed,
                             vocab_size=model.vocab_size) for split in ("train", "validation")]
    _check_dataset_seq_len(data, datasets[0].seq_len, run.seq_len, model.max_seq_len)
    _check_dataset_tokenizer(data, datasets[0].tokenizer_name, run.tokenizer)
    check_dataset_packed(data, datasets[0].packed, run.pack)
    return data, datasets


def _check_checkpoint_dir(checkpoint_dir: str, run: RunConfig) -> None:
    """Refuse, before any actor starts, a checkpoint directory this run would save over."""
    from raypipe.checkpoint.store import latest_checkpoint

    newest = latest_checkpoint(checkpoint_dir)
    if newest is None:
        return
    if not run.resume:
        raise ValueError(f"{checkpoint_dir} holds checkpoints of an earlier run (the newest: step {newest}) and "
                         "resume=False would save over them: resume it (resume=True, --resume), or give this run an "
                         "empty checkpoint directory")
    if newest > run.steps:
        raise ValueError(f"{checkpoint_dir} holds step {newest}, past the run's steps={run.steps}: it is another "
                         "run's; give this run its own checkpoint directory, or the steps of that run")


def _resume(trainer: Any, dataset: Any, checkpoint_dir: str) -> int:
    """Load the newest intact checkpoint (if any) and its data position; the step training continues from.

    The complete checkpoints after it are damaged (the load fell back past them): they are deleted,
    with a warning, because this run saves those steps again and a complete checkpoint is never
    overwritten."""
    from raypipe.checkpoint.store import delete_checkpoint, list_checkpoints

    if not _has_checkpoint(checkpoint_dir):
        return 0
    extra = trainer.load_checkpoint(checkpoint_dir)
    dataset.load_state_dict(extra["dataset"])
    for damaged in (step for step in list_checkpoints(checkpoint_dir) if step > trainer.step_count):
        logger.warning("raypipe: deleting the damaged checkpoint of step %d in %s: this run saves it again",
                       damaged, checkpoint_dir)
        delete_checkpoint(checkpoint_dir, damaged)
    return trainer.step_count


def dataset_path(data: str | None, seq_len: int, tokenizer: str | None = None, pack: bool = False) -> str:
    """``data``, or where the default stdlib dataset of ``seq_len`` (and ``tokenizer``, a Hugging Face
    tokenizer directory; None: bytes; ``pack``: packed documents) lives: the user's cache, never a job's
    working directory (which Ray may unpack anew, or remove, under the stages reading it). A packed
    dataset and an unpacked one never share a directory."""
    from raypipe.data.cache import default_dataset_dir

    if data is not None:
        return data
    return str(default_dataset_dir(seq_len, tokenizer="byte" if tokenizer is None else f"hf:{tokenizer}",
                                   pack=pack))


def _model(run: RunConfig) -> tuple[list, Any, int]:
    """The model's layers, its LlamaConfig and the run's sequence length."""
    from raypipe.models.hf import from_pretrained
    from raypipe.models.llama import get_config, llama_layers

    if run.init_from is None:
        config = get_config(run.model)
        return llama_layers(config), config, _seq_len(run.seq_len, config.max_seq_len)
    if run.seq_len is None:
        raise ValueError(f"init_from={run.init_from!r} needs seq_len: the training sequence length (the checkpoint's max_position_embeddings, often 131072, is no default)")
    layers = from_pretrained(run.init_from, max_seq_len=run.seq_len, untie_embeddings=run.untie_embeddings)
    return layers, layers[0].args[0], run.seq_len


def _tokenizer(directory: str | None):
    from raypipe.data.tokenizer import HFTokenizer

    return None if directory is None else HFTokenizer(directory)


def _check_dataset_tokenizer(data: str, found: str, directory: str | None) -> None:
    """A run with a Hugging Face tokenizer refuses data of another kind (e.g. bytes). The directory
    itself is not compared: data is often prepared on another machine, under another path."""
    if directory is not None and not found.startswith("hf:"):
        raise ValueError(f"dataset {data} was prepared with tokenizer {found!r}, the run asks for {directory}: "
                         f"prepare it with `raypipe prepare --tokenizer {directory}`")


def check_dataset_packed(data: str, packed: bool, pack: bool) -> None:
    """The run trains on packed documents exactly when it asks to (``pack``): a dataset of the
    other kind is refused, naming what to prepare, rather than trained on silently."""
    if pack and not packed:
        raise ValueError(f"dataset {data} is not packed, the run asks for pack=True (--pack): prepare it with "
                         f"`raypipe prepare --pack`, or give the run another dataset")
    if packed and not pack:
        raise ValueError(f"dataset {data} is packed (prepared with --pack), the run asks for pack=False: set "
                         f"pack: true (--pack) to train on it, or give the run an unpacked dataset")


def _seq_len(requested: int | None, max_seq_len: int) -> int:
    if requested is None:
        return max_seq_len
    if isinstance(requested, bool) or not isinstance(requested, int) or not 1 <= requested <= max_seq_len:
        raise ValueError(f"seq_len={requested!r}: must be an int in 1..{max_seq_len} (the model's max_seq_len)")
    return requested


def _check_dataset_seq_len(data: str, found: int, requested: int | None, max_seq_len: int) -> None:
    """Rows are read whole, so the dataset must hold the requested length (or, if none, fit the model)."""
    if requested is not None and found != requested:
        raise ValueError(f"dataset {data} holds sequences of {found} tokens, the run asks for seq_len={requested}: "
                         f"prepare it with `raypipe prepare --seq-len {requested}`")
    if found > max_seq_len:
        raise ValueError(f"dataset {data} holds sequences of {found} tokens, more than the model's "
                         f"max_seq_len={max_seq_len}: prepare it with a smaller --seq-len")


def _adamw(learning_rate: float, weight_decay: float):
    def build(params):
        return torch.optim.AdamW(params, lr=learning_rate, betas=(0.9, 0.95), weight_decay=weight_decay)

    return build


def warmup_cosine(warmup_steps: int, decay_steps: int, min_ratio: float):
    """A LambdaLR factory: linear warm-up over ``warmup_steps``, then cosine to ``min_ratio``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def build(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    return build


def _has_checkpoint(checkpoint_dir: str) -> bool:
    from raypipe.checkpoint.store import latest_checkpoint

    return latest_checkpoint(checkpoint_dir) is not None


def _summary(run: RunConfig, results: list, num_parameters: int, checkpoint_dir: str,
             first_step: int) -> dict[str, Any]:
    """The run's totals and this call's part: losses (and the loss curve, trace, throughput) cover the
    steps trained here, ``first_step`` to ``steps - 1``; ``resumed_from_step`` is None for a fresh run."""
    eval_losses = [r.eval_loss for r in results if r.eval_loss is not None]
    timed = results[1:] or results  # the first step includes warm-up
    tokens_per_second = sum(r.num_tokens for r in timed) / sum(r.step_time for r in timed)
    return {
        "model": run.init_from or run.model, "num_parameters": num_parameters, "steps": results[-1].step + 1,
        "steps_run": len(results), "first_step": first_step, "resumed_from_step": first_step or None,
        "initial_loss": results[0].loss, "final_loss": results[-1].loss,
        "final_eval_loss": eval_losses[-1] if eval_losses else math.nan,
        "tokens_per_second": tokens_per_second,
        "uniform_byte_loss": math.log(256), "checkpoint_dir": checkpoint_dir,
        "pipeline": run.pipeline, "losses": [r.loss for r in results],
    }


def _placement(trainer: Any) -> dict[str, Any]:
    """Which node the driver and each stage worker ran on (multi-node runs are checked by it)."""
    import ray

    return {"driver_node_id": ray.get_runtime_context().get_node_id(),
            "workers": [{"replica": w.replica, "stage": w.stage, "node_id": w.node_id} for w in trainer.workers]}


def _write_outputs(out: Path, results: list, summary: dict[str, Any]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _plot_losses(out / "loss.png", results)
    from raypipe.observability.trace import plot_gantt, write_chrome_trace

    write_chrome_trace(results[-1].timeline, out / "trace.json", results[-1].marks)
    plot_gantt(results[-1].timeline, out / "timeline.png", title=f"step {results[-1].step}", marks=results[-1].marks)


def _plot_losses(path: Path, results: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot([r.step for r in results], [r.loss for r in results], label="train loss")
    evals = [(r.step, r.eval_loss) for r in results if r.eval_loss is not None]
    if evals:
        axis.plot(*zip(*evals), "o-", label="eval loss")
    axis.axhline(math.log(256), color="grey", linestyle="--", label="uniform over bytes, ln 256")
    axis.set_xlabel("step")
    axis.set_ylabel("cross entropy (nats/token)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
