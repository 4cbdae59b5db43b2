"""The trainer's state in and out: full state dicts, sharded checkpoints (saved in
the background, loaded into any partition, falling back past damaged ones) and
Hugging Face export. The checkpoint manager of a
:class:`~raypipe.trainer.PipelineTrainer`: it reads the running layout from the
:class:`~raypipe.control.controller.Controller` (a frozen
:class:`~raypipe.control.controller.Layout`) and the step count and loss scale
from the trainer's :class:`TrainingProgress`."""
from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from raypipe.checkpoint.parts import add_sole_mains
from raypipe.checkpoint_manager.pending import PendingSave, SavedCheckpoint
from raypipe.core.partition import worker_layers
from raypipe.core.validation import check_int
from raypipe.errors import CheckpointError, CheckpointMismatchError, RaypipeError
from raypipe.models.layers import split_state_by_layer

if TYPE_CHECKING:
    from raypipe.control.controller import Controller
    from raypipe.core.loss_scale import LossScaler

logger = logging.getLogger("raypipe")


@dataclass
class TrainingProgress:
    """What a run has done, besides its workers' state: the steps committed and the fp16 loss scale."""

    step_count: int = 0
    scaler: LossScaler | None = None


class TrainerState:
    """State dicts, checkpoints and export of a :class:`~raypipe.trainer.PipelineTrainer`
    whose workers ``controller`` runs; ``layer_names`` are the user's names of the
    layers, ``llama`` what export and checkpoints need of a LLaMA (else None)."""

    def __init__(self, controller: Controller, progress: TrainingProgress, layer_names: list[str],
                 llama: dict[str, Any] | None) -> None:
        self._controller, self._progress = controller, progress
        self._layer_names, self._llama = layer_names, llama
        self._damaged_checkpoints: set[tuple[str, int]] = set()  # (root, step) a load fell back past
        self._pending_save = None  # the checkpoint save in flight (a PendingSave)

    @property
    def step_count(self) -> int:
        return self._progress.step_count

    @property
    def scaler(self) -> LossScaler | None:
        return self._progress.scaler

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model, with the user's parameter names (``model.state_dict()`` keys).

        A worker that died or hung since the last step is replaced first, with
        that step's state (as a failed step heals): the state is the same."""
        self._controller.check_usable()
        return self._controller.between_steps(self._read_state_dict, self.step_count, "during state_dict")

    def _read_state_dict(self) -> dict[str, torch.Tensor]:
        step, during = self.step_count, "during state_dict"
        per_layer: dict[int, dict] = {}
        layout = self._controller.layout
        for states in self._controller.gather([actor.state_dict.remote() for actor in layout.first_replica], step,
                                              during):
            per_layer.update(states)
        add_sole_mains(per_layer, *self._controller.gather([actor.sole_main_weights.remote()
                                                            for actor in self._other_replicas(layout)], step, during))
        return {f"{self._layer_names[index]}.{key}": value
                for index in sorted(per_layer) for key, value in per_layer[index].items()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Scatter a full state dict (keys as :meth:`state_dict`) to the stages."""
        per_layer = split_state_by_layer(state_dict, self._layer_names)
        self._controller.heal_if_broken(self.step_count, "a state dict load")
        layout = self._controller.layout
        config = layout.config
        # every replica's workers, in rank order
        ranges = worker_layers(layout.balance, config.num_stages, config.placement) * layout.topology.num_replicas
        self._controller.get([actor.load_state_dict.remote({i: per_layer[i] for i in indices})
                              for actor, indices in zip(layout.actors, ranges)])
        self._controller.state_loaded(self.step_count)

    def save_checkpoint(self, root_uri: str, extra: dict | None = None, keep_last: int | None = None, *,
                        wait: bool = True) -> int:
        """Write a sharded checkpoint of every layer and the trainer's state; returns its step.

        Stages write their own layers in parallel (once: the first replica's,
        every replica holds the same; with ``shard_optimizer`` the other replicas
        write their optimizer parts); the manifest, written last, makes the
        checkpoint complete. ``keep_last=k`` then deletes all but the newest ``k``
        complete checkpoints under ``root_uri``.

        ``wait=False`` saves in the background: each worker copies its state to
        host memory (the state after the last step; training stalls only for that
        copy) and a thread of the worker writes the files while the next steps
        run; a driver thread writes the manifest once every file is written, then
        prunes. While a save is in flight each worker holds one more host copy of
        its state: its weights and its optimizer state (``raypipe plan`` prints
        it). At most one save is in flight: a save first waits for the one before,
        and so do :meth:`wait_for_checkpoint`, :meth:`load_checkpoint`,
        :meth:`export_hf` and :meth:`shutdown`; there a failed write raises
        :class:`~raypipe.CheckpointError` naming the file. A worker lost while it
        writes leaves that checkpoint incomplete (never loaded) with a warning,
        and the next step heals it; with ``wait=True`` that raises instead. One
        that died or hung since the last step is replaced first (with that
        step's state), so the checkpoint is whole.
        """
        from raypipe.checkpoint_manager.pending import SaveRequest

        self.wait_for_checkpoint()
        if keep_last is not None:
            check_int("keep_last", keep_last, 1, allowed="must be an int >= 1 (checkpoints kept), or None for all")
        self._controller.check_usable()
        self._controller.heal_if_broken(self.step_count, "a checkpoint save")  # a dead writer: incomplete
        layout = self._controller.layout
        step, writers = self.step_count, list(layout.first_replica)
        self._replace_damaged(str(root_uri), step)
        parts = self._optimizer_parts(layout)
        if parts > 1:  # ZeRO-1: the other replicas' optimizer state, as blobs
            writers = list(layout.actors)
        names = [f"replica {where.replica} stage {where.stage}" for where in
                 map(layout.topology.coordinates, range(len(writers)))]
        self._pending_save = PendingSave(SaveRequest(str(root_uri), step, writers, names,
                                                     self._manifest_extra(extra, parts), keep_last,
                                                     layout.config.hang_timeout_s))
        self._controller.before_next_step(writers)  # their copy is of the state before the next step
        self._controller.checkpoint_saved(str(root_uri), step, parts)
        if wait:
            saved = self.wait_for_checkpoint()
            if not saved.complete:
                raise RaypipeError(f"checkpoint step {step} under {root_uri} is not complete: a worker was lost "
                                   "while writing it (see the warning); the next step heals it, then save again")
        return step

    def wait_for_checkpoint(self) -> SavedCheckpoint | None:
        """Wait for the background save in flight, if any; returns what it wrote
        (``complete`` is False when a worker was lost while writing it), or None
        when no save was in flight. A failed write raises
        :class:`~raypipe.CheckpointError` naming the file (once: the save is over)."""
        pending, self._pending_save = self._pending_save, None
        return None if pending is None else pending.result()

    def _replace_damaged(self, root_uri: str, step: int) -> None:
        """A complete checkpoint is never overwritten, except one that a load found damaged."""
        from raypipe.checkpoint.store import delete_checkpoint

        if (root_uri, step) in self._damaged_checkpoints:
            logger.warning("raypipe: replacing the damaged checkpoint of step %d under %s", step, root_uri)
            delete_checkpoint(root_uri, step)
            self._damaged_checkpoints.discard((root_uri, step))

    def settle_saves(self) -> None:
        """Before a heal loads a checkpoint: the save in flight completes, or fails and is reported."""
        try:
            self.wait_for_checkpoint()
        except RaypipeError as error:
            logger.warning("raypipe: %s", error)

    def _manifest_extra(self, extra: dict | None, optimizer_parts: int) -> dict:
        state = {"step_count": self.step_count, "scaler": self.scaler.state_dict() if self.scaler else None,
                 "layer_names": self._layer_names, "optimizer_parts": optimizer_parts, **(extra or {})}
        if self._llama is not None:
            state["model"] = self._llama  # lets `raypipe export` convert the checkpoint
        try:  # now, not when a background save writes its manifest
            json.dumps(state)
        except TypeError as error:
            raise TypeError(f"checkpoint extra metadata is not JSON-serializable: {error}") from None
        return state

    def export_hf(self, uri: str, dtype: str | None = None) -> str:
        """Write the model as a Hugging Face LLaMA directory (``config.json``, one safetensors shard per
        layer, written by the stages in parallel, and the index); ``dtype`` None (default: as trained,
        the fp32 main weights, twice bf16's size), "fp32", "bf16" or "fp16"; config.json records it.

        Only for a LLaMA built with ``llama_layers`` or ``from_pretrained``. Returns ``uri``.
        """
        from raypipe.models.hf.export import check_dtype, prepare_output, write_index_and_config

        if self._llama is None:
            raise ValueError("export_hf needs a LLaMA model (raypipe.models.llama.llama_layers or from_pretrained)")
        check_dtype(dtype)
        self.wait_for_checkpoint()
        self._controller.check_usable()
        self._controller.heal_if_broken(self.step_count, "an export")
        prepare_output(str(uri))
        n_blocks = self._llama["llama_config"]["n_layers"]
        layout = self._controller.layout
        stages, t = layout.topology.num_stages, layout.topology.tensor_parallel
        # every worker of a split stage gathers its layers whole together (collectives): all are asked,
        # tp_rank 0's copy is used, and tp_rank 0 writes
        others = [actor.sole_main_weights.remote() for actor in self._other_replicas(layout)][::t]
        written = self._controller.get([actor.export_hf.remote(str(uri), dtype, n_blocks,
                                                               *others[rank // t::stages])
                                        for rank, actor in enumerate(layout.first_replica)])
        write_index_and_config(str(uri), self._llama, dtype, [shard for shards in written for shard in shards])
        return str(uri)

    @staticmethod
    def _other_replicas(layout: Any) -> list:
        """Workers beyond the first replica that hold main weights no one else keeps
        (ZeRO-1; in rank order); none unsharded."""
        topology = layout.topology
        return list(layout.actors[topology.num_stages * topology.tensor_parallel:]) if layout.config.shard_optimizer else []

    @staticmethod
    def _optimizer_parts(layout: Any) -> int:
        return layout.topology.num_replicas if layout.config.shard_optimizer else 1

    def load_checkpoint(self, root_uri: str, step: int | None = None) -> dict:
        """Load checkpoint ``step`` into any partition; returns its extra state.

        Without ``step``: the newest intact one. A damaged file (missing, truncated,
        failing its checksum) makes the load fall back to the next older complete
        checkpoint, with a warning naming the file; with ``step`` it raises
        :class:`~raypipe.CheckpointError` naming it. A checkpoint of another model (other
        layers, or tensors of other shapes) raises a :class:`~raypipe.CheckpointError` whose
        first line names the stage, layer and tensor that do not fit. Either way no worker's
        state changed: every worker reads and checks its layers before any loads them."""
        from raypipe.checkpoint.store import list_checkpoints

        self.wait_for_checkpoint()
        if step is not None:
            return self._load_checkpoint(str(root_uri), step)
        steps = list_checkpoints(str(root_uri))
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint under {root_uri}")
        damaged = []
        for candidate in reversed(steps):
            try:
                return self._load_checkpoint(str(root_uri), candidate)
            except CheckpointMismatchError:
                raise  # intact files of another model: an older checkpoint of it fits no better
            except CheckpointError as error:
                logger.warning("raypipe: checkpoint step %d is damaged (%s); trying an older one", candidate, error)
                damaged.append(error)
                self._damaged_checkpoints.add((str(root_uri), candidate))  # a save of that step replaces it
        raise damaged[0]  # none intact: the newest one's damage

    def _load_checkpoint(self, root_uri: str, step: int) -> dict:
        from raypipe.checkpoint.store import read_manifest

        manifest = read_manifest(str(root_uri), step)
        if manifest["num_layers"] != len(self._layer_names):
            raise CheckpointMismatchError(f"{root_uri} step {step}", f"the model ({len(self._layer_names)} layers)",
                                          f"the checkpoint holds {manifest['num_layers']} layers")
        extra = manifest.get("extra", {})
        parts = extra.get("optimizer_parts", 1)
        actors = self._controller.layout.actors
        try:  # every worker reads and checks its layers first: one that refuses them leaves every worker as it was
            self._controller.get([actor.read_checkpoint.remote(str(root_uri), step, parts) for actor in actors])
        except Exception:
            with contextlib.suppress(RaypipeError):  # a worker lost meanwhile (the controller's get says so): healed later
                self._controller.get([actor.drop_read_checkpoint.remote() for actor in actors])
            raise
        self._controller.get([actor.load_read_checkpoint.remote() for actor in actors])
        self._progress.step_count = extra.get("step_count", step)
        if self.scaler and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        self._controller.state_loaded(self.step_count, (str(root_uri), step, parts))
        return extra
