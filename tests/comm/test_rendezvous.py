"""The wait at a group's store before its process group is built
(:func:`raypipe.comm.rendezvous.wait_for_every_rank`): it returns once every rank came, ends at
once when the join is abandoned, and says how many came when ``p2p_timeout_s`` passes."""
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from raypipe.comm.rendezvous import Rendezvous, group_store, wait_for_every_rank
from raypipe.errors import RaypipeError


def test_every_rank_waits_until_the_last_one_comes():
    store, arrived = dist.HashStore(), []

    def rank() -> None:
        wait_for_every_rank(store, 3, 10, abandoned=lambda: False)
        arrived.append(time.monotonic())

    threads = [threading.Thread(target=rank) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    assert not arrived  # two of three came
    last = time.monotonic()
    wait_for_every_rank(store, 3, 10, abandoned=lambda: False)
    for thread in threads:
        thread.join(5)
    assert len(arrived) == 2 and all(0 <= at - last < 0.5 for at in arrived)


def test_an_abandoned_join_ends_at_once_over_a_real_store():
    """Over the rendezvous's TCP store, as a stage worker meets it: rank 0 waits for a rank that
    never comes until the driver's abort (from another thread) abandons the join."""
    rendezvous = Rendezvous("127.0.0.1", timeout_s=30)
    other = group_store(rendezvous.address, rendezvous.port, 1, 3, timeout_s=30)  # rank 1 came; rank 2 never does
    other.add("raypipe/arrived", 1)
    abandon = threading.Event()
    threading.Timer(0.5, abandon.set).start()
    start = time.monotonic()
    with pytest.raises(RaypipeError, match="^joining the group was abandoned with 2 of its 3 ranks arrived"):
        wait_for_every_rank(rendezvous.take_store(), 3, 30, abandoned=abandon.is_set)
    assert time.monotonic() - start < 2


def test_ranks_missing_after_the_timeout_are_counted():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    with pytest.raises(RaypipeError, match=r"^only 1 of the group's 4 ranks arrived at its rendezvous within "
                                           r"p2p_timeout_s=0.3s"):
        wait_for_every_rank(store, 4, 0.3, abandoned=lambda: False)
