"""A plan's per-stage rows: the memory model's figures of a stage, its layers described and
the host memory of one snapshot of its worker."""
from __future__ import annotations

from raypipe.models.llama import LlamaConfig
from raypipe.planning.memory import StageMemory


def snapshot_bytes(stage: StageMemory) -> int:
    """One in-memory snapshot of a worker of ``stage`` (host memory, object store): its
    layers' weights (fp32 main weights under mixed precision; with ZeRO-1 those it owns,
    and the compute weights of the others) and its optimizer state."""
    if not stage.master_bytes:
        return stage.parameters_bytes + stage.optimizer_bytes
    owned_share = stage.master_bytes / (4 * stage.num_parameters)  # fp32 main weights: 4 B each
    return stage.master_bytes + round(stage.parameters_bytes * (1 - owned_share)) + stage.optimizer_bytes


def describe_layers(config: LlamaConfig, layers: list[int]) -> str:
    """Global layer indices as "embedding + blocks 0-3" etc.; a worker's model chunks (runs of
    consecutive layers) one after the other, joined by " | "."""
    runs: list[list[int]] = []
    for index in layers:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return " | ".join(_describe_run(config, run) for run in runs)


def _describe_run(config: LlamaConfig, layers: list[int]) -> str:
    parts = []
    if layers[0] == 0:
        parts.append("embedding")
    blocks = [index - 1 for index in layers if 1 <= index <= config.n_layers]
    if blocks:
        parts.append(f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}")
    if layers[-1] == config.n_layers + 1:
        parts.append("head")
    return " + ".join(parts)


def stage_rows(config: LlamaConfig, stages: list[StageMemory]) -> list[dict]:
    """Each stage's figures as a row of a plan, with its layers described and its snapshot size."""
    rows = []
    for stage in stages:
        row = stage.to_dict()
        row["description"] = describe_layers(config, stage.layers)
        row["snapshot_bytes"] = snapshot_bytes(stage)
        rows.append(row)
    return rows
