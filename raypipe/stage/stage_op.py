"""A stage op's record: its timed event on the stage's timeline, and its failure
as a :class:`~raypipe.errors.StageError` naming the stage, replica, op and
micro-batch.

On a CPU an op's time is the host's: ``time.time()`` around it. On a GPU the host
only queues the op's kernels and returns, so host times would measure the queueing:
the op records a CUDA event pair around its work instead, and the step's device
times are read back once, when the step's last op (the optimizer's) ends, in one
wait on the last event (:class:`DeviceTimer`).

With tensor parallelism a compute op (F, B, I, W) also records the seconds its host spent in the
stage's collectives (:attr:`OpEvent.collective_wait`, :mod:`raypipe.stage.collective_wait`): the
waiting for a slow peer, which is not this rank's own compute. On CPU only, and sampled: at the
steps whose number divides by :data:`COLLECTIVE_WAIT_EVERY` (the same on every worker); at the
others it is None, not measured. On a GPU the host does not wait in them, and the wait is 0.
"""
from __future__ import annotations

import functools
import inspect
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from raypipe.core.result import OpEvent
from raypipe.errors import StageError

# every step ends with this op (StageWorker.commit runs it, stepped or skipped): when it
# ends, the step's device times are resolved
STEP_END_OP = "optimizer"
# a tensor-parallel CPU worker's collective wait is measured at the steps whose number divides by this: the
# dispatch mode that measures it costs a Python call per ATen op (10-30% of the tiny LLaMA's F and B CPU time),
# and every worker samples the same steps, so each sampled step's own compute is known for all of them
COLLECTIVE_WAIT_EVERY = 10


def stage_op(op: str, per_micro_batch: bool = True, timed: bool = True, in_step: bool = False) -> Callable:
    """Time the op into the stage's timeline and re-raise failures as StageError.

    ``in_step`` ops (forward, backward of a training step) also remember their
    failure: :meth:`~raypipe.stage.worker.StageWorker.finish_backward` raises it again, so that no
    stage steps its optimizer after a failed op.
    """

    def decorate(method: Callable) -> Callable:
        chunk_of = _argument(method, "chunk", 0)
        step_of = _argument(method, "step", None)

        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            micro_batch = None
            if per_micro_batch:
                micro_batch = kwargs["micro_batch"] if "micro_batch" in kwargs else (args[0] if args else None)
            timer = device_timer(self) if timed else None
            waits, wait = None, 0.0
            if timed and in_step:
                step = step_of(args, kwargs)  # a forward's own (it begins the step), else the running one's
                waits, wait = collective_waits(self, self._running.number if step is None else step)
            start, device_start = time.time(), None
            try:
                if timer is not None:
                    device_start = timer.mark()
                if waits is None:
                    return method(self, *args, **kwargs)
                with waits:
                    return method(self, *args, **kwargs)
            except StageError as error:
                if in_step:
                    self._running.note_failure(error)
                raise
            except Exception as error:  # noqa: BLE001 - every failure gets the stage's name
                stage_error = StageError(self.stage_index, op, micro_batch, f"{type(error).__name__}: {error}",
                                         replica=self.named_replica,
                                         remote_traceback=traceback.format_exc(), original=error)
                if in_step:
                    self._running.note_failure(stage_error)
                raise stage_error from error
            finally:
                self.ops_done += 1
                if timed:
                    event = OpEvent(self.stage_index, op, micro_batch, start, time.time(), self.replica,
                                    chunk_of(args, kwargs), self.spec.tp_rank,
                                    wait if waits is None else waits.seconds)
                    self._events.append(event)
                    if timer is not None and device_start is not None:
                        try:
                            timer.add(event, device_start, timer.mark(), self._events)
                            if op == STEP_END_OP:
                                timer.resolve(self._events)
                        except Exception:  # noqa: BLE001 - a broken CUDA context: the op's own error
                            pass  # (or the next op's) says so; timing must not mask it; host times stay

        return wrapper

    return decorate


def _argument(method: Callable, name: str, absent: Any) -> Callable[[tuple, dict], Any]:
    """How to read argument ``name`` of a call of ``method`` (given by position or keyword, else its
    default); ``absent`` for a method without one. Found once, at decoration: binding every call's
    arguments would cost each op microseconds for one number."""
    parameters = list(inspect.signature(method).parameters.values())[1:]  # after self
    names = [parameter.name for parameter in parameters]
    if name not in names:
        return lambda args, kwargs: absent
    position, default = names.index(name), parameters[names.index(name)].default

    def argument_of(args: tuple, kwargs: dict) -> Any:
        if len(args) > position:
            return args[position]
        return kwargs.get(name, absent if default is inspect.Parameter.empty else default)

    return argument_of


def collective_waits(worker: Any, step: int) -> tuple[Any, float | None]:
    """How one compute op of ``worker`` in step ``step`` records its
    collective wait: ``(meter, None)``, a fresh :class:`~raypipe.stage.collective_wait.CollectiveWait`
    to run it in, at a tensor-parallel CPU worker's step sampled (every
    :data:`COLLECTIVE_WAIT_EVERY`-th); ``(None, None)`` at its other steps (not measured); ``(None,
    0.0)`` where there is nothing to measure: a stage of one tensor-parallel rank (no collective to
    wait in), or a CUDA device (the host does not wait in collectives: its kernels are queued)."""
    if getattr(worker, "tensor_mesh", None) is None or worker.device.type == "cuda":
        return None, 0.0
    if step % COLLECTIVE_WAIT_EVERY:
        return None, None
    from raypipe.stage.collective_wait import CollectiveWait  # DTensor: imported only where there is one

    return CollectiveWait(), None


def device_timer(worker: Any) -> DeviceTimer | None:
    """The worker's CUDA event timer (made on first use); None on a CPU worker."""
    device = getattr(worker, "device", None)
    if device is None or device.type != "cuda":
        return None
    timer = worker.__dict__.get("_device_timer")
    if timer is None:
        timer = worker.__dict__["_device_timer"] = DeviceTimer()
    return timer


class _Marked(NamedTuple):
    event: OpEvent
    start: Any  # torch.cuda.Event
    end: Any


class DeviceTimer:
    """CUDA events around a step's ops, resolved into their :class:`OpEvent` times once a step.

    Device times are put on the host's wall clock through the step's first op: the GPU
    reaches that op's start event when the host records it (the previous step's resolve
    waited for the GPU, so nothing is queued before it), and every other op is placed at
    its device offset from it (:func:`device_times`).
    """

    def __init__(self) -> None:
        self._marked: list[_Marked] = []

    @staticmethod
    def mark() -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, event: OpEvent, start: Any, end: Any, timeline: Sequence[OpEvent]) -> None:
        """Remember ``event``'s device events; forget those of an aborted step first (its
        events are no longer on the worker's ``timeline``)."""
        if self._marked and not any(e is self._marked[0].event for e in timeline):
            self._marked.clear()
        self._marked.append(_Marked(event, start, end))

    def resolve(self, timeline: Sequence[OpEvent]) -> None:
        """Wait for the last op's end event (one host wait a step) and rewrite each marked
        event still on ``timeline`` with its device start and end."""
        live = {id(e) for e in timeline}
        marked = [m for m in self._marked if id(m.event) in live]
        self._marked = []
        if not marked:
            return
        marked[-1].end.synchronize()
        anchor = marked[0].start
        offsets = [(anchor.elapsed_time(m.start) / 1e3, anchor.elapsed_time(m.end) / 1e3) for m in marked]
        times = device_times(marked[0].event.start, [m.event.start for m in marked], offsets)
        for m, (start, end) in zip(marked, times):
            m.event.start, m.event.end = start, end


def device_times(anchor: float, host_starts: Sequence[float],
                 offsets: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Wall-clock (start, end) of ops from their device offsets (seconds) after an anchor event
    the GPU is taken to reach at host time ``anchor``.

    Were the GPU late to reach the anchor, some op would seem to start on the device before
    the host queued it (``host_starts``); every time is then shifted by the largest such
    lead, so that no op starts before it was queued.
    """
    starts = [anchor + start for start, _ in offsets]
    lag = max([0.0] + [host - device for host, device in zip(host_starts, starts)])
    return [(anchor + lag + start, anchor + lag + end) for start, end in offsets]
