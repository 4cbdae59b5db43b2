"""raypipe: elastic pipeline-parallel training on Ray and PyTorch, with GPipe, 1F1B,
interleaved 1F1B and zero-bubble schedules."""
from raypipe.config import PipelineConfig
from raypipe.errors import (CheckpointError, ConfigError, NonFiniteError, PlacementError, RaypipeError, StageError,
                            StepAborted)
from raypipe.core.result import OpEvent, StageStats, StepResult

__version__ = "0.1.0"


def __getattr__(name: str):
    # The trainer imports Ray and torch: keep `import raypipe.core.schedule` free of both.
    if name == "PipelineTrainer":
        from raypipe.trainer import PipelineTrainer

        return PipelineTrainer
    if name == "LayerSpec":
        from raypipe.models.layers import LayerSpec

        return LayerSpec
    if name == "LayerCost":
        from raypipe.models.layers import LayerCost

        return LayerCost
    raise AttributeError(f"module 'raypipe' has no attribute {name!r}")


__all__ = ["PipelineConfig", "PipelineTrainer", "LayerSpec", "LayerCost", "StepResult", "StageStats", "OpEvent",
           "CheckpointError", "ConfigError", "NonFiniteError", "PlacementError", "RaypipeError", "StageError", "StepAborted"]
