"""The activation store's accounting and the offloaded inputs it fetches ahead (no Ray:
an offloader that records what it is asked)."""
import torch

from raypipe.stage.activations import ActivationStore
from raypipe.stage.offload import OffloadedTensor


class RecordingOffloader:
    def __init__(self):
        self.prefetched, self.fetched = [], []

    def put(self, tensor):
        return OffloadedTensor(tensor.numel() * tensor.element_size(), ref=tensor)

    def prefetch(self, key, offloaded):
        self.prefetched.append(key)

    def get(self, key, offloaded):
        self.fetched.append(key)
        return offloaded.ref


def test_taking_a_micro_batch_fetches_the_next_backwards_offloaded_input_ahead():
    offloader = RecordingOffloader()
    store = ActivationStore(offloader)
    store.backward_order = [0, 2, 1]
    for micro_batch in range(3):
        store.keep_input(micro_batch, torch.zeros(4), 16)
    for micro_batch in store.backward_order:
        store.release(store.take(micro_batch))
    assert offloader.fetched == [0, 2, 1]
    assert offloader.prefetched == [2, 1]  # after the last backward there is nothing to fetch ahead
    assert store.held_bytes == store.offloaded_bytes == 0


def test_a_retained_rebuilt_graph_is_held_until_its_release():
    store = ActivationStore(None)
    store.keep_input(0, torch.zeros(4), 16)
    kept = store.take(0)
    kept.rebuilt_bytes = 100  # I recomputed the graph and keeps it for W
    store.retain_rebuilt(kept)
    assert store.held_bytes == 116 and store.peak_held_bytes == 116
    store.release(kept)
    assert store.held_bytes == 0
