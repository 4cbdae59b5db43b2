"""The tensor-parallel collectives of one layer (:class:`LayerCollectives`) and their time on
the stage's ranks (:func:`collective_seconds`), as the step-time predictor adds them to each
layer's compute. No Ray, no torch.

**Ring passes.** On a ring of ``t`` ranks an all-gather or a reduce-scatter of a tensor of ``n``
bytes moves ``(t-1)/t x n`` bytes through each rank's link in ``t - 1`` steps: one *pass*,
``(t-1)/t x n / bandwidth + (t-1) x latency``; an all-reduce is two passes (a reduce-scatter,
then an all-gather). A layer's collectives are (passes, bytes) per collective, for one sequence
(a micro-batch of b sequences moves b times the bytes, at the same latencies). The link is the
stage's node's (``Cluster.intra_node``: a stage's t ranks share a node, NVLink on the presets);
the collectives are not overlapped with compute (a conservative model: they hold the ops that
issue them).

**The LLaMA's plan** (:func:`llama_layer_collectives`), Megatron's f and g around each pair of
column- and row-parallel linears, on the hidden state ``A`` (one sequence's ``seq_len x dim``
in the residual stream's dtype):

============  ====================================  ====================================
layer         without sequence parallelism          with it
============  ====================================  ====================================
embedding     forward: all-reduce of the output     forward: reduce-scatter; backward:
              (row-parallel over the vocabulary)    all-gather of the output's gradient
block         forward: 2 all-reduces (after o and   forward: all-gather before q/k/v and
              down); backward: 2 (the inputs'       gate/up, reduce-scatter after o and
              gradients of q/k/v and gate/up)       down; backward: the conjugates
head          backward: all-reduce of the input's   forward: all-gather of the input;
              gradient                              backward: reduce-scatter
============  ====================================  ====================================

plus, in the head's forward, loss parallelism's three all-reduces of one fp32 per token (the
logits' max, the sum of exponentials, the target's logit). Both columns move the same bytes in
a block (an all-reduce is a reduce-scatter and an all-gather); sequence parallelism halves the
embedding's. A layer's backward collectives belong to its input gradient (a split backward's
``I``), which waits for them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raypipe.models.layers import LayerCost
from raypipe.models.llama_config import LlamaConfig
from raypipe.models.llama_memory import FP32, layer_kinds, stage_input_bytes
from raypipe.planning.cluster_spec import Link

ALL_REDUCE = 2  # ring passes: a reduce-scatter and an all-gather
ALL_GATHER = REDUCE_SCATTER = 1
LOSS_PARALLEL_ALL_REDUCES = 3  # the logits' max, the sum of exponentials, the target's logit (fp32 per token)


@dataclass(frozen=True)
class LayerCollectives:
    """One layer's tensor-parallel collectives for one sequence: (ring passes, bytes) of each,
    in its forward and in its backward (see the module docstring)."""

    forward: tuple[tuple[int, float], ...] = ()
    backward: tuple[tuple[int, float], ...] = ()


def block_collectives(cost: LayerCost) -> LayerCollectives:
    """A transformer block's collectives in Megatron's plan, on the layer's output
    (``cost.output_bytes``): two all-reduces in forward and two in backward. The predictor's
    default for a layer of any model at ``tensor_parallel`` > 1."""
    pair = ((ALL_REDUCE, float(cost.output_bytes)),) * 2
    return LayerCollectives(pair, pair)


def llama_layer_collectives(config: LlamaConfig, seq_len: int, precision: str = "bf16", amp: str | None = None,
                            sequence_parallel: bool = True) -> list[LayerCollectives]:
    """Each layer of ``llama_layers(config)``'s collectives under the LLaMA's tensor-parallel plan
    (the module docstring's table), for one sequence of ``seq_len`` tokens."""
    hidden = float(stage_input_bytes(config, 1, 1, seq_len, precision, amp))  # one sequence's hidden state
    loss = ((ALL_REDUCE, float(FP32 * seq_len)),) * LOSS_PARALLEL_ALL_REDUCES
    if sequence_parallel:
        gather, scatter = (ALL_GATHER, hidden), (REDUCE_SCATTER, hidden)
        by_kind = {"embedding": LayerCollectives((scatter,), (gather,)),
                   "block": LayerCollectives((gather, scatter) * 2, (scatter, gather) * 2),
                   "head": LayerCollectives((gather, *loss), (scatter,))}
    else:
        reduce = (ALL_REDUCE, hidden)
        by_kind = {"embedding": LayerCollectives((reduce,), ()),
                   "block": LayerCollectives((reduce,) * 2, (reduce,) * 2),
                   "head": LayerCollectives(loss, (reduce,))}
    return [by_kind[kind] for kind in layer_kinds(config)]


def collective_seconds(collectives: Sequence[tuple[int, float]], tensor_parallel: int, link: Link,
                       micro_batch_size: int) -> float:
    """The time of ``collectives`` ((passes, bytes per sequence) each) for one micro-batch of
    ``micro_batch_size`` sequences on a ring of ``tensor_parallel`` ranks over ``link``."""
    return sum(link.ring_seconds(passes, micro_batch_size * size, tensor_parallel) for passes, size in collectives)
