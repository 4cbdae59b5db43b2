"""A stage's state copied to host memory, and copied back into the live tensors.

A snapshot (and a checkpoint's copy) must not hold the stage's device tensors:
Ray pickles a CUDA tensor through torch, so only a process with CUDA could
read it (the snapshot keeper has none), and unpickling it on a worker puts a
second full copy of the state on its GPU. So the state is staged in host
memory first, by one function for every device (:func:`stage_to_host`):

* on a GPU, into pinned host buffers, on a side CUDA stream that first waits
  for the work already queued on the compute stream (the last commit), and
  recorded with an event; the compute stream goes on with the next step
  meanwhile, and the copy is read (or the commit ordered after it, on the
  device: :meth:`HostCopy.order_before`) only once the event has completed;
* on the CPU, by plain copies on the calling thread (torch's copies leave
  Python's GIL to the step's thread).

Either way the copy shares no storage with the live tensors. The buffers are
kept by a :class:`HostBuffers` and used again by the next copy whose tensor at
the same place has the same shape and dtype, once nothing holds the previous
copy any more (pinned memory is slow to allocate; fresh pages cost page faults).

A restore goes the other way into the tensors that are there
(:func:`load_optimizer_in_place`; a module's ``load_state_dict`` already
copies into its parameters): no second copy of the state on the device.
"""
from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

Path = tuple[Hashable, ...]  # where a tensor sits in a nested state: its keys and list positions


def copy_path(device: torch.device) -> str:
    """Which way :func:`stage_to_host` copies the state of a worker on ``device``:
    ``"cuda"`` (pinned buffers, a side stream and an event) or ``"host"`` (plain copies)."""
    return "cuda" if torch.device(device).type == "cuda" else "host"


@dataclass
class _Buffer:
    tensor: torch.Tensor  # the pooled host memory
    handed_out: weakref.ref | None  # the last copy made into it, while anything holds that copy


class HostBuffers:
    """Host buffers kept for the next copy of the same state, by place in the state.

    Each copy is handed out as a tensor object of its own over the buffer; the
    buffer is written again only once that object is gone (the snapshot was
    shipped and dropped), so a copy someone still holds never changes under them.
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._buffers: dict[Path, _Buffer] = {}

    def take(self, path: Path, like: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor shaped like ``like``, for the tensor at ``path``."""
        kept = self._buffers.get(path)
        if (kept is not None and kept.tensor.shape == like.shape and kept.tensor.dtype == like.dtype
                and (kept.handed_out is None or kept.handed_out() is None)):
            buffer = kept.tensor
        else:
            buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pinned)
        handed = buffer.view(buffer.shape)  # a tensor object of its own: alive while the copy is held
        self._buffers[path] = _Buffer(buffer, weakref.ref(handed))
        return handed

    def keep_only(self, paths: set[Path]) -> None:
        """Free the buffers of places the last copy no longer had (a layout changed)."""
        for path in set(self._buffers) - paths:
            del self._buffers[path]

    def __len__(self) -> int:
        return len(self._buffers)


class HostCopy:
    """A copy of a state to host memory, started by :func:`stage_to_host`.

    :meth:`wait` returns the state with host tensors once they hold their values;
    :meth:`order_before` makes a CUDA stream (the compute stream's commit) wait
    for the copy on the device, without blocking the host.
    """

    def __init__(self, state: Any, event: Any = None) -> None:
        self._state = state
        self.event = event  # a torch.cuda.Event recorded after the copies; None on the host path

    def done(self) -> bool:
        """Whether the host tensors hold their values yet."""
        return self.event is None or self.event.query()

    def wait(self) -> Any:
        """The state, every tensor in host memory (blocks this thread, not the GIL, until copied)."""
        if self.event is not None:
            self.event.synchronize()
        return self._state

    def order_before(self, stream: Any) -> None:
        """Make ``stream``'s later work (an optimizer step that changes the copied
        tensors in place) wait on the device for this copy; nothing on the host path."""
        if self.event is not None:
            stream.wait_event(self.event)


def stage_to_host(state: Any, device: torch.device | str, buffers: HostBuffers | None = None,
                  stream: Any = None) -> HostCopy:
    """Start copying every tensor in ``state`` (nested dicts, lists and tuples, such as
    a state dict; dicts keep their kind and attributes, as a state dict's ``_metadata``)
    to host memory, for a worker on ``device``.

    On CUDA (:func:`copy_path`) the copies run on ``stream`` (a side stream: default
    ``torch.cuda.Stream(device)``), after the work queued so far on the device's current
    stream, into pinned buffers; on the host they run here. ``buffers`` keeps the
    buffers for the next copy (default: fresh ones). The returned :class:`HostCopy`
    gives the state once copied. Non-tensor values are copied (a deep copy), so the
    result shares nothing mutable with ``state``.
    """
    device = torch.device(device)
    if buffers is None:  # (not `or`: an empty pool is falsy)
        buffers = HostBuffers(pinned=copy_path(device) == "cuda")
    if copy_path(device) == "cuda":
        return _stage_on_side_stream(state, device, buffers, stream)
    staged, paths = _mapped(state, (), lambda path, tensor: buffers.take(path, tensor).copy_(tensor.detach()))
    buffers.keep_only(paths)
    return HostCopy(staged)


def _stage_on_side_stream(state: Any, device: torch.device, buffers: HostBuffers, stream: Any) -> HostCopy:
    side = stream if stream is not None else torch.cuda.Stream(device)
    # after what the compute stream has queued (the last commit's updates); its next step runs on meanwhile.
    # The source tensors outlive the copy: they are the live state, and whoever changes them in place (the
    # next commit) waits for it (HostCopy.order_before, or the host after HostCopy.wait)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        def copied(path: Path, tensor: torch.Tensor) -> torch.Tensor:
            host = buffers.take(path, tensor)
            if tensor.device.type == "cuda":
                host.copy_(tensor.detach(), non_blocking=True)  # pinned: asynchronous to the host
            else:  # a host tensor in a GPU worker's state (AdamW's step): a plain copy
                host.copy_(tensor.detach())
            return host

        staged, paths = _mapped(state, (), copied)
        event = torch.cuda.Event()
        event.record(side)
    buffers.keep_only(paths)
    return HostCopy(staged, event)


def _mapped(state: Any, path: Path, tensor_copy: Callable[[Path, torch.Tensor], torch.Tensor]) -> tuple[Any, set]:
    """``state`` with every tensor replaced by ``tensor_copy(path, tensor)``, and the paths of the tensors."""
    paths: set[Path] = set()

    def walk(value: Any, at: Path) -> Any:
        if isinstance(value, torch.Tensor):
            paths.add(at)
            return tensor_copy(at, value)
        if isinstance(value, dict):
            mapped = copy.copy(value)  # keeps the kind and attributes (a state dict's _metadata)
            mapped.update((key, walk(item, (*at, key))) for key, item in value.items())
            return mapped
        if isinstance(value, list):
            return [walk(item, (*at, position)) for position, item in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(walk(item, (*at, position)) for position, item in enumerate(value))
        return copy.deepcopy(value)

    return walk(state, path), paths


def load_optimizer_in_place(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> bool:
    """Load ``saved`` (an ``optimizer.state_dict()``, e.g. with host tensors) by copying
    into the optimizer's state tensors that are there, where torch's own
    ``load_state_dict`` would put the same values (dtype and device as it places them:
    AdamW's ``step`` stays on the host unless fused or capturable). Falls back to
    ``load_state_dict`` (a new device copy) when the state does not fit in place: a
    parameter without state yet, another shape, dtype or placement, load hooks or an
    optimizer with its own ``load_state_dict``. Returns whether it loaded in place."""
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    if not _loads_like_torch(optimizer) or not _groups_match(groups, saved_groups):
        optimizer.load_state_dict(saved)
        return False
    by_id = {saved_id: parameter for group, saved_group in zip(groups, saved_groups)
             for saved_id, parameter in zip(saved_group["params"], group["params"])}
    special = {saved_id for saved_group in saved_groups if saved_group.get("fused") or saved_group.get("capturable")
               for saved_id in saved_group["params"]}
    state = saved["state"]
    if not all(_fits(by_id[saved_id], optimizer.state.get(by_id[saved_id]), values, saved_id in special)
               for saved_id, values in state.items()):
        optimizer.load_state_dict(saved)
        return False
    kept = {by_id[saved_id] for saved_id in state}
    for parameter in [p for p in optimizer.state if p not in kept]:
        del optimizer.state[parameter]  # as torch's load leaves it: only the saved state
    with torch.no_grad():
        for saved_id, values in state.items():
            current = optimizer.state[by_id[saved_id]]
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    current[key].copy_(value)
                else:
                    current[key] = copy.deepcopy(value)
    for group, saved_group in zip(groups, saved_groups):
        loaded = {key: copy.deepcopy(value) for key, value in saved_group.items() if key != "params"}
        loaded["params"] = group["params"]
        if "param_names" in group and "param_names" not in loaded:
            loaded["param_names"] = group["param_names"]
        group.clear()  # the same dict objects: whatever holds a group (a scheduler) sees the loaded one
        group.update(loaded)
    return True


def _loads_like_torch(optimizer: torch.optim.Optimizer) -> bool:
    return (type(optimizer).load_state_dict is torch.optim.Optimizer.load_state_dict
            and not getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None)
            and not getattr(optimizer, "_optimizer_load_state_dict_post_hooks", None))


def _groups_match(groups: list[dict], saved_groups: list[dict]) -> bool:
    return len(groups) == len(saved_groups) and all(
        len(group["params"]) == len(saved_group["params"]) for group, saved_group in zip(groups, saved_groups))


def _fits(parameter: torch.Tensor, current: dict | None, values: dict, fused_or_capturable: bool) -> bool:
    """Whether ``values`` copy into ``current`` leaving what torch's load would make."""
    if current is None or current.keys() != values.keys():
        return False
    for key, value in values.items():
        now = current[key]
        if isinstance(value, torch.Tensor) != isinstance(now, torch.Tensor):
            return False
        if not isinstance(value, torch.Tensor):
            continue
        if key == "step":  # torch keeps a plain optimizer's step where it is, else float32 on the device
            dtype, device = ((torch.float32, parameter.device) if fused_or_capturable else (value.dtype, value.device))
        else:
            dtype = parameter.dtype if parameter.is_floating_point() else value.dtype
            device = parameter.device
        if now.shape != value.shape or now.dtype != dtype or now.device != device:
            return False
    return True
