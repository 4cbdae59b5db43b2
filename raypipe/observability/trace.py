"""A step's measured per-stage timeline as a Chrome trace JSON or a PNG Gantt chart.

The input is :attr:`raypipe.core.result.StepResult.timeline`: one
:class:`~raypipe.core.result.OpEvent` per op, with wall-clock start/end seconds.
Times are shown relative to the earliest event, so the gaps between a stage's
ops are its idle time (the pipeline bubble plus any waiting on transfers).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

from raypipe.core.result import OpEvent, TimelineMark

# Colours for the Gantt chart. A backward split into its input-gradient (I) and
# weight-gradient (W) halves (the zero-bubble schedules) is drawn in two shades of
# the unsplit backward's colour. Ops without an entry (grad_stats, optimizer,
# reduce, ...) are drawn grey.
OP_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
OTHER_COLOUR = "#9A9A9A"
OP_LABELS = {"F": "forward (F)", "B": "backward (B)", "I": "input gradient (I)", "W": "weight gradient (W)"}
# A receive (and the step gate) is the stage waiting for a neighbour or the
# driver, not working: drawn as hatched outline, so that it reads as idle time
# with a cause rather than as work.
WAIT_OPS = frozenset({"recv", "gate"})
WAIT_STYLE = {"facecolor": "white", "edgecolor": "#B0B0B0", "hatch": "////", "linewidth": 0.5}
# With several model chunks a worker (interleaved_1f1b, zbv), a chunk's ops are drawn the
# paler the later the chunk, so that which half of a V, or which loop, an op belongs to shows.
CHUNK_ALPHAS = (1.0, 0.55, 0.35, 0.25)
# A mark (a worker found slow) is a red tick across its worker's row, labelled with what happened.
MARK_COLOUR = "#D62728"


def _check_events(events: Sequence[OpEvent]) -> None:
    for index, event in enumerate(events):
        if event.end < event.start:
            raise ValueError(
                f"timeline event {index} (stage {event.stage}, op {event.op!r}, "
                f"micro_batch {event.micro_batch}) ends before it starts: "
                f"start={event.start}, end={event.end}"
            )


def _rows(events: Sequence[OpEvent], marks: Sequence[TimelineMark] = ()
          ) -> dict[tuple[int, int, int], tuple[int, str]]:
    """One row per worker (of an event or a mark), (replica, stage, tp_rank) -> (row index, name), in rank order."""
    workers = sorted({_worker(event) for event in events} | {(mark.replica, mark.stage, mark.tp_rank)
                                                             for mark in marks})
    replicated = any(replica for replica, _, _ in workers)
    split = any(tp_rank for _, _, tp_rank in workers)  # tensor parallelism: a stage's t workers, a row each

    def name(replica: int, stage: int, tp_rank: int) -> str:
        return ", ".join([*([f"replica {replica}"] if replicated else []), f"stage {stage}",
                          *([f"tp_rank {tp_rank}"] if split else [])])

    return {worker: (row, name(*worker)) for row, worker in enumerate(workers)}


def _worker(event: OpEvent) -> tuple[int, int, int]:
    """The worker that ran ``event``, as ``_rows`` keys it."""
    return event.replica, event.stage, event.tp_rank


def _chunked(events: Sequence[OpEvent]) -> bool:
    """Whether the timeline is of a schedule with several model chunks a worker."""
    return any(event.chunk for event in events)


def _event_name(event: OpEvent, chunked: bool = False) -> str:
    if event.micro_batch is None:
        return event.op
    return f"{event.op}{event.micro_batch}" + (f" chunk {event.chunk}" if chunked else "")


def _chunk_alpha(chunk: int) -> float:
    return CHUNK_ALPHAS[min(chunk, len(CHUNK_ALPHAS) - 1)]


def chrome_trace(events: Sequence[OpEvent], marks: Sequence[TimelineMark] = ()) -> dict:
    """Chrome trace-event JSON (a dict) for Perfetto or ``chrome://tracing``.

    Each op is a complete ("X") event; ``pid`` is the worker's row (named
    "stage N", or "replica R, stage N" with several replicas), ``ts``/``dur``
    are microseconds since the first event's start, and ``args`` holds the
    micro-batch (and, with several model chunks a worker, the chunk, also in the
    name: "F3 chunk 1"). Events keep the order they are given in. Each of ``marks``
    (:attr:`~raypipe.core.result.StepResult.marks`) is an instant ("i") event on its
    worker's row, named by what happened.
    """
    _check_events(events)
    rows = _rows(events, marks)
    chunked = _chunked(events)
    trace_events: list[dict] = []
    for row, name in rows.values():
        trace_events.append({"name": "process_name", "ph": "M", "pid": row, "tid": 0, "args": {"name": name}})
        # Keep rows in rank order regardless of which reported first.
        trace_events.append(
            {"name": "process_sort_index", "ph": "M", "pid": row, "tid": 0, "args": {"sort_index": row}}
        )
    origin = min((event.start for event in events), default=min((mark.time for mark in marks), default=0.0))
    for mark in marks:
        trace_events.append({"name": mark.what, "cat": "mark", "ph": "i", "s": "p",
                             "pid": rows[(mark.replica, mark.stage, mark.tp_rank)][0], "tid": 0,
                             "ts": (mark.time - origin) * 1e6})
    for event in events:
        trace_events.append(
            {
                "name": _event_name(event, chunked),
                "cat": event.op,
                "ph": "X",
                "pid": rows[_worker(event)][0],
                "tid": 0,
                "ts": (event.start - origin) * 1e6,
                "dur": (event.end - event.start) * 1e6,
                "args": {"micro_batch": event.micro_batch, **({"chunk": event.chunk} if chunked else {})},
            }
        )
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Sequence[OpEvent], path: str | os.PathLike,
                       marks: Sequence[TimelineMark] = ()) -> None:
    """Write :func:`chrome_trace` of ``events`` (and ``marks``) to ``path`` as JSON."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump(chrome_trace(events, marks), file)


def plot_gantt(events: Sequence[OpEvent], path: str | os.PathLike, title: str | None = None,
               marks: Sequence[TimelineMark] = ()) -> None:
    """Draw the timeline as a Gantt chart PNG: one row per worker (stage, or
    replica and stage), time in ms.

    F, B, I and W ops are coloured (labelled with their micro-batch where wide
    enough), a later model chunk's paler (:data:`CHUNK_ALPHAS`); a receive is drawn
    hatched, as the stage waiting for its neighbour; other ops are grey; white space
    in a row is that stage idling. Each of ``marks`` is a red tick across its worker's
    row, labelled with what happened ("slow 2.00x").
    """
    # The object-oriented API with an Agg canvas: no pyplot global state, no
    # display needed, safe to call from any thread.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    _check_events(events)
    if not events:
        raise ValueError("plot_gantt: the timeline has no events to draw")
    origin = min(event.start for event in events)
    span_ms = max(event.end for event in events) * 1e3 - origin * 1e3
    rows = _rows(events, marks)
    figure = Figure(figsize=(11, 1.0 + 0.7 * len(rows)), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for event in events:
        start_ms = (event.start - origin) * 1e3
        width_ms = (event.end - event.start) * 1e3
        row = rows[_worker(event)][0]
        if event.op in WAIT_OPS:
            axes.broken_barh([(start_ms, width_ms)], (row - 0.4, 0.8), facecolors=WAIT_STYLE["facecolor"],
                             edgecolor=WAIT_STYLE["edgecolor"], hatch=WAIT_STYLE["hatch"],
                             linewidth=WAIT_STYLE["linewidth"])
            continue
        colour = OP_COLOURS.get(event.op, OTHER_COLOUR)
        axes.broken_barh([(start_ms, width_ms)], (row - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.5,
                         alpha=_chunk_alpha(event.chunk))
        # Label F/B/I/W bars with their micro-batch where the digits fit (~1.2% of the axis each).
        label = str(event.micro_batch)
        if event.op in OP_COLOURS and event.micro_batch is not None and width_ms > 0.012 * span_ms * len(label):
            axes.text(start_ms + width_ms / 2, row, label, ha="center", va="center", fontsize=8,
                      color="white" if event.chunk == 0 else "black")

    for mark in marks:
        row, at_ms = rows[(mark.replica, mark.stage, mark.tp_rank)][0], (mark.time - origin) * 1e3
        axes.vlines(at_ms, row - 0.45, row + 0.45, colors=MARK_COLOUR, linewidth=2)
        axes.text(at_ms, row - 0.45, mark.what, ha="right", va="bottom", fontsize=8, color=MARK_COLOUR)
    axes.set_yticks(range(len(rows)), [name for _, name in rows.values()])
    axes.set_ylim(len(rows) - 0.5, -0.5)  # stage 0 on top, as a pipeline is usually drawn
    axes.set_xlim(0, span_ms * 1.01 if span_ms > 0 else 1)
    axes.set_xlabel("time since first op (ms)")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    drawn = {event.op for event in events}
    # the legend names only the op kinds this timeline has (no I/W entries for a 1F1B step)
    handles = [Patch(facecolor=colour, label=OP_LABELS[op]) for op, colour in OP_COLOURS.items()
               if op in drawn or op == "F"]
    for chunk in sorted({event.chunk for event in events if event.op in OP_COLOURS} - {0}):
        handles.append(Patch(facecolor=OP_COLOURS["F"], alpha=_chunk_alpha(chunk), label=f"chunk {chunk} (paler)"))
    if drawn & WAIT_OPS:
        handles.append(Patch(label="waiting for a neighbour (recv)", **WAIT_STYLE))
    if drawn - OP_COLOURS.keys() - WAIT_OPS:
        handles.append(Patch(facecolor=OTHER_COLOUR, label="other (send, grad stats, reduce, optimizer)"))
    handles.append(Patch(facecolor="white", edgecolor="#444444", label="idle (bubble)"))
    if marks:
        handles.append(Patch(facecolor=MARK_COLOUR, label="mark (a worker found slow)"))
    figure.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=8)
    axes.set_title(title or "pipeline timeline, one step")
    figure.savefig(path, format="png")
