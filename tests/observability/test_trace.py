"""Chrome trace JSON and Gantt PNG of a step's timeline."""
from __future__ import annotations

import collections
import json
import struct

import pytest

from raypipe.core.result import OpEvent
from raypipe.core.schedule import gpipe_schedule
from raypipe.observability.trace import chrome_trace, plot_gantt, write_chrome_trace

T0 = 1_700_000_000.0  # a realistic time.time() origin


def ideal_gpipe_timeline(num_stages: int, num_micro_batches: int, forward=0.010, backward=0.020) -> list[OpEvent]:
    """The timeline an ideal GPipe step would measure, listed stage by stage.

    Each op starts once its stage is free and its input (previous stage's F,
    next stage's B) has arrived; each stage ends with an optimizer op.
    """
    schedule = gpipe_schedule(num_stages, num_micro_batches)
    finished: dict[tuple[int, str, int], float] = {}
    per_stage: dict[int, list[OpEvent]] = {}
    # F flows down the stages, B flows up: process stages in that order.
    for kind, stages in (("F", range(num_stages)), ("B", reversed(range(num_stages)))):
        for stage in stages:
            events = per_stage.setdefault(stage, [])
            free_at = events[-1].end if events else T0
            for op in (op for op in schedule[stage] if op.kind == kind):
                upstream = (stage - 1, "F", op.micro_batch) if kind == "F" else (stage + 1, "B", op.micro_batch)
                start = max(free_at, finished.get(upstream, T0))
                end = start + (forward if kind == "F" else backward)
                events.append(OpEvent(stage, kind, op.micro_batch, start, end))
                finished[(stage, kind, op.micro_batch)] = free_at = end
    timeline = []
    for stage in range(num_stages):
        last = per_stage[stage][-1].end
        timeline += per_stage[stage] + [OpEvent(stage, "optimizer", None, last + 0.001, last + 0.003)]
    return timeline


def complete_events_by_stage(trace: dict) -> dict[int, list[dict]]:
    by_stage: dict[int, list[dict]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            by_stage.setdefault(event["pid"], []).append(event)
    return by_stage


def test_chrome_trace_is_valid_json_with_one_event_per_op(tmp_path):
    timeline = ideal_gpipe_timeline(3, 4)
    path = tmp_path / "step.json"
    write_chrome_trace(timeline, path)
    trace = json.loads(path.read_text())

    complete = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    assert len(complete) == len(timeline)
    for event, op in zip(complete, timeline):  # given order kept, fields in microseconds
        assert event["pid"] == op.stage
        assert event["cat"] == op.op
        assert event["args"] == {"micro_batch": op.micro_batch}
        assert event["ts"] == pytest.approx((op.start - T0) * 1e6)
        assert event["dur"] == pytest.approx((op.end - op.start) * 1e6)
    assert min(event["ts"] for event in complete) == 0.0
    names = {event["pid"]: event["args"]["name"] for event in trace["traceEvents"]
             if event["ph"] == "M" and event["name"] == "process_name"}
    assert names == {0: "stage 0", 1: "stage 1", 2: "stage 2"}


def test_chrome_trace_follows_the_schedule_per_stage():
    schedule = gpipe_schedule(2, 3)
    by_stage = complete_events_by_stage(chrome_trace(ideal_gpipe_timeline(2, 3)))
    for stage, ops in enumerate(schedule):
        names = [event["name"] for event in by_stage[stage] if event["cat"] in ("F", "B")]
        assert names == [f"{op.kind}{op.micro_batch}" for op in ops]


def test_event_ending_before_it_starts_is_named():
    bad = OpEvent(stage=1, op="B", micro_batch=2, start=T0 + 1, end=T0)
    with pytest.raises(ValueError, match=r"stage 1, op 'B', micro_batch 2"):
        chrome_trace([bad])


def test_empty_timeline_gives_an_empty_trace():
    assert chrome_trace([])["traceEvents"] == []


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", data[16:24])


def test_gantt_png_is_written(tmp_path):
    path = tmp_path / "step.png"
    plot_gantt(ideal_gpipe_timeline(4, 8), path, title="GPipe p=4 m=8")
    width, height = png_size(path)
    assert width >= 800 and height >= 200
    assert path.stat().st_size > 10_000  # bars, labels and legend, not a blank canvas


def pixels_of_colour(path) -> collections.Counter:
    """How many pixels of a PNG have each colour, as lower-case "#rrggbb"."""
    from matplotlib.image import imread

    pixels = (imread(path)[..., :3] * 255).round().astype(int).reshape(-1, 3).tolist()
    return collections.Counter("#%02x%02x%02x" % tuple(rgb) for rgb in pixels)


def test_gantt_draws_split_backwards_and_receive_waits_as_what_they_are(tmp_path):
    """I and W ops get their own colours; a receive is drawn as waiting (hatched), never
    as grey "other" work, which is how a stage waiting for its first gradient used to look."""
    from raypipe.observability.trace import OP_COLOURS, OTHER_COLOUR

    timeline = [OpEvent(0, "F", 0, T0, T0 + 0.01), OpEvent(0, "recv", 0, T0 + 0.01, T0 + 0.05),
                OpEvent(0, "I", 0, T0 + 0.05, T0 + 0.06), OpEvent(0, "W", 0, T0 + 0.06, T0 + 0.07),
                OpEvent(1, "recv", 0, T0, T0 + 0.01), OpEvent(1, "F", 0, T0 + 0.01, T0 + 0.02),
                OpEvent(1, "I", 0, T0 + 0.02, T0 + 0.03), OpEvent(1, "W", 0, T0 + 0.03, T0 + 0.04)]
    plot_gantt(timeline, tmp_path / "zero_bubble.png")
    counts = pixels_of_colour(tmp_path / "zero_bubble.png")
    bar = min(counts[OP_COLOURS[op].lower()] for op in "FIW")
    assert bar > 1000  # each of F, I and W is drawn as a bar in its own colour
    # the receives (40 ms of stage 0's row, more than any F) are not drawn as grey work, and no
    # other op ran, so grey appears only as a few anti-aliased pixels of text
    assert counts[OTHER_COLOUR.lower()] < bar / 20
    assert counts[OP_COLOURS["B"].lower()] < bar / 20  # no unsplit backward, nor its legend entry


def test_a_chunked_timeline_names_and_draws_each_ops_chunk(tmp_path):
    """With several model chunks a worker the trace names each op's chunk ("F0 chunk 1", and in its
    args) and the chart draws a later chunk's ops paler, with a legend entry; one-chunk names stay."""
    from raypipe.observability.trace import CHUNK_ALPHAS, OP_COLOURS

    timeline = [OpEvent(0, "F", 0, T0, T0 + 0.02), OpEvent(0, "F", 0, T0 + 0.02, T0 + 0.04, chunk=1),
                OpEvent(0, "recv", 0, T0 + 0.04, T0 + 0.05, chunk=1), OpEvent(0, "optimizer", None, T0 + 0.05, T0 + 0.06)]
    trace = chrome_trace(timeline)["traceEvents"]
    ops = [(event["name"], event["args"]) for event in trace if event["ph"] == "X"]
    assert ops == [("F0 chunk 0", {"micro_batch": 0, "chunk": 0}), ("F0 chunk 1", {"micro_batch": 0, "chunk": 1}),
                   ("recv0 chunk 1", {"micro_batch": 0, "chunk": 1}), ("optimizer", {"micro_batch": None, "chunk": 0})]
    assert [event["name"] for event in chrome_trace(timeline[:1])["traceEvents"] if event["ph"] == "X"] == ["F0"]
    plot_gantt(timeline, tmp_path / "chunks.png")
    counts = pixels_of_colour(tmp_path / "chunks.png")
    paler = [255 - CHUNK_ALPHAS[1] * (255 - int(OP_COLOURS["F"][i:i + 2], 16)) for i in (1, 3, 5)]

    def near_paler(colour: str) -> bool:  # blending over white rounds each channel one way or the other
        return all(abs(int(colour[i:i + 2], 16) - channel) <= 2 for i, channel in zip((1, 3, 5), paler))

    # both halves drawn, each as a bar (20 ms of a 60 ms span), chunk 1's paler over the white axes
    assert counts[OP_COLOURS["F"].lower()] > 1000
    assert sum(count for colour, count in counts.items() if near_paler(colour)) > 1000, counts.most_common(8)


def test_a_stages_tensor_parallel_workers_have_a_row_each(tmp_path):
    """At t > 1 each of a stage's workers is a row of its own, named with its tp_rank; t = 1 names stay."""
    timeline = [OpEvent(0, "F", 0, T0, T0 + 0.02), OpEvent(0, "F", 0, T0, T0 + 0.03, tp_rank=1),
                OpEvent(1, "F", 0, T0 + 0.03, T0 + 0.05), OpEvent(1, "F", 0, T0 + 0.03, T0 + 0.05, tp_rank=1)]
    trace = chrome_trace(timeline)["traceEvents"]
    names = [event["args"]["name"] for event in trace if event["name"] == "process_name"]
    assert names == ["stage 0, tp_rank 0", "stage 0, tp_rank 1", "stage 1, tp_rank 0", "stage 1, tp_rank 1"]
    assert sorted(event["pid"] for event in trace if event["ph"] == "X") == [0, 1, 2, 3]
    plot_gantt(timeline, tmp_path / "tp.png")


def test_gantt_of_nothing_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no events"):
        plot_gantt([], tmp_path / "empty.png")


def test_measured_timeline_follows_the_gpipe_schedule(ray_cluster, tmp_path):
    """A real step's timeline has one F/B event per scheduled op, in schedule order per stage."""
    import torch
    from torch import nn

    import raypipe

    num_stages, num_micro_batches = 2, 4
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=num_micro_batches, schedule="gpipe")
    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)
    with raypipe.PipelineTrainer(model, nn.functional.mse_loss,
                                 optimizer=lambda params: torch.optim.SGD(params, lr=0.1), config=config) as trainer:
        result = trainer.step(inputs, targets)

    trace = chrome_trace(result.timeline)
    by_stage = complete_events_by_stage(trace)
    schedule = gpipe_schedule(num_stages, num_micro_batches)
    assert sorted(by_stage) == list(range(num_stages))
    for stage, ops in enumerate(schedule):
        # Measured order: sort by start time, so this checks when ops ran, not how they were listed.
        measured = sorted((e for e in by_stage[stage] if e["cat"] in ("F", "B")), key=lambda e: e["ts"])
        assert [(e["cat"], e["args"]["micro_batch"]) for e in measured] == [(op.kind, op.micro_batch) for op in ops]
        for earlier, later in zip(measured, measured[1:]):  # one actor runs one op at a time
            assert earlier["ts"] + earlier["dur"] <= later["ts"] + 1.0  # 1 us of clock rounding
    plot_gantt(result.timeline, tmp_path / "step.png")
    assert png_size(tmp_path / "step.png")[0] >= 800


def test_a_mark_is_an_instant_event_and_a_tick_on_its_workers_row(tmp_path):
    """A worker found slow (StepResult.marks): an instant event on its row in the trace, named by what
    happened, and a red tick on the chart; a mark's worker has its row even without an event."""
    from raypipe.core.result import TimelineMark
    from raypipe.observability.trace import MARK_COLOUR

    timeline = [OpEvent(0, "F", 0, T0, T0 + 0.02), OpEvent(1, "F", 0, T0 + 0.02, T0 + 0.06)]
    marks = [TimelineMark(0, 1, 0, T0 + 0.06, "slow 2.00x"), TimelineMark(1, 1, 0, T0 + 0.03, "slow 1.50x")]
    trace = chrome_trace(timeline, marks)["traceEvents"]
    names = [event["args"]["name"] for event in trace if event["name"] == "process_name"]
    assert names == ["replica 0, stage 0", "replica 0, stage 1", "replica 1, stage 1"]
    instants = [(event["name"], event["pid"], event["ts"], event["s"]) for event in trace if event["ph"] == "i"]
    assert instants == [("slow 2.00x", 1, pytest.approx(60_000), "p"), ("slow 1.50x", 2, pytest.approx(30_000), "p")]
    assert [event["ph"] for event in chrome_trace(timeline)["traceEvents"]].count("i") == 0
    plot_gantt(timeline, tmp_path / "marked.png", marks=marks)
    assert pixels_of_colour(tmp_path / "marked.png")[MARK_COLOUR.lower()] > 50
