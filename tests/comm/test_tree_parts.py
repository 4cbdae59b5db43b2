"""A tree's parts (raypipe.comm.tree_messages): each tensor leaf of ``ALONE_BYTES`` or more crosses
a stage boundary as a message part of its own, sent as it is (no copy) and received into the
buffer its receive was posted with; the small leaves share one packed part; the gradient goes
back as the floating-point leaves' parts only. Over gloo between real processes and under NCCL's
emulation, with ``boundary_shapes="headers"`` (a shape that changes: stale predictions consumed
part by part) and ``"learned"`` (no header from the second step), every leaf arrives bitwise as
sent, and the counters say how many messages and bytes went. The ranks are forked processes
reused from test to test (tests/comm/shared_ranks.py)."""
from __future__ import annotations

import pytest
import torch

from raypipe.comm import tree_messages
from raypipe.comm.boundary_signatures import HEADERS, LEARNED
from raypipe.comm.p2p import P2PChannel
from raypipe.core import ops
from raypipe.core.topology import Topology
from tests.comm.shared_ranks import shared_ranks
from tests.comm.test_p2p import key, waited
from tests.ports import free_port

CPU = torch.device("cpu")
STEPS, MICRO_BATCHES = 3, 3
WIDTH = 16384  # hidden[2, 5, 16384] float32: 640 KiB, above ALONE_BYTES


@pytest.fixture(scope="module")
def ranks():
    """Forked ranks (tests/comm/shared_ranks.py's, shared with the other modules that use them)."""
    return shared_ranks()


def large_tree(step: int, micro_batch: int, changes: bool) -> dict:
    """A boundary of three large leaves (float hidden states, int64 ids, and a transposed, not
    contiguous, float view) beside small ones (positions, a mask, a bf16 column), a None and a
    constant; ``changes``: micro-batch 1 is one longer at step 1."""
    length = 5 + (changes and micro_batch == 1 and step == 1)
    hidden = torch.arange(2 * length * WIDTH, dtype=torch.float32).reshape(2, length, WIDTH) + 100 * step + micro_batch
    positions = torch.arange(length, dtype=torch.int64).repeat(2, 1) + micro_batch
    return {"hidden": hidden, "ids": torch.arange(2 * length * WIDTH // 2, dtype=torch.int64) - step,
            "transposed": (hidden * 0.5).transpose(1, 2), "extras": (positions, {"mask": positions % 2 == 0}),
            "aux": None, "scale": 0.5, "bf16": hidden[:, :, 0].to(torch.bfloat16)}


def large_gradient(sent: dict) -> dict:
    """The gradient sent back for ``sent`` (a leaf of no floating point has none)."""
    return {"hidden": -sent["hidden"], "ids": None, "transposed": 3 * sent["transposed"],
            "extras": (None, {"mask": None}), "aux": None, "scale": None, "bf16": 2 * sent["bf16"]}


def packed_bytes(length: int) -> int:
    """The packed part of ``large_tree`` at ``length``: positions, the mask and the bf16 column, each
    at an offset aligned to 16 bytes."""
    return sum(-(-2 * length * itemsize // 16) * 16 for itemsize in (8, 1, 2))


def tree_bytes(length: int) -> int:
    """The bytes ``large_tree`` at ``length`` sends: its three large leaves (4 bytes an element each,
    the int64 ids half as many elements) and its packed part."""
    return 3 * 2 * length * WIDTH * 4 + packed_bytes(length)


def assert_bitwise(got, want) -> None:
    got_leaves, want_leaves = (torch.utils._pytree.tree_flatten(tree) for tree in (got, want))
    assert got_leaves[1] == want_leaves[1]
    for got_leaf, want_leaf in zip(got_leaves[0], want_leaves[0], strict=True):
        if isinstance(want_leaf, torch.Tensor):
            assert got_leaf.dtype == want_leaf.dtype and torch.equal(got_leaf, want_leaf)
        else:
            assert got_leaf == want_leaf


def run_tree_parts_stage(rank: int, port: int, mode: str, emulate_nccl: bool) -> list[tuple]:
    """Stage ``rank`` of two, three steps of MICRO_BATCHES trees and their gradients (the last
    micro-batch's tree received in an exchange that awaits its header first); per step and
    micro-batch what this rank started, sent and received in place."""
    channel = P2PChannel(Topology(num_stages=2), 0, rank, CPU, boundary_shapes=mode)
    channel.join("127.0.0.1", port, timeout_s=60, emulate_nccl=emulate_nccl)
    changes, seen = mode == HEADERS, []
    try:
        for step in range(STEPS):
            for micro_batch in range(MICRO_BATCHES) if rank == 0 else ():
                started, sent = channel.data_operations_started, channel.sent_bytes
                channel.send_activation(large_tree(step, micro_batch, changes), key(micro_batch), 1)
                seen.append((step, micro_batch, channel.data_operations_started - started, channel.sent_bytes - sent))
            for micro_batch in reversed(range(MICRO_BATCHES)) if rank == 0 else ():
                sent = large_tree(step, micro_batch, changes)
                assert_bitwise(channel.recv_gradient(key(micro_batch), 1),
                               large_gradient(sent))
            if rank == 1:
                channel.expect_activations([(key(micro_batch), 0) for micro_batch in range(MICRO_BATCHES)])
                posted = {message: parts for message, (_, parts) in channel._messages.payloads.items()}
                for micro_batch in range(MICRO_BATCHES):
                    if micro_batch < MICRO_BATCHES - 1:
                        received = channel.recv_activation(key(micro_batch), 0)
                    else:
                        receive = ops.LoweredOp(ops.RECV_ACT, micro_batch, 0)
                        received = waited(channel.exchange([], [receive], lambda op: key(op.micro_batch), [receive])[0])
                    assert_bitwise(received, large_tree(step, micro_batch, changes))
                    in_place = [received[leaf] is part for leaf, part in
                                zip(("hidden", "ids", "transposed"), posted.get(key(micro_batch), ()))]
                    seen.append((step, micro_batch, len(in_place) == 3 and all(in_place)))
                for micro_batch in reversed(range(MICRO_BATCHES)):
                    started, sent = channel.data_operations_started, channel.sent_bytes
                    gradient = large_gradient(large_tree(step, micro_batch, changes))
                    channel.send_gradient(gradient, key(micro_batch), 0)
                    seen.append((step, micro_batch, channel.data_operations_started - started,
                                 channel.sent_bytes - sent))
            channel.finish_sends()
    finally:
        channel.leave()
    return seen


MODES = [(HEADERS, False), (LEARNED, False), (HEADERS, True), (LEARNED, True)]


@pytest.mark.parametrize("mode,emulate_nccl", MODES,
                         ids=["headers-gloo", "learned-gloo", "headers-nccl-emulation", "learned-nccl-emulation"])
def test_a_tree_crosses_as_its_large_leaves_and_one_packed_part(ranks, mode, emulate_nccl):
    sender, receiver = ranks.run(run_tree_parts_stage, free_port(), mode, emulate_nccl, nprocs=2)
    structure = tree_messages.structure_of(large_tree(0, 0, False), 0, CPU)
    assert structure.nbytes == packed_bytes(5) and sum(leaf.alone for leaf in structure.leaves) == 3
    for step, micro_batch, started, sent in sender:
        length = 6 if mode == HEADERS and step == 1 and micro_batch == 1 else 5
        # gloo's receives posted on a stale prediction (micro-batch 1's at steps 1 and 2) are consumed by
        # fillers of the predicted parts: its length at the step before
        stale = mode == HEADERS and not emulate_nccl and step in (1, 2) and micro_batch == 1
        assert started == 4 * (1 + stale), (step, micro_batch)  # three large leaves and the packed part
        assert sent == tree_bytes(length) + stale * tree_bytes(11 - length), (step, micro_batch)
    gradients = [entry for entry in receiver if len(entry) == 4]
    assert len(gradients) == STEPS * MICRO_BATCHES
    for step, micro_batch, started, sent in gradients:
        length = 6 if mode == HEADERS and step == 1 and micro_batch == 1 else 5
        # the floating-point leaves only: hidden and transposed, and the bf16 column, alone too (a packed part
        # of one leaf would be a copy for nothing)
        assert started == 3 and sent == 2 * (2 * length * WIDTH * 4) + 2 * length * 2
    landed = {(step, micro_batch) for step, micro_batch, *rest in receiver if len(rest) == 1 and rest[0]}
    if emulate_nccl:  # nothing posted ahead: every payload received when reached
        assert landed == set()
    elif mode == LEARNED:  # posted ahead on the learned signature from step 1, for every micro-batch
        assert landed == {(step, micro_batch) for step in (1, 2) for micro_batch in range(MICRO_BATCHES)}
    else:  # posted ahead on the prediction: stale for micro-batch 1 at steps 1 and 2
        assert landed == {(1, 0), (1, 2), (2, 0), (2, 2)}


def test_the_parts_deliver_bitwise_what_one_packed_payload_does(monkeypatch):
    """In one process: a tree's large leaves are their parts (the sender's leaf itself, the receiver's
    the part itself), and every leaf is bitwise what the tree would be packed whole."""
    tree = large_tree(0, 1, False)
    parts, structure = tree_messages.outgoing(tree, 0, CPU)
    assert len(parts) == 4 and parts[0].data_ptr() == tree["hidden"].data_ptr()
    assert parts[1].data_ptr() == tree["ids"].data_ptr()  # contiguous leaves: no copy
    received = tree_messages.tree_of(tuple(part.clone() for part in parts), structure, CPU)
    monkeypatch.setattr(tree_messages, "ALONE_BYTES", 1 << 40)  # the whole tree packed, as before
    packed, whole = tree_messages.outgoing(tree, 0, CPU)
    assert len(packed) == 1 and whole.nbytes > 3 * 2 * 5 * WIDTH * 4
    assert_bitwise(received, tree_messages.tree_of(packed, whole, CPU))
    assert_bitwise(received, tree)
    monkeypatch.undo()
    lone = {"hidden": torch.ones(2, 3), "scale": 0.5}  # small, but a packed part of one leaf would be a copy of it
    parts, structure = tree_messages.outgoing(lone, 0, CPU)
    assert len(parts) == 1 and parts[0].data_ptr() == lone["hidden"].data_ptr() and structure.nbytes == 0


def test_a_tree_without_floating_point_leaves_sends_no_gradient_part():
    tree = {"positions": torch.arange(6).reshape(2, 3), "mask": torch.ones(2, 3, dtype=torch.bool), "empty":
            torch.zeros(0, 4, dtype=torch.float32)}
    structure = tree_messages.structure_of(tree, 0, CPU)
    gradient = tree_messages.gradient_structure(structure)
    assert tree_messages.part_signatures(gradient) == () and tree_messages.gradient_parts(None, structure, CPU) == ()
    back = tree_messages.tree_of((), gradient, CPU)
    assert back["positions"] is None and back["mask"] is None and back["empty"].shape == (0, 4)


def test_a_gradient_of_another_shape_than_its_leaf_is_refused_by_path():
    """Each part's receive is posted on its leaf's shape: a gradient that would not fit fails where it is sent."""
    structure = tree_messages.structure_of({"hidden": torch.zeros(2, 8, 4), "positions": torch.zeros(2, 8)}, 0, CPU)
    with pytest.raises(ValueError, match=r"^the gradient at \['hidden'\] has shape \(2, 8\), but the input there "
                                         r"has shape \(2, 8, 4\)"):
        tree_messages.gradient_parts({"hidden": torch.zeros(2, 8)}, structure, CPU)
