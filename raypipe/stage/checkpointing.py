"""A stage's saved state: its layers' weights and its optimizer state, keyed by
global layer index and parameter name, so a checkpoint loads into any
partition and any number of replicas.

With ZeRO-1 each replica holds the optimizer state of the parameters it owns
(and in bf16 their fp32 main weights, which no other replica keeps): the first
replica's part goes into the layer files, every other replica's into one
checkpoint blob per layer (:func:`optimizer_part_name`), and loading merges the
parts. Saves are written in the background (:mod:`raypipe.stage.checkpoint_writer`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import torch

from raypipe.checkpoint.parts import add_sole_mains, merged_model, optimizer_part_name, read_layer_parts
from raypipe.checkpoint.store import encode, encode_layer, layer_file_name, read_manifest
from raypipe.comm.task_tensors import as_shipped_state
from raypipe.errors import CheckpointMismatchError
from raypipe.stage.checkpoint_writer import CheckpointWriter, WrittenFiles, on_host, write_named
from raypipe.stage.concurrency_groups import CHECKPOINT_GROUP
from raypipe.stage.gradients import whole_tensor
from raypipe.stage.host_copy import HostBuffers, HostCopy, copy_path, load_optimizer_in_place, stage_to_host
from raypipe.stage.local_shards import as_local, copy_local_state, local_split_like, split_optimizer_state
from raypipe.stage.optimizer_state import gather_optimizer_state, scatter_optimizer_state


class StageCheckpointing:
    """The state methods of :class:`~raypipe.stage.worker.StageWorker` (which has
    the ``layers``, ``layer_indices``, ``weights``, ``optimizer``, ``scheduler``,
    ``replica`` and ``tensor_mesh`` they read)."""

    def state_dict(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per global layer index, that layer's state on CPU: all of it, except (ZeRO-1
        in bf16) the main weights other replicas own (see :meth:`sole_main_weights`)."""
        return {index: {k: v.detach().cpu() for k, v in self._held_state(position).items()}
                for position, index in enumerate(self.layer_indices)}

    def sole_main_weights(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per global layer index, on CPU, the main weights no other replica keeps
        (ZeRO-1 in bf16: those of the parameters this replica owns; else none).
        Merged into the first replica's :meth:`state_dict`, they make the whole model."""
        return {index: {k: v.detach().cpu() for k, v in self._sole_mains(position).items()}
                for position, index in enumerate(self.layer_indices)}

    def _held_state(self, position: int) -> dict[str, torch.Tensor]:
        without = self.weights.without_main(position)
        layer = self.layers[position]
        # split over the tensor-parallel ranks: gathered whole (a collective every rank of the stage joins)
        if self.tensor_mesh is not None:
            from raypipe.models.tensor_parallel import full_state_dict  # DTensor: imported only where used

            state = full_state_dict(layer)
        else:
            state = layer.state_dict()
        return {k: v for k, v in state.items() if k not in without}

    def _sole_mains(self, position: int) -> dict[str, torch.Tensor]:
        only_here = self.weights.mains_only_here(position)
        return {k: whole_tensor(v) for k, v in self.layers[position].named_parameters() if k in only_here}

    def load_state_dict(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """Load whole layers (per global layer index); split over the tensor-parallel mesh, each
        rank copies in its own part."""
        if self.tensor_mesh is not None:
            from raypipe.models.tensor_parallel import load_split_state  # DTensor: imported only where used

            for index, layer in zip(self.layer_indices, self.layers):
                load_split_state(layer, states[index])
        else:
            for index, layer in zip(self.layer_indices, self.layers):
                layer.load_state_dict(states[index])
        self.weights.refresh()

    def optimizer_state(self) -> dict[int, dict[str, Any]]:
        """Optimizer state per global layer index and parameter name (partition-independent);
        split over the tensor-parallel mesh, gathered whole (every rank of the stage calls this)."""
        return gather_optimizer_state(self.optimizer, self.layers, self.layer_indices)

    def load_optimizer_state(self, states: dict[int, dict[str, Any]]) -> None:
        """Load optimizer state of whole parameters (each rank keeps its own part of a split one's)."""
        split = None
        if self.tensor_mesh is not None:
            from raypipe.models.tensor_parallel import split_like

            split = split_like
        scatter_optimizer_state(self.optimizer, self.layers, self.layer_indices, states, split)

    def snapshot(self, copied: Callable[[], None] | None = None) -> dict[str, Any]:
        """Everything a step changes on this worker, as it is now: weights (and
        buffers), optimizer and LR-scheduler state. :meth:`restore` on a worker
        built from the same spec makes it bitwise this one (the in-memory snapshot
        that heals a failed step). It is a task result: its tensors are a copy in
        host memory (:meth:`host_snapshot`, waited for here), sharing no storage
        with the live state and readable by a process without the stage's device,
        copied once more when Ray serializes the result, and unpickled as tensors.

        ``copied()`` is called as soon as the state may change again (before the copy
        is shipped, and on a GPU before it reaches the host: the device's current
        stream, the one the steps compute on, waits for the copy first): e.g. to let
        the next step's commit go (:mod:`raypipe.stage.step_gate`)."""
        staged = self.host_snapshot()
        if copied is not None:
            if copy_path(self.device) == "cuda":
                staged.order_before(torch.cuda.current_stream(self.device))
            copied()
        return as_shipped_state(staged.wait())

    def host_snapshot(self) -> HostCopy:
        """Start copying what :meth:`snapshot` holds to host memory and return the copy
        under way (:func:`~raypipe.stage.host_copy.stage_to_host`): on a GPU into pinned
        buffers on a side stream, overlapping what the compute stream runs next, which
        must not change the state before the copy is done (:meth:`HostCopy.order_before`
        on the device, or after :meth:`HostCopy.wait` on the host); on the CPU copied
        here. The buffers are used again by the next snapshot once this one is dropped."""
        if getattr(self, "_snapshot_buffers", None) is None:
            self._snapshot_buffers = HostBuffers(pinned=copy_path(self.device) == "cuda")
            self._snapshot_stream = torch.cuda.Stream(self.device) if copy_path(self.device) == "cuda" else None
        self._snapshot_copy = stage_to_host(self._snapshot_state(), self.device, self._snapshot_buffers,
                                            self._snapshot_stream)
        return self._snapshot_copy

    def _snapshot_state(self) -> dict[str, Any]:
        """What :meth:`snapshot` holds, as the live tensors (split over a tensor-parallel mesh:
        this rank's local shards, which only the same stage and tp_rank can restore)."""
        if self._restored_before_split is not None:  # a replacement not split yet holds only this
            return self._restored_before_split
        return as_local({
            "layers": self.layers.state_dict(), "commits": self.commits,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            # what makes it readable by any partition and number of ZeRO-1 replicas (see adopt)
            "layer_indices": list(self.layer_indices), "parameter_names": self._optimizer_parameter_names(),
            "compute_only": [sorted(self.weights.without_main(position)) for position in range(len(self.layers))]})

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Drop any partial step and return to ``snapshot`` (see :meth:`snapshot`): its
        host tensors are copied into the parameters, buffers and optimizer state there
        are (no second copy of the state on the device), bitwise.

        With tensor parallelism the snapshot holds one rank's local shards (of the same stage and
        tp_rank): each is copied into its own part, no collective. A worker whose layers are not
        split yet (a replacement, before it joins the group) keeps the snapshot and loads it once
        they are (:meth:`~raypipe.stage.worker.StageWorker.tensor_parallelize`)."""
        self.abort_step()
        if self.config.tensor_parallel > 1 and self.tensor_mesh is None:
            self._restored_before_split, self.commits = snapshot, snapshot["commits"]
            return
        copy_local_state(self.layers, snapshot["layers"])  # into the parameters and buffers (their local parts)
        if self.optimizer is not None:
            load_optimizer_in_place(self.optimizer, split_optimizer_state(self.optimizer, snapshot["optimizer"]))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(snapshot["scheduler"])
        self.commits = snapshot["commits"]
        self.weights.refresh()

    def adopt(self, *snapshots: dict[str, Any]) -> None:
        """Take this stage's layers from snapshots of another layout: the stages of
        another partition (a run re-partitioned onto fewer stages) and, with ZeRO-1,
        every replica of them (an elastic run resizing: parameters change owners).
        Weights (each parameter's main weight from whichever snapshot keeps it),
        optimizer state per layer and parameter name, hyper-parameters, schedule
        and commits. Split over a tensor-parallel mesh, the snapshots are of workers of the
        same tp_rank (their local parts)."""
        self.abort_step()
        weights: dict[int, dict[str, torch.Tensor]] = {}
        optimizer: dict[int, dict[str, Any]] = {}
        for snapshot in snapshots:
            for merged, part in zip((weights, optimizer), snapshot_by_layer(snapshot)):
                for index, named in part.items():
                    merged.setdefault(index, {}).update(named)
        if self.tensor_mesh is not None:  # snapshots of the same tp_rank: local parts, each into its own
            copy_local_state(self.layers, {f"{position}.{name}": tensor
                                           for position, index in enumerate(self.layer_indices)
                                           for name, tensor in weights.get(index, {}).items()})
            self.weights.refresh()
        else:
            self.load_state_dict(weights)
        if self.optimizer is not None:
            self.optimizer.state.clear()  # as the snapshot had it: a parameter without state gets none
            if self.tensor_mesh is not None:
                scatter_optimizer_state(self.optimizer, self.layers, self.layer_indices, optimizer, local_split_like)
            else:
                self.load_optimizer_state(optimizer)
        # every stage's schedule steps alike; a ZeRO-1 replica that owns nothing has none
        schedules = [snapshot["scheduler"] for snapshot in snapshots if snapshot["scheduler"] is not None]
        if self.scheduler is not None and schedules:
            self.scheduler.load_state_dict(schedules[0])
        self.commits = snapshots[0]["commits"]

    def _optimizer_parameter_names(self) -> list[tuple[int, str]] | None:
        """(global layer index, parameter name) of each optimizer parameter, in its state dict's order."""
        if self.optimizer is None:
            return None
        names = {id(p): (index, name) for index, layer in zip(self.layer_indices, self.layers)
                 for name, p in layer.named_parameters()}
        return [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def start_checkpoint(self, root_uri: str, step: int) -> int:
        """Copy what this worker saves to host memory now, as the bytes of its files,
        and write them on the writer thread; returns the bytes of the copy. The first
        replica saves its layers (weights and its optimizer state), one file per
        global layer; with ZeRO-1 every other replica saves the optimizer state of
        the parameters it owns, one blob per layer. The copy is the state after the
        last committed step: it runs in step order, before the next step changes the
        weights in place. :meth:`checkpoint_files` waits for the files."""
        # split over a tensor-parallel mesh, every rank of the stage gathers its parts whole (collectives,
        # in the same order on each) and tp_rank 0 writes them
        parts = self._saved_parts(on_host=False)
        if self.replica == 0:
            models = [self._held_state(position) for position in range(len(self.layer_indices))]
            encoded = {index: encode_layer(index, on_host({**parts[index], "model": models[position]}))
                       for position, index in enumerate(self.layer_indices)}
        else:
            encoded = {index: encode(on_host(part)) for index, part in parts.items()}
        if self.spec.tp_rank:
            encoded = {}
        if getattr(self, "_checkpoint_writer", None) is None:
            self._checkpoint_writer = CheckpointWriter()
        replica, host_bytes = self.replica, sum(len(payload) for payload in encoded.values())
        self._checkpoint_writer.start(step, host_bytes, lambda files: (
            _write_layers(files, root_uri, step, encoded) if replica == 0
            else _write_optimizer_parts(files, root_uri, step, encoded, replica)))
        return host_bytes

    @ray.method(concurrency_group=CHECKPOINT_GROUP)
    def checkpoint_files(self, step: int, started: int) -> WrittenFiles:
        """Wait for this worker's files of checkpoint ``step`` (on a thread of its own,
        while steps run); ``started`` is :meth:`start_checkpoint`'s result, passed as a
        reference so that Ray runs this after it. A failed write raises
        :class:`~raypipe.errors.CheckpointError` naming the file."""
        return self._checkpoint_writer.finish(step)

    def load_checkpoint(self, root_uri: str, step: int, optimizer_parts: int = 1) -> None:
        """Load this stage's layers from a checkpoint written by any partition and
        any number of optimizer parts (ZeRO-1 replicas): :meth:`read_checkpoint`, then
        :meth:`load_read_checkpoint`. A checkpoint that does not fit this stage's layers
        raises before this stage's state changes."""
        self.read_checkpoint(root_uri, step, optimizer_parts)
        self.load_read_checkpoint()

    def read_checkpoint(self, root_uri: str, step: int, optimizer_parts: int = 1) -> None:
        """Read this stage's layers of checkpoint ``step`` and check that they fit, changing
        nothing: held until :meth:`load_read_checkpoint` loads them (or
        :meth:`drop_read_checkpoint` drops them). A checkpoint that does not fit this stage's
        layers (a missing, unexpected or differently shaped tensor) raises
        :class:`~raypipe.errors.CheckpointMismatchError` naming the stage, layer and tensor; a
        damaged file raises :class:`~raypipe.errors.CheckpointError` naming it. The trainer has
        every worker read before any loads, so a checkpoint that one stage refuses changes no stage."""
        self._read_state = None
        where, checkpoint = stage_and_layers(self.stage_index, self.layer_indices), f"{root_uri} step {step}"
        held = read_manifest(root_uri, step)["num_layers"]
        absent = [index for index in self.layer_indices if index >= held]
        if absent:
            raise CheckpointMismatchError(checkpoint, where, f"layer {absent[0]} is in the model, not in the "
                                                             f"checkpoint (it holds layers 0–{held - 1})")
        parts = {index: read_layer_parts(root_uri, step, index, optimizer_parts) for index in self.layer_indices}
        weights = {index: merged_model(parts[index]) for index in self.layer_indices}
        for index, layer in zip(self.layer_indices, self.layers):
            problem = layer_misfit(index, layer.state_dict(), weights[index])
            if problem is not None:
                raise CheckpointMismatchError(checkpoint, where, problem)
        optimizer = {index: {name: state for part in parts[index] for name, state in part["optimizer"].items()}
                     for index in self.layer_indices}
        # hyper-parameters and schedule: the same in every part whose replica has an optimizer
        candidates = parts[self.layer_indices[0]]
        groups = next((part["param_groups"] for part in candidates if part.get("param_groups")), [])
        scheduler = next((part["scheduler"] for part in candidates if part.get("scheduler") is not None), None)
        optimizer[-1] = {"param_groups": groups}
        self._read_state = (weights, optimizer, scheduler)

    def load_read_checkpoint(self) -> None:
        """Load what :meth:`read_checkpoint` read: the weights, the optimizer and the
        LR-scheduler state."""
        read, self._read_state = getattr(self, "_read_state", None), None
        if read is None:
            raise RuntimeError("load_read_checkpoint: no checkpoint was read (read_checkpoint first)")
        weights, optimizer, scheduler = read
        self.load_state_dict(weights)
        self.load_optimizer_state(optimizer)
        if self.scheduler is not None and scheduler is not None:
            self.scheduler.load_state_dict(scheduler)

    def drop_read_checkpoint(self) -> None:
        """Drop what :meth:`read_checkpoint` read (another stage refused the checkpoint)."""
        self._read_state = None

    def export_hf(self, out_uri: str, dtype: str | None, n_blocks: int,
                  *other_mains: dict[int, dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """Write this stage's layers of a LLaMA as Hugging Face safetensors shards, one per
        layer (``dtype`` None: as trained, the fp32 main weights); ``other_mains``: the other
        replicas' :meth:`sole_main_weights` (ZeRO-1 in bf16). Split over a tensor-parallel mesh,
        every rank of the stage gathers the layers whole (collectives) and tp_rank 0 writes them
        (the others return no shard)."""
        from raypipe.models.hf.export import write_layer_shard

        states = add_sole_mains(self.state_dict(), *other_mains)
        if self.spec.tp_rank:
            return []
        return [write_layer_shard(out_uri, index, n_blocks, state, dtype) for index, state in states.items()]

    def _saved_parts(self, on_host: bool = True) -> dict[int, dict[str, Any]]:
        """Per layer: this replica's optimizer state, hyper-parameters, schedule and the
        main weights only it keeps (``on_host=False``: the live tensors and values)."""
        optimizer = gather_optimizer_state(self.optimizer, self.layers, self.layer_indices, on_host)
        groups = optimizer.pop(-1, {})
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        return {index: {"optimizer": optimizer.get(index, {}), "scheduler": scheduler, **groups,
                        "model": self._sole_mains(position)}
                for position, index in enumerate(self.layer_indices)}


def stage_and_layers(stage: int, layer_indices: list[int]) -> str:
    """``stage 1 (layers 3–5)``: a stage as its errors name it."""
    first, last = min(layer_indices), max(layer_indices)
    return f"stage {stage} (layer {first})" if first == last else f"stage {stage} (layers {first}–{last})"


def layer_misfit(index: int, model: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> str | None:
    """Why global layer ``index``'s ``saved`` state does not load into its ``model`` state
    (a tensor missing, unexpected or of another shape), or None when it fits."""
    missing = [name for name in model if name not in saved]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"layer {index} {missing[0]!r} is in the model, not in the checkpoint{more}"
    unexpected = [name for name in saved if name not in model]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        return f"layer {index} {unexpected[0]!r} is in the checkpoint, not in the model{more}"
    for name, tensor in model.items():
        if saved[name].shape != tensor.shape:
            return (f"layer {index} {name!r} is {tuple(saved[name].shape)} in the checkpoint, "
                    f"{tuple(tensor.shape)} in the model")
    return None


def snapshot_by_layer(snapshot: dict[str, Any]) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict[str, Any]]]:
    """A stage's snapshot as weights per global layer index, and optimizer state per
    layer and parameter name (with the hyper-parameters under -1), as checkpoints hold them.
    The weights leave out what the snapshot's worker held only as a compute weight (ZeRO-1
    in bf16: the main weight is its owner's)."""
    indices = snapshot["layer_indices"]
    weights: dict[int, dict[str, torch.Tensor]] = {index: {} for index in indices}
    for key, tensor in snapshot["layers"].items():
        position, name = key.split(".", 1)
        if name not in snapshot["compute_only"][int(position)]:
            weights[indices[int(position)]][name] = tensor
    saved = snapshot["optimizer"]
    if saved is None:
        return weights, {}
    optimizer: dict[int, dict[str, Any]] = {index: {} for index in indices}
    ids = [parameter_id for group in saved["param_groups"] for parameter_id in group["params"]]
    for parameter_id, (index, name) in zip(ids, snapshot["parameter_names"], strict=True):
        if parameter_id in saved["state"]:
            optimizer[index][name] = saved["state"][parameter_id]
    optimizer[-1] = {"param_groups": [{k: v for k, v in group.items() if k != "params"}
                                      for group in saved["param_groups"]]}
    return weights, optimizer


def _write_layers(files: WrittenFiles, root_uri: str, step: int, encoded: dict[int, bytes]) -> None:
    """The first replica's files: per global layer, its weights and optimizer part."""
    from raypipe.checkpoint.store import write_encoded_layer

    for index, payload in encoded.items():
        files.layers[index] = write_named(root_uri, step, layer_file_name(index),
                                          lambda: write_encoded_layer(root_uri, step, index, payload))


def _write_optimizer_parts(files: WrittenFiles, root_uri: str, step: int, encoded: dict[int, bytes],
                           replica: int) -> None:
    """ZeRO-1, a replica after the first: per layer, the optimizer state it owns."""
    from raypipe.checkpoint.store import write_encoded_blob

    for index, payload in encoded.items():
        name = optimizer_part_name(index, replica)
        files.blobs.append(write_named(root_uri, step, f"{name}.pt",
                                       lambda: write_encoded_blob(root_uri, step, name, payload)))
