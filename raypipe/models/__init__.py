"""Models that raypipe ships as lists of pipeline layers."""
from raypipe.models.llama import (
    CONFIGS,
    LlamaBlock,
    LlamaConfig,
    LlamaEmbedding,
    LlamaHead,
    get_config,
    llama_layers,
    llama_loss,
    num_parameters,
)

__all__ = ["CONFIGS", "LlamaBlock", "LlamaConfig", "LlamaEmbedding", "LlamaHead", "get_config",
           "llama_layers", "llama_loss", "num_parameters"]
