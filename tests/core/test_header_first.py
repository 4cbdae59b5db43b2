"""An activation's header before its payload, in the dry-run and the lowering: no Ray or torch, milliseconds.

An exchange receives each activation's payload either after its batch (once the batch
completed) or, where the lowering awaits its header first (``header_first``, printed
``<=``), in the batch beside its sends. After the batch hangs a ring of chunked workers
that each send on before receiving; awaiting first hangs where the sender sends that
activation only after receiving something from the batch. The lowering chooses per
receive, and the dry-run judges both ways.
"""
import re

import pytest

from raypipe.core import lowering
from raypipe.core.lowering import lower
from raypipe.core.ops import (EXCHANGE, RECV_ACT, RECV_GRAD, SEND_ACT, LoweredOp, exchange, unbatch,
                              with_header_first)
from raypipe.core.schedule import PLACEMENT, make_schedule
from raypipe.core.simulator import Posting, ScheduleError, postings, run_draft, simulate
from raypipe.core.timed_simulation import simulate_timed
from tests.core.test_simulator import assert_valid_order

CHUNKED = ([("interleaved_1f1b", p, v, m) for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p)]
           + [("zbv", p, 2, m) for p in (2, 3, 4) for m in (3, 2 * p, 3 * p + 1)])


def lowered_of(name, p, v, m):
    return lower(make_schedule(name, p, m, v), PLACEMENT[name])


def every_payload(lowered, after_batch):
    """``lowered`` with every exchange's activation payloads received after its batch, or all in it."""
    def chosen(op):
        return [part for part in op.parts if part.kind == RECV_ACT and not after_batch]
    return [[with_header_first(op, chosen(op)) if op.kind == EXCHANGE else op for op in ops] for ops in lowered]


@pytest.mark.parametrize("name,p,v,m", CHUNKED)
def test_a_chunked_lowering_with_every_payload_after_its_batch_hangs_and_the_chosen_headers_run(name, p, v, m):
    lowered = lowered_of(name, p, v, m)
    assert any(op.header_first for ops in lowered for op in ops)
    assert_valid_order(lowered, simulate(lowered, PLACEMENT[name]))
    with pytest.raises(ScheduleError) as hang:
        simulate(every_payload(lowered, after_batch=True), PLACEMENT[name])
    message = str(hang.value)
    assert message.startswith("deadlock: stage 0 ")
    # stages stuck behind their batches are named, with the payload each receives after it
    assert re.search(r"stage \d+ waits on \S+ \(on \S+, then RECV_ACT\S+ after its batch\)", message), message
    assert "await its header first (<=)" in message


def test_awaiting_a_header_the_sender_sends_only_after_the_batch_hangs():
    # zbv at p = 2, m = 2: worker 0's exchange sends activation 1 on and receives activation 0 of chunk 1,
    # which worker 1 sends only after receiving activation 1: awaited first, its header never comes
    lowered = lowered_of("zbv", 2, 2, 2)
    assert repr(lowered[0][3]) == "SEND_ACT1->1+RECV_ACT0c1<-1"
    assert not any(op.header_first for ops in lowered for op in ops)
    assert_valid_order(lowered, simulate(lowered, PLACEMENT["zbv"]))
    expected = ("deadlock: stage 0 waits on SEND_ACT1->1+RECV_ACT0c1<=1 (on the header of RECV_ACT0c1<-1, before "
                "its batch); stage 1 waits on RECV_ACT1<-0")
    with pytest.raises(ScheduleError, match=re.escape(expected)):
        simulate(every_payload(lowered, after_batch=False), PLACEMENT["zbv"])


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 8)])
def test_one_chunk_per_worker_receives_every_payload_after_its_batch(name, p, m):
    lowered = lowered_of(name, p, 1, m)
    assert not any(op.header_first for ops in lowered for op in ops)
    assert_valid_order(lowered, simulate(lowered))


def test_a_header_first_receive_prints_with_a_double_arrow_and_stays_the_plain_part():
    send, receive = LoweredOp(SEND_ACT, 1, 1), LoweredOp(RECV_ACT, 0, 1, chunk=1)
    op = exchange(send, receive, header_first=[receive])
    assert repr(op) == "SEND_ACT1->1+RECV_ACT0c1<=1"
    assert repr(exchange(send, receive)) == "SEND_ACT1->1+RECV_ACT0c1<-1"
    assert op.parts == (send, receive) and unbatch([op]) == [send, receive]
    assert op != exchange(send, receive) and with_header_first(op, ()) == exchange(send, receive)


def test_an_exchange_awaits_headers_of_its_own_activations_and_in_issue_order():
    lowered = lowered_of("interleaved_1f1b", 2, 2, 2)
    index = next(i for i, op in enumerate(lowered[1]) if op.header_first)
    op = lowered[1][index]
    foreign = LoweredOp(RECV_GRAD, 0, 0)
    lowered[1][index] = op._replace(header_first=(foreign,))
    with pytest.raises(ScheduleError, match=re.escape(f"stage 1: {lowered[1][index]!r} awaits the header of "
                                                      "RECV_GRAD0<-0, which is not one of its RECV_ACT parts")):
        simulate(lowered)
    # two activations from one peer: the second cannot go in the batch while the first comes after it
    first, second = LoweredOp(RECV_ACT, 0, 0), LoweredOp(RECV_ACT, 1, 0)
    lowered[1][index] = exchange(first, second, header_first=[second])
    with pytest.raises(ScheduleError, match=r"awaits the header of RECV_ACT1<-0 but receives an earlier activation "
                                            r"from stage 0 after its batch"):
        simulate(lowered)


def test_the_timed_run_posts_a_batch_once_its_headers_are_in_and_a_later_payload_once_the_batch_completed():
    lowered = lowered_of("interleaved_1f1b", 2, 2, 2)
    # worker 0's forward is slow: F0 ends at 2, activation 0 arrives at 2.5, F1 ends at 4.5
    run = simulate_timed(lowered, {(0, "F"): 2.0, "F": 1.0, "B": 2.0}, 0.5, placement=PLACEMENT["interleaved_1f1b"])
    assert [(stage, op) for stage, op, _, _ in run.timeline] == simulate(lowered)
    spans = {(stage, repr(op)): (start, end) for stage, op, start, end in run.timeline}
    assert spans[(0, "F1")] == (2.5, 4.5) and spans[(1, "F0")] == (2.5, 3.5)
    # worker 1 reaches its exchange at 3.5 but awaits activation 1's header, which worker 0 sends as it
    # reaches its own exchange at 4.5: both batches are posted then, and activation 1 arrives at 5.0; worker 0
    # receives activation 0 of chunk 1 only after its batch (from 5.0), so worker 1's send of it ends at 5.5
    assert spans[(1, "SEND_ACT0->0+RECV_ACT1<=0")] == (3.5, 5.5)
    assert spans[(0, "SEND_ACT1->1+RECV_ACT0c1<-1")] == (4.5, 5.5)
    # awaited after the batch instead, worker 1's payload would wait behind its batch, and its batch on worker 0's
    with pytest.raises(ScheduleError, match="^deadlock: "):
        simulate_timed(every_payload(lowered, after_batch=True), {"F": 1.0, "B": 2.0},
                       placement=PLACEMENT["interleaved_1f1b"])


def test_a_receive_behind_an_activation_received_after_the_batch_from_the_same_peer_follows_it():
    send = LoweredOp(SEND_ACT, 2, 1)
    activation, gradient, other = LoweredOp(RECV_ACT, 1, 1), LoweredOp(RECV_GRAD, 0, 1), LoweredOp(RECV_GRAD, 0, 2)
    after = postings(exchange(send, activation, gradient, other))
    # the batch; then the activation, its header awaited; then the gradient behind it (a pair's issue order)
    assert after == (Posting((), (send, other)), Posting((activation,), (activation,)), Posting((), (gradient,)))
    first = postings(exchange(send, activation, gradient, other, header_first=[activation]))
    assert first == (Posting((activation,), (send, activation, gradient, other)),)


# boundary_shapes="learned": once every message key's signature is learned no header goes, and an exchange
# receives every payload in its batch; the lowering's header_first serves the steps that send headers
ONE_CHUNK = [(name, p, 1, m) for name in ("gpipe", "1f1b", "zb_h1") for p, m in ((2, 2), (3, 5), (4, 8))]


def test_a_draft_run_going_on_from_the_one_before_is_the_run_from_the_start(monkeypatch):
    """The lowering awaits more headers first, draft after draft; each draft's dry-run goes on from the
    last sweep of the one before that no changed exchange reached (run_draft's ``after``). Each must be
    the dry-run from the start of the same lowering: the same outcome, order and events."""
    drafts = []

    def checked(lowered, placement, num_chunks, after=None):
        before = [list(ops) for ops in lowered]
        draft = run_draft(lowered, placement, num_chunks, after=after)
        if after is not None:
            assert draft.run is after.run  # went on from it
            fresh = run_draft(before, placement, num_chunks)
            assert (draft.lowered, draft.late_payloads, draft.stuck_sends) == (
                fresh.lowered, fresh.late_payloads, fresh.stuck_sends)
            assert (draft.run.order, draft.run.events) == (fresh.run.order, fresh.run.events)
            drafts.append(draft)
        return draft

    monkeypatch.setattr(lowering, "run_draft", checked)
    # interleaved 1F1B at p = 4, m = 10 (rounds of 5 micro-batches): a draft needs three dry-runs
    lowered = lowering._lower(make_schedule("interleaved_1f1b", 4, 10, 2), PLACEMENT["interleaved_1f1b"])
    assert len(drafts) >= 2
    assert lowered == lower(make_schedule("interleaved_1f1b", 4, 10, 2), PLACEMENT["interleaved_1f1b"])
    # a draft of other ops (here another m: sends and receives elsewhere) is run from the start
    other = lower(make_schedule("interleaved_1f1b", 4, 7, 2), PLACEMENT["interleaved_1f1b"])
    draft = run_draft([list(ops) for ops in other], PLACEMENT["interleaved_1f1b"], 2, after=drafts[-1])
    fresh = run_draft(other, PLACEMENT["interleaved_1f1b"], 2)
    assert draft.run is not drafts[-1].run
    assert (draft.lowered, draft.run.order, draft.run.events) == (fresh.lowered, fresh.run.order, fresh.run.events)


@pytest.mark.parametrize("name,p,v,m", CHUNKED + ONE_CHUNK)
def test_every_lowering_runs_both_with_headers_and_with_learned_signatures(name, p, v, m):
    lowered = lowered_of(name, p, v, m)
    for boundary_shapes in ("headers", "learned"):
        order = simulate(lowered, PLACEMENT[name], boundary_shapes=boundary_shapes)
        assert_valid_order(lowered, order)


def test_with_learned_signatures_an_exchange_posts_every_part_in_its_batch_and_awaits_no_header():
    send = LoweredOp(SEND_ACT, 2, 1)
    activation, gradient, other = LoweredOp(RECV_ACT, 1, 1), LoweredOp(RECV_GRAD, 0, 1), LoweredOp(RECV_GRAD, 0, 2)
    for header_first in ((), (activation,)):
        op = exchange(send, activation, gradient, other, header_first=header_first)
        assert postings(op, "learned") == (Posting((), (send, activation, gradient, other)),)
    assert postings(activation, "learned") == postings(activation) == (Posting((), (activation,)),)


def test_a_payload_whose_header_would_hang_runs_in_the_batch_once_its_signature_is_learned():
    # the zbv example above: awaited first, worker 0's header never comes; learned, it needs none
    lowered = every_payload(lowered_of("zbv", 2, 2, 2), after_batch=False)
    with pytest.raises(ScheduleError, match="^deadlock: stage 0 waits on SEND_ACT1->1\\+RECV_ACT0c1<=1"):
        simulate(lowered, PLACEMENT["zbv"])
    assert_valid_order(lowered, simulate(lowered, PLACEMENT["zbv"], boundary_shapes="learned"))


def test_the_dry_run_names_an_unknown_boundary_mode():
    with pytest.raises(ValueError, match=r"^boundary_shapes='static': expected one of learned, headers"):
        simulate(lowered_of("1f1b", 2, 1, 2), boundary_shapes="static")


def test_the_timed_run_with_learned_signatures_awaits_no_header_and_is_no_longer():
    # the interleaved example above: worker 1 awaited activation 1's header until 4.5; learned, its batch posts
    # at once, and no step is longer than with headers
    lowered = lowered_of("interleaved_1f1b", 2, 2, 2)
    times = ({(0, "F"): 2.0, "F": 1.0, "B": 2.0}, 0.5)
    with_headers = simulate_timed(lowered, *times, placement=PLACEMENT["interleaved_1f1b"])
    learned = simulate_timed(lowered, *times, placement=PLACEMENT["interleaved_1f1b"], boundary_shapes="learned")
    assert [(stage, op) for stage, op, _, _ in learned.timeline] == simulate(lowered, boundary_shapes="learned")
    spans = {(stage, repr(op)): (start, end) for stage, op, start, end in learned.timeline}
    assert spans[(1, "SEND_ACT0->0+RECV_ACT1<=0")][0] == 3.5
    assert learned.step_s <= with_headers.step_s
    for name, p, v, m in CHUNKED[:4] + ONE_CHUNK[:3]:
        lowered = lowered_of(name, p, v, m)
        runs = [simulate_timed(lowered, {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}, 0.1, placement=PLACEMENT[name],
                               boundary_shapes=mode) for mode in ("headers", "learned")]
        assert runs[1].step_s <= runs[0].step_s + 1e-9, (name, p, v, m)
