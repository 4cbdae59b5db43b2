"""StageWorker: one pipeline stage's layers, optimizer and per-micro-batch compute.

It knows nothing of the driver: it runs the ops it is given (forward,
backward, grad statistics, optimizer step) and reports timings and memory.
An executor (:mod:`raypipe.executor`) makes it a Ray actor and drives it.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import ray
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh  # imported by torch.distributed already (DTensor is not)

from raypipe.comm.membership import forget_mesh_placements
from raypipe.comm.object_store import fetched
from raypipe.core.result import OpEvent, StageReport
from raypipe.core.step_decision import StageGradStats, StepDecision, decide_step
from raypipe.core.topology import Topology
from raypipe.errors import StepAborted
from raypipe.models.layers import LayerSpec, build_layer
from raypipe.stage import boundary
from raypipe.stage.activations import ActivationStore, Kept
from raypipe.stage.chunks import Chunks
from raypipe.stage.checkpointing import StageCheckpointing
from raypipe.stage.concurrency_groups import HEALTH_GROUP
from raypipe.stage.data_reader import StageData
from raypipe.stage.device import stage_device, warm_up_spare_process, where_it_runs
from raypipe.stage.gradients import clip_and_step, local_tensor, owned_grad_stats
from raypipe.stage.layer_run import layer_seeds, run_layers
from raypipe.stage.local_shards import adopt_local_tensors, as_local, held_tensors, split_optimizer_state
from raypipe.stage.measure import SavedBytes, storage_bytes, storage_pointers
from raypipe.stage.offload import Offloader, check_offloadable
from raypipe.stage.precision import autocast, compute_weights
from raypipe.stage.running_step import RunningStep
from raypipe.stage.spec import WorkerSpec
from raypipe.stage.split_backward import boundary_input_gradient
from raypipe.stage.stage_op import stage_op
from raypipe.stage.step_stats import stage_stats
from raypipe.stage.zero import Ownership


class StageWorker(StageCheckpointing):
    """One pipeline stage of one replica: its layers, optimizer and per-micro-batch ops."""

    def __init__(self, spec: WorkerSpec | None = None) -> None:
        """Build stage ``spec``; None: a warm spare (:mod:`raypipe.runtime.spares`), the
        process with torch imported and its device set up, holding nothing until :meth:`become`."""
        if spec is None:
            self.spec = None
            self.ops_done = 0  # answers heartbeat()
            warm_up_spare_process()
            return
        config = spec.config
        torch.set_num_threads(config.cpus_per_stage)
        self.spec, self.config = spec, config
        self.stage_index, self.num_stages = spec.stage, spec.num_stages
        self.replica = spec.replica
        self.layer_indices = list(spec.layer_indices)
        # whether this worker reads inputs (holds the first virtual stage) and targets (the last, its loss)
        self.is_first, self.is_last = spec.is_first, spec.is_last
        self.chunks = Chunks.of(spec)
        self.device = stage_device(spec.use_gpu)  # on GPU: the one Ray assigned, made current
        self._build_model(spec)
        self.loss_fn = spec.loss_fn
        self.data = StageData(spec.loss_count_fn, spec.block, reads_inputs=self.is_first,
                              reads_targets=self.is_last)
        self.store = ActivationStore(Offloader(self.device) if config.offload_activations else None)
        self._running = RunningStep()
        self._events: list[OpEvent] = []
        self.ops_done = 0  # ops finished over this worker's life (its heartbeat)
        self.commits = 0  # steps this state has ended (stepped or skipped): a heal asks who ended the failed one
        self.take_layout(spec)

    def _build_model(self, spec: WorkerSpec) -> None:
        """The layers, the weights they compute with and the optimizer, for the ZeRO-1
        ownership of ``spec``'s layout: each replica's optimizer holds the parameters it
        owns (all of them, unsharded), and only their main weights where those are not
        the compute weights (bf16). Built afresh (seeded weights, no optimizer state)."""
        config = spec.config
        # split over a tensor-parallel mesh later, a pretrained layer reads only this rank's part then
        read_now = config.tensor_parallel == 1
        self.layers = nn.ModuleList(build_layer(layer, index, config.seed, read_weights=read_now)
                                    for layer, index in zip(spec.layers, spec.layer_indices))
        self.layers.to(self.device)
        self._layers_training: bool | None = None  # the mode train() last set on every layer (None: not yet)
        self.tensor_mesh = None  # the stage's tensor-parallel mesh once the layers are split over it
        self._restored_before_split: dict[str, Any] | None = None  # a replacement's snapshot, loaded once split
        if config.tensor_parallel > 1:  # a module given as it is is split in place: keep it unsplit for a re-split
            self._unsplit = {position: copy.deepcopy(layer).to("meta") for position, layer in enumerate(self.layers)
                             if not isinstance(spec.layers[position], LayerSpec)}
        self._take_parameters(spec)

    def _take_parameters(self, spec: WorkerSpec) -> None:
        """The weights the layers compute with, the optimizer and scheduler (afresh), over the
        layers' parameters as they are now (split over the tensor-parallel mesh, or not)."""
        config = spec.config
        self._trainable = [p for p in self.layers.parameters() if p.requires_grad]
        self.ownership = self._ownership_in(spec)
        self._owned = self.ownership.owned(self._trainable)
        owned = set(map(id, self._owned))
        # each chunk's owned parameters, in order: a chunk's statistics are those of a worker holding it alone
        self._chunk_owned = self.chunks.parameters(self.layers, lambda p: id(p) in owned)
        self.weights = compute_weights(config.precision, self.layers, self.device,  # what the layers compute with
                                       (lambda parameter: id(parameter) in owned) if self.ownership.sharded else None)
        # parameters and compute weights: static memory, excluded from held bytes
        self._parameter_storages = storage_pointers(self.layers.parameters()) | self.weights.storages()
        self._saved_bytes = SavedBytes(self._parameter_storages)  # what each forward saves for backward
        self._weights_bytes = storage_bytes([*self.layers.parameters(), *self.weights.copies()])
        self._compute_weights = [self.weights.compute_weight(p) for p in self._trainable]  # what ZeRO-1 shares
        # each chunk's, for its split backward's weight gradient (a chunk's graph reaches only its own)
        self._chunk_weights = [list(map(self.weights.compute_weight, trainable))
                               for trainable in self.chunks.parameters(self.layers, lambda p: p.requires_grad)]
        self.optimizer = spec.optimizer_factory(self._owned) if spec.optimizer_factory and self._owned else None
        self.scheduler = (spec.scheduler_factory(self.optimizer)
                          if spec.scheduler_factory and self.optimizer else None)

    def tensor_parallelize(self, mesh: DeviceMesh) -> None:
        """Split the stage's layers over its tensor-parallel ``mesh`` (each planned layer by its
        ``tp_plan``, the others kept whole), after each joining of the group. Every rank of the
        mesh calls this (it may issue collectives).

        The first time (layers just built: before the first step, or rebuilt for a ZeRO-1 layout
        whose state :meth:`adopt` brings), each rank keeps its shard of the seeded initial weights
        (before the first step a pretrained layer reads only its part of the checkpoint's tensors
        now) and the optimizer is built afresh over the split parameters; a snapshot restored
        before the split (a replacement's state, :meth:`restore`) is loaded then.
        Later (the groups re-formed after a failed step, a heal), the split parameters, their
        optimizer state and the layers' hooks are bound to the old mesh's process group: the
        layers are rebuilt (on the meta device, no initialisation), split over the new mesh, and
        given this rank's own local tensors of every parameter, buffer and optimizer state (the same
        storage: no copy), bitwise as they were; nothing crosses between ranks."""
        held = self._held_for_resplit() if self.tensor_mesh is not None else None
        if held is not None:
            # taking the held state ran DTensor ops on the old mesh: their cached placements would give the
            # new split's parameters that mesh (equal by ranks), its process groups gone
            forget_mesh_placements()
            self.layers, self._layers_training = self._unsplit_on_meta(), None
        from raypipe.models.tensor_parallel import parallelize_layer  # DTensor: seconds of import, only where used

        spec, config = self.spec, self.config
        final = self.chunks.positions[self.chunks.last][-1] if self.chunks.last is not None else None
        for position, (layer, index) in enumerate(zip(spec.layers, spec.layer_indices)):
            parallelize_layer(self.layers[position], layer.tp_plan if isinstance(layer, LayerSpec) else None, mesh,
                              sequence_parallel=config.sequence_parallel, first_layer=index == 0,
                              final_layer=position == final, after_boundary=index - 1 not in spec.layer_indices,
                              before_boundary=index + 1 not in spec.layer_indices)
        self.tensor_mesh = mesh
        if held is not None:  # the rebuilt layers take this rank's own tensors: no copy, no second allocation
            adopt_local_tensors(self.layers, held["tensors"])
        elif self._restored_before_split is None and not self.commits:  # the weights to start from: its part
            # (past the first step the state comes from a snapshot: a ZeRO-1 layout change rebuilt the layers)
            for layer, module in zip(spec.layers, self.layers):
                if isinstance(layer, LayerSpec):
                    layer.load_weights(module)
        self._take_parameters(spec)
        if held is not None:
            self._load_held(held)
        restored, self._restored_before_split = self._restored_before_split, None
        if restored is not None:
            self.restore(restored)

    def _held_for_resplit(self) -> dict[str, Any]:
        """This rank's whole state as local shards (sharing storage), for :meth:`tensor_parallelize`
        to put back after splitting rebuilt layers over a new mesh."""
        return {"tensors": held_tensors(self.layers),
                "optimizer": as_local(self.optimizer.state_dict()) if self.optimizer is not None else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def _unsplit_on_meta(self) -> nn.ModuleList:
        """The stage's layers as built, unsplit, on the meta device (no memory, no initialisation):
        a spec's layer built again, a module given as it is copied from its unsplit template."""
        with torch.device("meta"):  # a pretrained layer built on "meta" reads no checkpoint
            return nn.ModuleList(layer.build("meta") if isinstance(layer, LayerSpec)
                                 else copy.deepcopy(self._unsplit[position])
                                 for position, layer in enumerate(self.spec.layers))

    def _load_held(self, held: dict[str, Any]) -> None:
        """Put :meth:`_held_for_resplit`'s optimizer and scheduler state into those built over the
        rebuilt, split layers (which hold its tensors already), and recast the compute weights."""
        if self.optimizer is not None:
            self.optimizer.load_state_dict(split_optimizer_state(self.optimizer, held["optimizer"]))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(held["scheduler"])
        self.weights.refresh()

    def step_scope(self) -> contextlib.AbstractContextManager:
        """What a step (or an evaluation) runs inside: on a tensor-parallel worker holding the
        loss, vocabulary-parallel loss (its backward must run inside too)."""
        if self.tensor_mesh is not None and self.is_last:
            from raypipe.models.tensor_parallel import loss_parallel_scope

            return loss_parallel_scope()
        return contextlib.nullcontext()

    def _ownership_in(self, spec: WorkerSpec) -> Ownership:
        return Ownership.assign(self._trainable, spec.running_replicas, spec.replica, self.config.shard_optimizer)

    # -- setup --------------------------------------------------------------
    def take_layout(self, spec: WorkerSpec) -> None:
        """Run as ``spec`` says from the next step: which replica of how many, and
        which block of a step's micro-batches (an elastic run resizing). Only the
        layout may differ from the spec this worker was built from.

        With ZeRO-1 another number of replicas moves parameters to other owners:
        the model is built afresh for the new ownership, and its state must then
        come from :meth:`adopt` (snapshots of every replica of the old layout) or
        a checkpoint."""
        ownership = self._ownership_in(spec)
        if list(map(id, ownership.owned(self._trainable))) != list(map(id, self._owned)):
            # the old state is in the snapshots: free it before the new model takes its place in memory
            del self.optimizer, self.scheduler, self.weights, self._compute_weights, self._owned, self._trainable
            del self._chunk_owned, self._chunk_weights
            del self.layers
            self._build_model(spec)
        self.spec, self.replica = spec, spec.replica
        self.topology = Topology(spec.num_stages, spec.running_replicas, self.config.tensor_parallel)
        self.named_replica = spec.replica if spec.running_replicas > 1 else None  # in errors
        self.block = spec.block
        self.ownership = ownership
        self.data.take_block(spec.block)
        self._last_micro_batch = len(spec.block) - 1
        self.store.backward_order = [(op.chunk, op.micro_batch) for op in spec.stage_ops() if op.kind in ("B", "I")]

    def become(self, spec: WorkerSpec) -> dict[str, Any]:
        """A warm spare takes a failed worker's place: builds ``spec`` as a replacement
        started from it would (its state then comes as a replacement's does); returns :meth:`ready`."""
        if self.spec is not None:
            raise RuntimeError(f"stage {self.stage_index} is no spare: it cannot become another worker")
        self.__init__(spec)  # the actor class's own __init__ (a subclass's too), now with a spec
        return self.ready()

    def ready(self) -> dict[str, Any]:
        """Once the layers are built: parameter count, device, and where this worker runs."""
        return {"num_parameters": sum(p.numel() for p in self.layers.parameters()), **where_it_runs(self.device)}

    @ray.method(concurrency_group=HEALTH_GROUP)
    def heartbeat(self) -> int:
        """Answered on its own thread, even while a step runs: the ops finished so
        far. A stopped or wedged process never answers (that is how a hang shows)."""
        return self.ops_done

    def probe_data(self, uris: list[str]) -> dict[str, Any]:
        """Where this worker runs, and what it finds at each dataset path (checked before step 0)."""
        from raypipe.data.access import probe_here

        return probe_here(uris)

    def attach_datasets(self, train: Any, validation: Any = None) -> None:
        """First and last stages read their own micro-batches in ``fit``."""
        self.data.attach(train, validation)

    # -- the ops of a step --------------------------------------------------
    @stage_op("F", in_step=True)
    def forward(self, micro_batch: int, inputs: boundary.Boundary, targets: torch.Tensor | None = None,
                loss_weight: float | None = None, step: int = 0, chunk: int = 0,
                read_loss: bool = True) -> boundary.Boundary | float | None:
        """Run this stage (its model chunk ``chunk``) on one micro-batch; keep what backward needs.

        ``inputs``: a tensor or a tree of them (:mod:`raypipe.stage.boundary`); None on the
        first stage when it reads its own data. Returns the activation (tensor or tree) for
        the next stage, or on the last stage the loss weighted so that summing over
        micro-batches gives the global mean; ``read_loss=False``: None instead, so that the
        loss is read only with the step's sum (:meth:`RunningStep.add_loss`).
        """
        self._begin_step(step)
        last = chunk == self.chunks.last
        inputs = boundary.to_device(self.data.inputs(step, micro_batch, "train", inputs), self.device)
        if last:  # moved as the inputs are, once: a recompute reuses them
            targets, loss_weight = self.data.targets_and_weight(step, micro_batch, "train", targets, loss_weight)
            targets = boundary.to_device(targets, self.device)
        key = (chunk, micro_batch)
        recompute = self._recomputes(micro_batch)
        if recompute:
            if self.config.offload_activations:
                check_offloadable(inputs, self.stage_index)
            with torch.no_grad():
                outputs = self._run(inputs, micro_batch, targets, loss_weight, chunk=chunk)
            self.store.keep_input(key, inputs, boundary.nbytes(inputs), extra=(targets, loss_weight))
        else:
            leaf = self._as_leaf(inputs, chunk)
            with self._saved_bytes.meter(("graph", *key), self._forward_tensors(leaf, targets)) as meter:
                outputs = self._run(leaf, micro_batch, targets, loss_weight, chunk=chunk)
                meter.add(*boundary.tensors(outputs))  # the graph's roots stay alive until backward
            self.store.keep_graph(key, leaf, outputs, meter.bytes)
        if last:
            self._running.add_loss(outputs)
            return float(outputs.detach()) if read_loss else None
        boundary.check_sendable(outputs, self.stage_index, self.device)
        return boundary.detached(outputs)

    @stage_op("B", in_step=True)
    def backward(self, micro_batch: int, grad_outputs: boundary.Boundary = None,
                 loss_scale: float = 1.0, chunk: int = 0) -> boundary.Boundary:
        """Backpropagate one micro-batch through chunk ``chunk``, accumulating into ``.grad``; return
        the input gradient (for a tree input: a tree of its structure, ``None`` where a leaf has no gradient)."""
        kept, inputs, outputs = self._materialized(micro_batch, chunk)
        roots, gradients = boundary.backward_roots(outputs, self._output_gradient(outputs, grad_outputs,
                                                                                  loss_scale, chunk))
        torch.autograd.backward(roots, gradients)
        self.store.release(kept)
        self._running.backwards_done.add((chunk, micro_batch))
        if self.chunks.is_first(chunk) or inputs is None:
            return None
        return boundary.input_gradient(inputs)

    @stage_op("I", in_step=True)
    def backward_input(self, micro_batch: int, grad_outputs: boundary.Boundary = None,
                       loss_scale: float = 1.0, chunk: int = 0) -> boundary.Boundary:
        """A split backward's input gradient (I) of one micro-batch (None on the first stage; a tree
        input's as in B), keeping what its :meth:`backward_weight` needs; loss scale and received
        gradient as in B (see :func:`~raypipe.stage.split_backward.boundary_input_gradient`)."""
        kept, inputs, outputs = self._materialized(micro_batch, chunk)
        roots, seeds = boundary.backward_roots(outputs, self._output_gradient(outputs, grad_outputs, loss_scale,
                                                                              chunk))
        gradient, pending = boundary_input_gradient(inputs, outputs, roots, seeds, self._chunk_weights[chunk],
                                                    not self.chunks.is_first(chunk), self.stage_index,
                                                    self.config.schedule)
        self.store.retain_rebuilt(kept)  # a recomputed graph is retained for W: counted until W releases it
        self._running.pending_weight_gradients[(chunk, micro_batch)] = (kept, pending)  # kept bytes stay counted until W
        return gradient

    @stage_op("W", in_step=True)
    def backward_weight(self, micro_batch: int, chunk: int = 0) -> None:
        """A split backward's weight gradient (W): accumulate one micro-batch's into ``.grad``, after its I."""
        kept, pending = self._running.pending_weight_gradients.pop((chunk, micro_batch))
        pending.run()
        self.store.release(kept)
        self._running.backwards_done.add((chunk, micro_batch))

    def _materialized(self, micro_batch: int, chunk: int) -> tuple[Kept, boundary.Boundary, boundary.Boundary]:
        """A micro-batch's kept state, its stage input and its graph's output, the forward
        replayed with the same seeds where only the input was kept (once per backward)."""
        kept = self.store.take((chunk, micro_batch))
        inputs, outputs = kept.inputs, kept.outputs
        if outputs is None:  # re-materialize: replay the forward with the same seeds
            inputs = self._as_leaf(inputs, chunk)
            targets, loss_weight = kept.extra
            # the kept input is still counted in the store until release()
            with self._saved_bytes.meter(("rebuilt", chunk, micro_batch), self._forward_tensors(inputs, targets),
                                         counted=tuple(boundary.tensors(inputs))) as meter:
                outputs = self._run(inputs, micro_batch, targets, loss_weight, chunk=chunk)
                meter.add(*boundary.tensors(outputs))
            kept.rebuilt_bytes = meter.bytes + kept.offloaded_bytes  # + the fetched-back input
            self.store.note_transient(kept.rebuilt_bytes)
        return kept, inputs, outputs

    def _output_gradient(self, outputs: boundary.Boundary, grad_outputs: boundary.Boundary,
                         loss_scale: float, chunk: int) -> boundary.Boundary:
        """What the backward starts from: the loss scale on the last stage, else the received
        gradient (moved to each output's device and dtype by :func:`boundary.backward_roots`)."""
        if chunk == self.chunks.last:  # filled on the device: torch.tensor would copy from the host, a sync
            return torch.full((), loss_scale, dtype=outputs.dtype, device=outputs.device)
        return grad_outputs

    def finish_backward(self, inv_scale: float = 1.0, clip_value: float | None = None) -> StageGradStats:
        """:meth:`grad_stats` of a step whose ops the driver submitted one by one.

        Raises when this stage's step is not whole: the error of its failed op,
        or :class:`StepAborted` when an op never ran because an op it depends on
        failed on another stage. Every stage's :meth:`commit` takes every
        stage's ``finish_backward`` as an argument, so a failure anywhere
        reaches no optimizer.
        """
        self._check_step_is_whole()
        return self.grad_stats(inv_scale, clip_value)

    def gradients_to_reduce(self) -> tuple[list[torch.Tensor], tuple[int, ...] | None]:
        """The accumulated gradients, in parameter order, and their owners (None:
        every replica): what the replicas of this stage sum. The same model on
        same-shaped data gives every replica the same set (a parameter used in one
        replica's step and not another's is not supported). With tensor parallelism each gradient is
        first put into its parameter's layout (a collective over the stage's ranks); the shards are reduced."""
        if self.tensor_mesh is not None:
            from raypipe.models.tensor_parallel import redistribute_gradients

            redistribute_gradients(self.layers)
        gradients = [self.weights.gradient(p) for p in self._trainable]
        gradients = [None if gradient is None else local_tensor(gradient) for gradient in gradients]
        present = [index for index, gradient in enumerate(gradients) if gradient is not None]
        owners = self.ownership.owners
        return ([gradients[i] for i in present],
                None if owners is None else tuple(owners[i] for i in present))

    @stage_op("grad_stats", per_micro_batch=False)
    def grad_stats(self, inv_scale: float = 1.0, clip_value: float | None = None) -> StageGradStats:
        """Unscale gradients, clamp them elementwise if asked, and report this stage's
        squared L2 norm (fp32), whether any gradient is inf/NaN, and (last stage)
        its weighted loss sum."""
        return owned_grad_stats(self._owned, self._running.loss if self.is_last else None, inv_scale, clip_value,
                                self.spec.tp_rank)

    @stage_op("grad_stats", per_micro_batch=False)
    def chunk_grad_stats(self, inv_scale: float = 1.0, clip_value: float | None = None) -> list[StageGradStats]:
        """:meth:`grad_stats` of each model chunk, in chunk order (the loss with the last virtual
        stage's): the step decides over virtual stages, as over the stages of a plain pipeline."""
        return [owned_grad_stats(owned, self._running.loss if chunk == self.chunks.last else None, inv_scale,
                                 clip_value, self.spec.tp_rank) for chunk, owned in enumerate(self._chunk_owned)]

    def _check_step_is_whole(self) -> None:
        if self._running.failure is not None:
            raise self._running.failure
        missing = self.chunks.missing_backwards(self._running.backwards_done, len(self.block))
        if missing:
            raise StepAborted(self.stage_index, "B", missing[0][1],
                              f"the backward of micro-batch(es) {self.chunks.describe(missing)} did not run: an op "
                              "it depends on failed on another stage", replica=self.named_replica)

    def commit(self, loss_scaled: bool, *stats: StageGradStats,
               share_parameters: Callable[[list[torch.Tensor], tuple[int, ...] | None], None] | None = None
               ) -> StageReport:
        """End the step as every stage does: from every stage's statistics (the same
        numbers, in stage order, on every stage) decide, then clip by the global
        norm and step, or skip; report the timeline, memory and the decision.
        ``share_parameters(weights, owners)``: ZeRO-1's gather, after a step, of the
        compute weights each replica stepped (the step runner's replicas give it)."""
        decision = decide_step(stats, loss_scaled)
        self._optimizer_step(decision, share_parameters)
        self.commits += 1
        events, self._events = self._events, []
        stats = stage_stats(events, self.stage_index, self.replica, self.store, self.device, self.optimizer,
                            self._weights_bytes, self.spec.tp_rank)
        return StageReport(events, stats, decision, self.commits)

    def committed_steps(self) -> int:
        """The steps this worker's state has ended (restored with a snapshot)."""
        return self.commits

    @stage_op("optimizer", per_micro_batch=False)
    def _optimizer_step(self, decision: StepDecision, share_parameters: Callable | None = None) -> None:
        if not decision.skipped:
            if self.optimizer is not None:
                clip_and_step(self.optimizer, self.scheduler, self._owned, self.config.clip_grad_norm,
                              decision.grad_norm)
            self.weights.refresh()
            if share_parameters is not None:  # a split parameter's replicas share its local shard
                share_parameters(list(map(local_tensor, self._compute_weights)), self.ownership.owners)
        self._end_step()

    def add_event(self, event: OpEvent) -> None:
        """Add ``event`` to this step's timeline: a wait timed outside this worker's ops
        (a receive, the replicas' reduction, a gate), reported with the step's ops."""
        self._events.append(event)

    def abort_step(self) -> None:
        """Drop a failed step's partial state: kept activations, gradients, timings."""
        self._end_step()
        self._events.clear()

    def _end_step(self) -> None:
        for parameter in self.layers.parameters():
            parameter.grad = None
        self.weights.drop_gradients()
        self.store.clear()
        self._running.end()

    @stage_op("eval", timed=False)
    def evaluate(self, micro_batch: int, inputs: boundary.Boundary, targets: torch.Tensor | None = None,
                 loss_weight: float | None = None, step: int = 0, chunk: int = 0) -> boundary.Boundary | float:
        """Forward only through chunk ``chunk``, keeping nothing: activation or weighted loss.
        ``inputs`` may be the previous stage's output by reference
        (:class:`~raypipe.comm.object_store.ByReference`), fetched here."""
        last = chunk == self.chunks.last
        inputs = boundary.to_device(self.data.inputs(step, micro_batch, "validation", fetched(inputs)), self.device)
        if last:
            targets, loss_weight = self.data.targets_and_weight(step, micro_batch, "validation", targets, loss_weight)
            targets = boundary.to_device(targets, self.device)
        with torch.no_grad(), self.step_scope():
            outputs = self._run(inputs, micro_batch, targets, loss_weight, training=False, chunk=chunk)
        return float(outputs) if last else outputs

    # -- helpers -------------------------------------------------------------
    def _begin_step(self, step: int) -> None:
        if self._running.begin(step):
            self.store.reset_peaks()
            self._saved_bytes.new_step()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)

    def _recomputes(self, micro_batch: int) -> bool:
        mode = self.config.activation_checkpoint
        return mode == "always" or (mode == "except_last" and micro_batch != self._last_micro_batch)

    @staticmethod
    def _forward_tensors(inputs: boundary.Boundary, targets: boundary.Boundary) -> list[torch.Tensor]:
        """What a forward's saved tensors follow from: its inputs' and targets' tensors."""
        return boundary.tensors(inputs) + ([] if targets is None else boundary.tensors(targets))

    def _as_leaf(self, inputs: boundary.Boundary, chunk: int) -> boundary.Boundary:
        """The received input whose floating-point tensors are autograd leaves (the first stage's data is not)."""
        return inputs if self.chunks.is_first(chunk) else boundary.as_autograd_leaves(inputs)

    def _run(self, hidden: boundary.Boundary, micro_batch: int, targets: torch.Tensor | None,
             loss_weight: float | None, training: bool = True, chunk: int = 0) -> torch.Tensor:
        """Chunk ``chunk``'s layers (and the loss, on the last virtual stage), seeded per layer. The
        loss takes a single-tensor output in fp32, a tree output as it is."""
        if self._layers_training is not training or self.layers.training is not training:
            self.layers.train(training)  # a walk over every module: only when the mode changes, not every op
            self._layers_training = training
        with autocast(self.config.precision, self.device.type):
            hidden = self._run_layers(hidden, micro_batch, training, chunk)
        if chunk != self.chunks.last:
            return hidden
        output = hidden.float() if isinstance(hidden, torch.Tensor) else hidden
        loss = self.loss_fn(output, targets)
        if self.tensor_mesh is not None:  # a vocabulary-parallel loss may be a DTensor: whole, on every rank
            from raypipe.models.tensor_parallel import local_loss

            loss = local_loss(loss)
        return loss * loss_weight

    def _run_layers(self, hidden: boundary.Boundary, micro_batch: int, training: bool,
                    chunk: int) -> boundary.Boundary:
        positions = self.chunks.positions[chunk]
        # the step's global micro-batch index: the same masks whatever the number of replicas
        seeds = layer_seeds(self.config.seed, self._running.number, self.block.start + micro_batch,
                            [self.layer_indices[position] for position in positions])
        segments = self.config.activation_checkpoint_segments if training and torch.is_grad_enabled() else None
        return run_layers(self.layers, self.weights, hidden, seeds, self.device, segments, positions)
