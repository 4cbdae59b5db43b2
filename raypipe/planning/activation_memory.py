"""Activation bytes of one LLaMA layer for one micro-batch: moved to
:mod:`raypipe.models.llama_memory`, so that ``llama_layers`` can put the same figures in
each layer's :class:`~raypipe.models.layers.LayerCost`; the names stay importable here."""
from __future__ import annotations

from raypipe.models.llama_memory import (  # noqa: F401 (re-exported)
    AMP_STYLES,
    FP32,
    INDEX,
    LAYER_KINDS,
    PRECISIONS,
    RAYPIPE_AMP,
    activation_breakdown,
    amp_style,
    estimate_layer_activation_bytes,
    layer_kinds,
    layer_parameter_counts,
    stage_input_bytes,
)

__all__ = ["AMP_STYLES", "FP32", "INDEX", "LAYER_KINDS", "PRECISIONS", "RAYPIPE_AMP", "activation_breakdown",
           "amp_style", "estimate_layer_activation_bytes", "layer_kinds", "layer_parameter_counts",
           "stage_input_bytes"]
