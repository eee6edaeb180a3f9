"""petra_ds.diagnostics.allocated: live and peak bytes of every tensor storage, against byte counts worked
out by hand and against the saved-tensor tracker where both see the same tensors."""

import gc

import pytest
import torch

from petra_ds.diagnostics.allocated import AllocatedStorages
from petra_ds.diagnostics.held import HeldTracker

F32, F64 = 4, 8


@pytest.fixture(autouse=True)
def no_collection_inside():
    """Live bytes are counted to the byte: the garbage earlier tests left is collected first, and none is
    collected while a test counts (a cycle freed mid-test once took 336 bytes off a count)."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_live_and_peak_bytes_follow_allocations_and_frees():
    with AllocatedStorages() as counter:
        start = counter.live_bytes
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(2000, dtype=torch.float32)
        assert counter.live_bytes - start == 3000 * F32
        del a
        c = torch.empty(500, dtype=torch.float32)
        view = b[5:]  # a view: no new storage
        b.add_(1.0)  # in place: none either
        assert counter.live_bytes - start == 2500 * F32
        assert counter.peak_bytes - start == 3000 * F32
        del b
        assert counter.live_bytes - start == 2500 * F32  # the view keeps b's storage
        del view, c
        assert counter.live_bytes == start
        assert counter.reset_peak() - start == 3000 * F32 and counter.peak_bytes == start


def test_garbage_left_before_the_count_is_not_alive():
    """A reference cycle holding a tensor, unreachable but not yet collected when the count starts, is not counted:
    a collection during the block would free it and hide the block's own peak below the start."""

    class Cycle:
        pass

    with AllocatedStorages() as clean:
        alive = clean.live_bytes
    cycle = Cycle()
    cycle.itself, cycle.tensor = cycle, torch.empty(1 << 20, dtype=torch.float32)
    del cycle  # unreachable; the fixture holds collections back
    with AllocatedStorages() as counter:
        assert counter.live_bytes == alive


def test_what_lived_before_counts_and_its_release_too():
    kept = torch.zeros(4096, dtype=torch.float32)
    with AllocatedStorages(parts=lambda: {"kept": kept}) as counter:
        assert counter.peak_parts["kept"] == 4096 * F32 and counter.live_bytes >= 4096 * F32
        before = counter.live_bytes
        del kept
        assert before - counter.live_bytes == 4096 * F32


def graph(w: torch.Tensor) -> torch.Tensor:
    """a * w saves a (w is a parameter); tanh saves its output c; c * c saves c; the sum saves nothing."""
    a = torch.randn(5, 7, dtype=torch.float64)
    b = a * w
    c = b.tanh()
    return (c * c).sum()


def test_a_graph_holds_what_the_saved_tensor_tracker_sees_and_its_peak_is_the_forward():
    w = torch.nn.Parameter(torch.randn(5, 7, dtype=torch.float64))
    tracker = HeldTracker(exclude=[w])
    with AllocatedStorages(parts=lambda: {"parameters": [w]}) as counter:
        counter.reset_peak()
        start = counter.live_bytes
        with tracker.recording():
            loss = graph(w)
        saved = tracker.measure({}, exclude=[w])["graph"]
        assert saved == 2 * 35 * F64  # a and c
        assert counter.live_bytes - start == saved + F64  # the graph's saved tensors and the loss
        assert counter.peak_bytes - start == 4 * 35 * F64 + F64  # a, b, c, c * c and the loss at once
        assert counter.peak_parts["parameters"] == 35 * F64
        assert counter.peak_parts["other"] == counter.peak_bytes - 35 * F64
        loss.backward()
        assert tracker.measure({}, exclude=[w])["graph"] == 0
        assert counter.live_bytes - start == 35 * F64 + F64  # w.grad and the loss; the graph is gone


def test_the_host_copies_of_an_offload_count_apart_from_the_device_s_bytes():
    """On a CPU the tracker stands for a device's memory: a FIFO offloaded to host memory keeps its head there and
    every other entry in host copies, which count in ``host_bytes``, not in the live bytes or the peak."""
    from petra_ds.runtime.fifo import InputFifo, StreamCopies

    entry = 1024 * F32
    with AllocatedStorages() as counter:
        start = counter.live_bytes
        fifo = InputFifo(StreamCopies())
        for m in range(3):
            fifo.append(m, torch.full((1024,), float(m)))  # each made here, and dropped unless it is the head
        assert counter.live_bytes - start == entry and counter.host_bytes == 2 * entry
        assert counter.peak_bytes - start == 2 * entry  # the head and a new entry, before its host copy let it go
        assert torch.equal(fifo.pop(0), torch.zeros(1024))  # the next head comes back to the device
        assert counter.live_bytes - start == entry and counter.host_bytes == entry
        fifo.pop(1), fifo.pop(2)
        assert counter.live_bytes == start and counter.host_bytes == 0 and counter.peak_host_bytes == 2 * entry
