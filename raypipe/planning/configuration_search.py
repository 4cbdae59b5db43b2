"""The search ``raypipe plan --cluster`` runs over configurations of a LLaMA (replicas,
stages, tensor parallelism, micro-batches, schedule, recompute, ZeRO-1), each step predicted by
:mod:`raypipe.planning.predict`, each stage's memory checked by :class:`LlamaStageBytes`.
No Ray, no torch.

**The search** (:func:`search_plans`): for each tensor-parallel degree ``t`` of
:data:`SEARCH_TENSOR_PARALLEL` that can run (:func:`check_tensor_parallel_degree`: it divides the heads,
KV heads, FFN width and the GPU count, at most a node's GPUs; or the one given), for every ``p``
dividing ``N / t`` up to the layer count, ``d = N / (p t)``, micro-batches ``m`` in
``{p, 2p, 4p}`` (or what a fixed global batch leaves), micro-batch sizes 1 and 2, the runnable
schedules (gpipe, 1F1B, zb_h1, and at v = 2 chunks per worker interleaved_1f1b where it runs m (m
in m // p equal rounds) and zbv, both where the layers make 2p virtual stages), recompute never
and always, ZeRO-1 off and on (d > 1), sequence parallelism on at t > 1 unless turned off: the
layers balanced by time (``--balance time``), or, where that split does not fit, the fastest split
that does (the memory model's exact DP, printed as a list; a chunked schedule only by time: the DP
bounds contiguous stages, and a worker's chunks are not); a configuration that fits nowhere is
dropped. A configuration at t > 1 whose pipeline (p, m, b, schedule, v) fits at t / 2 recomputing
no more is not checked: under the model it is no faster (the same bubble, each op's compute halved
but its collectives not, the messages, reduction and optimizer step about the same share of the
step); searching t = 1, 2, 4, 8 still takes the 405B on 16384 GPUs ~4x the CPU time of t = 1 alone
(~60 s against ~13 s on 2026-12-05). A candidate at t > 1 snapshots as one at t = 1 does (each
rank its local shards: 1/t of a split layer's state). Candidates are simulated in order of an
optimistic step time (the busiest stage's compute, plus the F and B of the stages before it and
the messages between, plus the optimizer tail; a chunked schedule's:
:func:`raypipe.planning.predict._chunked_pipeline_bound`), which no simulated step undercuts, and
the search stops when the next optimistic figure cannot beat the ``top``-th best found: the result
is the exact best under the model (at each t; across t, but for the rule above). Chunked
candidates are pruned by the same rule, not by a heuristic: their bound is near their simulated
step (interleaving's is its ideal fill and drain), so only those that could enter the top are
timed, and the timed simulation's dry-run is run once per chunked shape
(``simulate_timed(events=)``): the 405B search on 16384 GPUs at t = 1 simulates 2 of them.

**Snapshots** (``snapshot_every=None``, the default): each simulated candidate snapshots every
step unless its copy would be exposed by more than :data:`SNAPSHOT_OVERHEAD` of the step without
it; then every ``k`` steps, the smallest of :data:`SNAPSHOT_CADENCES` within it (a heal then
redoes up to ``k - 1`` steps), as the command line it prints says (``--snapshot-every k``). A big
stage's state copied every step can cost more than the step (a 7B on 8 stages at m = 8: 2.4x).
"""
from __future__ import annotations

import bisect
import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from raypipe.core.collector_paused import collector_paused
from raypipe.core.ops import F, I, W
from raypipe.core.partition import worker_chunks
from raypipe.core.schedule import PLACEMENT, SINGLE_CHUNK_SCHEDULES, interleaved_runs
from raypipe.models.llama import LlamaConfig
from raypipe.models.llama_costs import llama_layer_costs
from raypipe.models.llama_memory import (estimate_layer_activation_bytes, layer_gradient_counts, layer_kinds,
                                         layer_parameter_counts, stage_input_bytes, static_bytes_per_parameter)
from raypipe.planning.balance import fastest_split_within, layer_step_flops, min_max_partition
from raypipe.planning.cluster_spec import Cluster
from raypipe.planning.pipeline_prediction import shared_schedule_ops
from raypipe.planning.predict import (Prediction, StepShape, optimistic_step_s, pipeline_runs, predict_split,
                                      stage_bounds, worker_sums)
from raypipe.planning.step_shape import check_shape
from raypipe.planning.tensor_parallel_collectives import LayerCollectives, llama_layer_collectives

# the chunked schedules at v = 2: zbv holds exactly 2; interleaving's bubble shrinks as 1/v for v times the
# messages, and v = 2 takes most of the gain (1/2 of 1F1B's bubble) at the least traffic and fewest shapes to time
SEARCH_VIRTUAL_STAGES = {"interleaved_1f1b": 2, "zbv": 2}
SEARCH_SCHEDULES = (*SINGLE_CHUNK_SCHEDULES, *SEARCH_VIRTUAL_STAGES)
SEARCH_RECOMPUTE = ("never", "always")
SEARCH_MICRO_BATCH_SIZES = (1, 2)
SEARCH_MICRO_BATCHES_PER_STAGE = (1, 2, 4)  # m = p, 2p, 4p: a bubble of at most (p-1)/(5p-1) ~ 20% at 4p
SNAPSHOT_OVERHEAD = 0.03  # the most of a step an exposed snapshot copy may add (issue 40's 1.03)
SNAPSHOT_CADENCES = (1, 2, 4, 8, 16, 32, 64)  # snapshot_every values the search picks from
SEARCH_TENSOR_PARALLEL = (1, 2, 4, 8)  # GPUs per stage: those dividing the heads, KV heads, FFN width and a node

@dataclass(frozen=True)
class Candidate:
    """One configuration the search evaluated, with its prediction."""

    shape: StepShape
    balance_mode: str  # "time" (--balance time) or "memory" (the fastest split that fits: a list)
    prediction: Prediction

    def to_dict(self) -> dict:
        shape = self.shape
        return {"num_replicas": shape.num_replicas, "num_stages": shape.num_stages,
                "num_micro_batches": shape.num_micro_batches, "micro_batch_size": shape.micro_batch_size,
                "seq_len": shape.seq_len, "schedule": shape.schedule,
                "activation_checkpoint": shape.activation_checkpoint, "shard_optimizer": shape.shard_optimizer,
                "precision": shape.precision, "snapshot_every": shape.snapshot_every,
                "virtual_stages": shape.virtual_stages, "tensor_parallel": shape.tensor_parallel,
                "sequence_parallel": shape.sequence_sharded,
                "balance_mode": self.balance_mode, **self.prediction.to_dict()}


@dataclass
class SearchResult:
    """The best configurations, fastest first; ``smallest_stage_bytes`` and ``reason`` say
    why nothing fits when ``best`` is empty."""

    best: list[Candidate]
    evaluated: int  # configurations whose memory was checked
    simulated: int  # configurations simulated
    reason: str | None = None
    smallest_stage_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


class LlamaStageBytes:
    """A LLaMA stage's total memory as :func:`~raypipe.planning.memory.estimate_stage` counts it
    (no offload, no segments; one tensor-parallel rank's at ``shape.tensor_parallel`` > 1, and
    :meth:`parameters` that rank's), fast enough for the search: per schedule shape, the pairs
    (kept graphs, kept inputs) the schedule's walk can peak at, reused for every split."""

    def __init__(self, config: LlamaConfig, shape: StepShape, fused_attention: bool = True) -> None:
        self.config, self.shape = config, shape
        kinds = layer_kinds(config)
        t = shape.tensor_parallel
        common = {"micro_batch_size": shape.micro_batch_size, "seq_len": shape.seq_len,
                  "precision": shape.precision, "tensor_parallel": t, "sequence_parallel": shape.sequence_sharded}
        by_kind = {kind: estimate_layer_activation_bytes(config, kind, fused_attention=fused_attention,
                                                         amp=shape.amp, **common)
                   for kind in ("embedding", "block", "head", "loss")}
        self._saved = [0]
        for kind in kinds:
            self._saved.append(self._saved[-1] + by_kind[kind])
        self._loss = by_kind["loss"]
        self._input = [stage_input_bytes(config, index, amp=shape.amp, **common) for index in range(len(kinds) + 1)]
        self._params, self._gradients = [0], [0]  # prefix sums of one tensor-parallel rank's counts
        for count, gradients in zip(layer_parameter_counts(config, tensor_parallel=t),
                                    layer_gradient_counts(config, tensor_parallel=t)):
            self._params.append(self._params[-1] + count)
            self._gradients.append(self._gradients[-1] + gradients)
        per_param = static_bytes_per_parameter(shape.precision, shape.amp)
        shards = shape.num_replicas if shape.shard_optimizer else 1
        self._per_param = (per_param.weights, per_param.gradients)
        self._per_param_sharded = (per_param.master, per_param.optimizer, shards)
        self._peaks = _walk_peaks(shape.schedule, shape.num_stages, shape.num_micro_batches,
                                  shape.activation_checkpoint, shape.virtual_stages)
        self.num_layers = len(kinds)
        # a one-layer stage's bytes depend on the layer only through these four (all integers):
        # per distinct triple, the layers that have it, in order (a LLaMA: its blocks share one)
        alike: dict[tuple[int, int, int, int], list[int]] = {}
        for layer in range(self.num_layers):
            alike.setdefault(self._one_layer_terms(layer), []).append(layer)
        self._alike_layers = list(alike.values())

    def parameters(self, start: int, end: int) -> int:
        return self._params[end] - self._params[start]

    def _static(self, chunk_bounds: Sequence[tuple[int, int]]) -> int:
        count = sum(self._params[end] - self._params[start] for start, end in chunk_bounds)
        gradients = sum(self._gradients[end] - self._gradients[start] for start, end in chunk_bounds)
        weights, gradient = self._per_param
        master, optimizer, shards = self._per_param_sharded
        return count * weights + gradients * gradient + -(-count * master // shards) + -(-count * optimizer // shards)

    def __call__(self, stage: int, start: int, end: int) -> int:  # the search's inner loop: _static inlined
        count, gradients = self._params[end] - self._params[start], self._gradients[end] - self._gradients[start]
        weights, gradient = self._per_param
        master, optimizer, shards = self._per_param_sharded
        static = count * weights + gradients * gradient + -(-count * master // shards) + -(-count * optimizer // shards)
        holds_loss = end == self.num_layers
        graph = self._saved[end] - self._saved[start] + (self._loss if holds_loss else self._input[end])
        kept_input = self._input[start]
        return static + max([graphs * graph + inputs * kept_input for graphs, inputs in self._peaks[stage]])

    def worker(self, worker: int, chunk_bounds: Sequence[tuple[int, int]]) -> int:
        """The total memory of ``worker`` holding, with several chunks (v > 1), the layers
        (first, end) of each chunk in ``chunk_bounds``, in chunk order (``self(...)`` with one)."""
        static = self._static(chunk_bounds)
        terms = []  # per chunk: its graph, its kept input
        for start, end in chunk_bounds:
            holds_loss = end == self.num_layers
            terms += [self._saved[end] - self._saved[start] + (self._loss if holds_loss else self._input[end]),
                      self._input[start]]
        return static + max(sum(count * term for count, term in zip(point, terms)) for point in self._peaks[worker])

    def _one_layer_terms(self, layer: int) -> tuple[int, int, int, int]:
        """What ``self(stage, layer, layer + 1)`` reads of the layer: its parameters and gradients,
        its graph (with the output it keeps, or the loss) and its input."""
        end = layer + 1
        graph = self._saved[end] - self._saved[layer] + (self._loss if end == self.num_layers else self._input[end])
        return (self.parameters(layer, end), self._gradients[end] - self._gradients[layer], graph,
                self._input[layer])

    def least_one_layer(self, stage: int, first: int, end: int) -> int:
        """The least bytes ``stage`` needs holding one of the layers ``first .. end - 1``:
        ``min(self(stage, layer, layer + 1) ...)``, asked once per kind of layer alike in
        parameters, graph and input instead of once per layer."""
        firsts = []  # the first layer in range of each kind
        for layers in self._alike_layers:
            at = bisect.bisect_left(layers, first)
            if at < len(layers) and layers[at] < end:
                firsts.append(layers[at])
        return min(self(stage, layer, layer + 1) for layer in firsts)


@functools.lru_cache(maxsize=256)
def _walk_peaks(schedule: str, num_stages: int, num_micro_batches: int, activation_checkpoint: str,
                virtual_stages: int = 1) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per worker, every (kept graphs, kept inputs) the memory model's walk
    (:func:`raypipe.planning.memory._walk`, no offload) may peak at; with several chunks, the
    pair of each chunk in turn (g0, i0, g1, i1, ...): an op keeps and frees its own chunk's."""
    out = []
    always, except_last = activation_checkpoint == "always", activation_checkpoint == "except_last"
    for ops in shared_schedule_ops(schedule, num_stages, num_micro_batches, virtual_stages):
        counts = [0] * (2 * virtual_stages)
        points = {tuple(counts)}
        for op in ops:
            recompute = always or (except_last and op.micro_batch != num_micro_batches - 1)
            graphs, inputs = 2 * op.chunk, 2 * op.chunk + 1
            if op.kind == F:
                counts[inputs if recompute else graphs] += 1
            elif op.kind == I:  # a split backward: a recomputed graph is rebuilt here and held until W
                if recompute:
                    counts[graphs] += 1
                    counts[inputs] -= 1
            elif op.kind == W:  # frees the graph its I held
                counts[graphs] -= 1
            else:
                if recompute:  # its graph rebuilt, the input it holds already counted among the kept ones
                    rebuilt = list(counts)
                    rebuilt[graphs] += 1
                    rebuilt[inputs] -= 1
                    points.add(tuple(rebuilt))
                counts[inputs if recompute else graphs] -= 1
            points.add(tuple(counts))
        out.append(_undominated(points) if virtual_stages == 1 else _undominated_many(points))
    return tuple(out)


def _undominated_many(points: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """:func:`_undominated` in any number of counts: the points no other one is at least in every
    count (pairwise, over the few distinct points of a chunked walk)."""
    ordered = sorted(points, key=sum, reverse=True)  # a dominating point has the larger sum: it comes first
    kept: list[tuple[int, ...]] = []
    for point in ordered:
        if not any(all(map(operator.ge, other, point)) for other in kept):  # no kept one is >= in every count
            kept.append(point)
    return tuple(kept)


def _undominated(points: set[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The points no other one is at least in both counts: only they can be the peak (bytes are
    >= 0). Most graphs first: a point is kept when it has more inputs than every point before it
    (those have more graphs, or as many and more inputs), one pass instead of all pairs."""
    kept, most_inputs = [], None
    for graphs, inputs in sorted(points, reverse=True):
        if most_inputs is None or inputs > most_inputs:
            kept.append((graphs, inputs))
            most_inputs = inputs
    return tuple(kept)


def candidate_shapes(num_gpus: int, num_layers: int, *, seq_len: int, precision: str = "bf16",
                     global_batch: int | None = None, snapshot_every: int = 1,
                     schedules: Sequence[str] = SEARCH_SCHEDULES, tensor_parallels: Sequence[int] = (1,),
                     sequence_parallel: bool | None = None) -> list[StepShape]:
    """Every configuration the search considers for ``num_gpus`` (see the module docstring), for
    each tensor-parallel degree of ``tensor_parallels`` that divides ``num_gpus``."""
    shapes = []
    for t in tensor_parallels:
        if num_gpus % t == 0:
            shapes += _shapes_at(num_gpus // t, num_layers, seq_len, precision, global_batch,
                                 snapshot_every, schedules, t, sequence_parallel)
    return shapes


def _shapes_at(slots: int, num_layers: int, seq_len: int, precision: str, global_batch: int | None,
               snapshot_every: int, schedules: Sequence[str], t: int, sequence_parallel: bool | None
               ) -> list[StepShape]:
    """:func:`candidate_shapes` of one tensor-parallel degree ``t``: replicas x stages = ``slots``."""
    shapes = []
    for stages in range(1, min(slots, num_layers) + 1):
        if slots % stages:
            continue
        replicas = slots // stages
        for size in SEARCH_MICRO_BATCH_SIZES:
            if global_batch is None:
                micro_batches = [stages * k for k in SEARCH_MICRO_BATCHES_PER_STAGE]
            elif global_batch % (replicas * size) == 0:
                micro_batches = [global_batch // (replicas * size)]
            else:
                micro_batches = []
            for m in micro_batches:
                for schedule in schedules:
                    chunks = SEARCH_VIRTUAL_STAGES.get(schedule, 1)
                    if stages * chunks > num_layers or (schedule == "interleaved_1f1b"
                                                        and not interleaved_runs(stages, m)):
                        continue  # a virtual stage holds at least one layer; interleaving m of its rule
                    for recompute in SEARCH_RECOMPUTE:
                        for sharded in ((False, True) if replicas > 1 else (False,)):
                            shapes.append(StepShape(replicas, stages, m, schedule, recompute, precision, sharded,
                                                    size, seq_len, None, snapshot_every, chunks, t,
                                                    sequence_parallel if t > 1 else None))
    return shapes


@collector_paused()
def search_plans(config: LlamaConfig, cluster: Cluster, num_gpus: int, *, seq_len: int | None = None,
                 precision: str = "bf16", gpu_memory_bytes: int | None = None, global_batch: int | None = None,
                 top: int = 3, snapshot_every: int | None = None, fused_attention: bool = True,
                 tensor_parallel: int | None = None, sequence_parallel: bool | None = None) -> SearchResult:
    """The ``top`` configurations of ``config`` on ``num_gpus`` GPUs of ``cluster`` with the
    highest predicted tokens/s that fit ``gpu_memory_bytes`` (default: the cluster's memory).
    ``snapshot_every``: fixed, or None to pick each candidate's (see the module docstring).
    ``tensor_parallel``: fixed (its errors raised), or None to search
    :func:`tensor_parallel_degrees`; ``sequence_parallel`` None: on at t > 1."""
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"--gpus {num_gpus!r} must be an int >= 1")
    seq_len = seq_len or config.max_seq_len
    limit = cluster.memory_bytes if gpu_memory_bytes is None else gpu_memory_bytes
    num_layers = config.n_layers + 2
    costs = llama_layer_costs(config, seq_len, precision, fused_attention)
    if tensor_parallel is None:
        degrees = tensor_parallel_degrees(config, cluster, num_gpus, seq_len, sequence_parallel)
    else:
        check_tensor_parallel_degree(config, cluster, num_gpus, seq_len, tensor_parallel, sequence_parallel)
        degrees = (tensor_parallel,)
    collectives = {t: llama_layer_collectives(config, seq_len, precision, None, sequence_parallel is not False)
                   for t in degrees if t > 1}
    shapes = candidate_shapes(num_gpus, num_layers, seq_len=seq_len, precision=precision,
                              global_batch=global_batch,
                              snapshot_every=1 if snapshot_every is None else snapshot_every,
                              tensor_parallels=degrees, sequence_parallel=sequence_parallel)
    if not shapes:
        return SearchResult([], 0, 0, reason=f"no (replicas, stages, micro-batches) gives a global batch of "
                                             f"{global_batch} sequences on {num_gpus} GPUs")
    time_splits: dict[tuple[int, str], list[int]] = {}
    fitting: list[tuple[float, int, StepShape, str, list[int], LlamaStageBytes]] = []
    smallest = None
    # per t, per pipeline shape (p, m, b, schedule, v), the recompute modes that fit at some ZeRO-1 setting
    fit_at: dict[int, dict[tuple, set[str]]] = {t: {} for t in degrees}
    for index, shape in enumerate(shapes):
        t = shape.tensor_parallel
        alike = (shape.num_stages, shape.num_micro_batches, shape.micro_batch_size, shape.schedule,
                 shape.virtual_stages)
        if t > 1 and any(SEARCH_RECOMPUTE.index(mode) <= SEARCH_RECOMPUTE.index(shape.activation_checkpoint)
                         for mode in fit_at.get(t // 2, {}).get(alike, ())):
            continue  # it fits at t / 2, recomputing no more, which the model predicts no slower (module docstring)
        bytes_of = LlamaStageBytes(config, shape, fused_attention)
        key = (shape.num_virtual_stages, shape.activation_checkpoint)
        if key not in time_splits:  # "never"/"always" weigh the layers alike for every m
            times = [layer_step_flops(cost, shape.activation_checkpoint) for cost in costs]
            time_splits[key] = min_max_partition(times, shape.num_virtual_stages)
        split, mode = time_splits[key], "time"
        if shape.virtual_stages > 1:
            # the split by time, or none: the memory-limited DP bounds one contiguous stage at a time, and a
            # worker's chunks are not contiguous (a worker's memory sums pieces far apart in the model)
            if max(worker_bytes(bytes_of, shape, split)) <= limit:
                fitting.append((0.0, index, shape, mode, split, bytes_of))
                fit_at[t].setdefault(alike, set()).add(shape.activation_checkpoint)
            continue
        bounds = stage_bounds(split)
        worst = max(bytes_of(stage, start, end) for stage, (start, end) in enumerate(bounds))
        if worst > limit:
            # a stage holds at least one layer: where even its cheapest layer does not fit, nothing does
            least = max(bytes_of.least_one_layer(stage, stage, num_layers - (shape.num_stages - 1 - stage))
                        for stage in range(shape.num_stages))
            smallest = least if smallest is None else min(smallest, least)
            if least > limit:
                continue
            try:  # balance_by_time's split within the limit (it raises where the limit is not an int >= 1)
                split = fastest_split_within(costs, shape.num_stages, bytes_of, limit,
                                             activation_checkpoint=shape.activation_checkpoint,
                                             num_micro_batches=shape.num_micro_batches)
            except ValueError:
                continue
            if split is None:
                continue
            mode = "memory"
        fitting.append((0.0, index, shape, mode, split, bytes_of))
        fit_at[t].setdefault(alike, set()).add(shape.activation_checkpoint)
    if not fitting:
        return SearchResult([], len(shapes), 0, smallest_stage_bytes=smallest, reason=_no_fit_reason(
            config, cluster, num_gpus, limit, smallest))
    ranked = []
    for _, index, shape, mode, split, bytes_of in fitting:
        parameters = worker_sums([bytes_of.parameters(start, end) for start, end in stage_bounds(split)], shape)
        bound = optimistic_step_s(costs, split, parameters, shape, cluster, collectives.get(shape.tensor_parallel))
        tokens = shape.num_replicas * shape.num_micro_batches * shape.micro_batch_size * seq_len
        ranked.append((tokens / bound, index, shape, mode, split, parameters, bytes_of))
    ranked.sort(key=lambda item: (-item[0], item[1]))
    best: list[Candidate] = []
    simulated = 0
    for ceiling, _, shape, mode, split, parameters, bytes_of in ranked:
        if len(best) >= top and ceiling <= best[-1].prediction.tokens_per_s:
            break  # nothing later can enter the top
        memory = worker_bytes(bytes_of, shape, split)
        layer_collectives = collectives.get(shape.tensor_parallel)
        runs = pipeline_runs(costs, split, shape, cluster, layer_collectives)
        prediction = predict_split(costs, split, parameters, memory, limit, shape, cluster, runs, layer_collectives)
        if snapshot_every is None and prediction.snapshot_exposed_s > 0:
            # another cadence changes only what follows the pipeline: its simulation is reused
            shape = replace(shape, snapshot_every=snapshot_cadence(prediction))
            prediction = predict_split(costs, split, parameters, memory, limit, shape, cluster, runs,
                                       layer_collectives)
        simulated += 1
        best.append(Candidate(shape, mode, prediction))
        best.sort(key=lambda c: -c.prediction.tokens_per_s)
        del best[top:]
    return SearchResult(best, len(shapes), simulated)


def predict_llama_layout(config: LlamaConfig, cluster: Cluster, shape: StepShape, *, fused_attention: bool = True,
                         gpu_memory_bytes: int | None = None, hide_tensor_parallel_collectives: bool = False
                         ) -> Prediction:
    """The predicted step of ``config`` in one given configuration ``shape`` on ``cluster``, as the search
    predicts that candidate with its split by time (each (virtual) stage's layers balanced by their step
    flops), whether it fits or not (``Prediction.fits`` says, against ``gpu_memory_bytes``, default the
    cluster's memory; the search would drop it or split it within memory). The entry point for a layout
    chosen elsewhere, e.g. a published one (:mod:`raypipe.planning.published_layouts`).
    ``hide_tensor_parallel_collectives``: a what-if, the layers' tensor-parallel collectives costing
    nothing, as if an implementation hid them all under compute (Megatron's ``--tp-comm-overlap``,
    torchtitan's async TP aim at it): a bound, not what raypipe's stages do."""
    num_layers = config.n_layers + 2
    check_shape(shape, num_layers)
    t = shape.tensor_parallel
    if t > 1:
        check_tensor_parallel_degree(config, cluster, shape.num_gpus, shape.seq_len, t, shape.sequence_parallel)
    costs = llama_layer_costs(config, shape.seq_len, shape.precision, fused_attention, amp=shape.amp)
    bytes_of = LlamaStageBytes(config, shape, fused_attention)
    split = min_max_partition([layer_step_flops(cost, shape.activation_checkpoint) for cost in costs],
                              shape.num_virtual_stages)
    parameters = worker_sums([bytes_of.parameters(start, end) for start, end in stage_bounds(split)], shape)
    limit = cluster.memory_bytes if gpu_memory_bytes is None else gpu_memory_bytes
    if t == 1:
        collectives = None
    elif hide_tensor_parallel_collectives:
        collectives = [LayerCollectives()] * num_layers
    else:
        collectives = llama_layer_collectives(config, shape.seq_len, shape.precision, shape.amp,
                                              shape.sequence_sharded)
    return predict_split(costs, split, parameters, worker_bytes(bytes_of, shape, split), limit, shape, cluster,
                         collectives=collectives)


def tensor_parallel_degrees(config: LlamaConfig, cluster: Cluster, num_gpus: int, seq_len: int,
                            sequence_parallel: bool | None = None) -> tuple[int, ...]:
    """The degrees of :data:`SEARCH_TENSOR_PARALLEL` that :func:`check_tensor_parallel_degree` lets run."""
    degrees = []
    for t in SEARCH_TENSOR_PARALLEL:
        try:
            check_tensor_parallel_degree(config, cluster, num_gpus, seq_len, t, sequence_parallel)
        except ValueError:
            continue
        degrees.append(t)
    return tuple(degrees)


def check_tensor_parallel_degree(config: LlamaConfig, cluster: Cluster, num_gpus: int, seq_len: int,
                                 tensor_parallel: int, sequence_parallel: bool | None = None) -> None:
    """Raise ValueError unless ``tensor_parallel`` ranks per stage can run ``config`` on ``num_gpus``
    GPUs of ``cluster``: it divides the heads, KV heads and FFN width (the memory model's rule),
    the GPU count, and with sequence parallelism the sequence; at most a node's GPUs."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel={tensor_parallel!r} must be an int >= 1")
    if tensor_parallel > cluster.gpus_per_node:
        raise ValueError(f"tensor_parallel={tensor_parallel} exceeds the {cluster.gpus_per_node} GPUs per node of "
                         f"cluster {cluster.name!r}: a stage's tensor-parallel ranks share one node")
    layer_parameter_counts(config, tensor_parallel=tensor_parallel)  # raises ConfigError unless it divides them
    if num_gpus % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} does not divide --gpus {num_gpus} "
                         "(replicas x stages x tensor-parallel ranks)")
    if tensor_parallel > 1 and sequence_parallel is not False and seq_len % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel}: sequence parallelism shards the sequence, and "
                         f"seq_len={seq_len} does not divide by it (or --no-sequence-parallel, on one stage: "
                         "between stages each rank sends a 1/t slice of the sequence either way)")


def worker_bytes(bytes_of: LlamaStageBytes, shape: StepShape, split: Sequence[int]) -> list[int]:
    """Each worker's total memory under ``split`` (layers per virtual stage), its chunks placed as
    ``shape``'s schedule places them."""
    if shape.virtual_stages == 1:
        return [bytes_of(stage, start, end) for stage, (start, end) in enumerate(stage_bounds(split))]
    return [bytes_of.worker(worker, [(chunk.start, chunk.stop) for chunk in chunks])
            for worker, chunks in enumerate(worker_chunks(split, shape.num_stages, PLACEMENT[shape.schedule]))]


def snapshot_cadence(every_step: Prediction) -> int:
    """The smallest of :data:`SNAPSHOT_CADENCES` whose snapshot (as ``every_step``, predicted with
    a snapshot every step, says it would cost at that cadence: :meth:`Prediction.snapshot_exposed_at`)
    adds at most :data:`SNAPSHOT_OVERHEAD` to the step without it; the largest where none does."""
    without = every_step.step_s - every_step.snapshot_exposed_s
    return next((k for k in SNAPSHOT_CADENCES if every_step.snapshot_exposed_at(k) <= SNAPSHOT_OVERHEAD * without),
                SNAPSHOT_CADENCES[-1])


def _no_fit_reason(config: LlamaConfig, cluster: Cluster, num_gpus: int, limit: int, smallest: int | None) -> str:
    from raypipe.units import format_bytes

    need = f" (the smallest stage found needs {format_bytes(smallest)})" if smallest is not None else ""
    return (f"no configuration fits: every split of the model over at most {min(num_gpus, config.n_layers + 2)} "
            f"stages of {num_gpus} GPUs, with the tensor parallelism searched (up to {cluster.gpus_per_node} GPUs "
            f"a stage, a node's), leaves a stage above {format_bytes(limit)} per device{need}: use devices with "
            f"more memory (--gpu-memory / a cluster file), more GPUs (more stages), or shorter sequences (--seq-len)")
