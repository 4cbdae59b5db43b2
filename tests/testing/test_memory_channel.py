"""The in-memory channel the harness runs the step runner over: messages in issue order per
pair of workers, collectives combined in rank order, and a wait that can never end named
instead of hanging."""
import threading

import torch

from raypipe.core.topology import Topology
from raypipe.errors import StepAborted
from raypipe.testing.memory_channel import MemoryChannel, MemoryGroup


def run_workers(group: MemoryGroup, bodies: list) -> list:
    """Each body in a thread of its own, taking turns in ``group``; what each returned or raised."""
    outcomes = [None] * len(bodies)

    def run(index: int) -> None:
        with group.turn():
            try:
                outcomes[index] = bodies[index]()
            except BaseException as error:  # noqa: BLE001 - the test reads it
                outcomes[index] = error

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a worker hung"
    return outcomes


def test_messages_arrive_in_order_and_the_sums_run_in_rank_order():
    group = MemoryGroup(Topology(2, 2))  # 2 stages, 2 replicas
    channels = [MemoryChannel(group, replica, stage, 2) for replica in range(2) for stage in range(2)]
    gradients = [[torch.full((2,), float(rank + 1))] for rank in range(4)]

    def stage_0(channel: MemoryChannel, rank: int):
        channel.send_activation(torch.tensor(1.0 + rank), 2, 1)
        channel.send_activation(torch.tensor(2.0 + rank), 4, 1)
        pending = channel.replicas.start_gradient_reduction(gradients[rank])
        channel.replicas.finish_gradient_reduction(pending)
        return channel.all_reduce_sum([rank, 0.5])

    def stage_1(channel: MemoryChannel, rank: int):
        first, second = channel.recv_activation(2, 0), channel.recv_activation(4, 0)
        pending = channel.replicas.start_gradient_reduction(gradients[rank], (1,))  # ZeRO-1: replica 1 owns it
        channel.replicas.finish_gradient_reduction(pending)
        return float(first), float(second), channel.all_reduce_sum([rank, 0.5])

    outcomes = run_workers(group, [lambda c=channel, r=rank: (stage_0 if r % 2 == 0 else stage_1)(c, r)
                                   for rank, channel in enumerate(channels)])
    assert outcomes[0] == outcomes[2] == [6.0, 2.0]
    assert outcomes[1] == (1.0, 2.0, [6.0, 2.0]) and outcomes[3] == (3.0, 4.0, [6.0, 2.0])
    assert gradients[0][0].tolist() == gradients[2][0].tolist() == [4.0, 4.0]  # 1 + 3 onto both replicas
    assert gradients[1][0].tolist() == [2.0, 2.0] and gradients[3][0].tolist() == [6.0, 6.0]  # onto the owner only


def test_a_worker_left_waiting_for_a_message_that_never_comes_is_named():
    group = MemoryGroup(Topology(2, 1))
    channels = [MemoryChannel(group, 0, stage, 2) for stage in range(2)]
    outcomes = run_workers(group, [lambda: channels[0].recv_gradient(2, 1), lambda: None])
    assert isinstance(outcomes[0], StepAborted) and outcomes[1] is None
    assert group.stuck == ("the lowered schedule is stuck: no worker can go on (stage 0 at RECV_GRAD of "
                           "micro-batch 1 (message key 2) from stage 1)")


def test_a_worker_that_leaves_releases_the_others():
    group = MemoryGroup(Topology(3, 1))
    channels = [MemoryChannel(group, 0, stage, 3) for stage in range(3)]

    def fails():
        channels[2].leave()
        raise ValueError("failed")

    outcomes = run_workers(group, [lambda: channels[0].recv_gradient(1, 1), lambda: channels[1].all_reduce_sum([1.0]),
                                   fails])
    assert [type(outcome) for outcome in outcomes] == [StepAborted, StepAborted, ValueError]
    assert group.stuck is None
    assert str(outcomes[0]) == ("stage 0, op step: released at RECV_GRAD of micro-batch 0 (message key 1) "
                                "from stage 1: stage 2 failed")
