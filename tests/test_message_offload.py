"""``"petra": {"message_offload": "cpu"}``: a message between two stages of one rank waits in host memory from its
send until the compute instruction before its reader (``petra_ds/runtime/transport.py``: ``Inbox``).

The inbox's copies are checked with the fake copy stream of the FIFO tests (a read before its copy ran raises);
training with the offload equals training without it bit for bit, all stages in one process and on two ranks, and
resumes from a checkpoint bit for bit; the memory report moves exactly the parked messages' bytes from the device
to the host."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import torch

from petra_ds.runtime.config import PetraConfig, PetraConfigError
from petra_ds.runtime.fifo import Entry, StreamCopies
from petra_ds.runtime.transport import Inbox
from petra_ds.schedule import DelayedBackward, ForwardPass, PostP2P
from petra_ds.schedule.channels import Key

from harness import assert_same_bits, launch, merged_params
from test_fifo_offload import FakeCopies, pair

SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}


def test_the_config_names_the_allowed_values():
    assert PetraConfig().message_offload == "none"
    assert PetraConfig.from_dict({"message_offload": "cpu"}).message_offload == "cpu"
    with pytest.raises(PetraConfigError, match=r"\"petra.message_offload\" must be one of \('none', 'cpu'\).*'gpu'"):
        PetraConfig.from_dict({"message_offload": "gpu"})


# --- the inbox, driven by a fake copy stream ---

def test_a_parked_message_comes_back_as_the_same_views_before_its_reader_and_not_twice():
    torch.set_default_dtype(torch.float64)
    log: list = []
    inbox = Inbox(FakeCopies(log))
    sent = (pair(1, 0), torch.arange(4))  # an activation pair (two views of one storage) and its labels
    key, other = Key(2, "act", 1), Key(1, "grad", 0)
    inbox[key] = inbox.park(key, sent)
    inbox[other] = inbox.park(other, (pair(0, 1),))
    assert log == [("offload", 0), ("offload", 1)] and not list(inbox.on_device())
    assert [k for k, _ in inbox.on_host()] == [key, other]
    cmds = [ForwardPass(1, 2, consumes=Key(1, "act", 2)), PostP2P(batch="act"), ForwardPass(2, 1, consumes=key),
            DelayedBackward(1, 0, consumes=other)]
    inbox.prefetch_next(cmds, 0)  # before cmds[0] runs: the message of the next reader, cmds[2], starts back
    inbox.prefetch_next(cmds, 1)  # already on its way: no second copy
    assert log[2:] == [("prefetch", 2)] and [k for k, _ in inbox.on_device()] == [key]
    inbox.copies.run()
    (x1, x2), labels = inbox.pop(key)
    assert log[-1] == ("wait", 2)
    (want1, want2), want_labels = sent
    assert torch.equal(x1, want1) and torch.equal(x2, want2) and torch.equal(labels, want_labels)
    assert x1.untyped_storage().data_ptr() == x2.untyped_storage().data_ptr()  # one copy, the same two views
    assert (x1.storage_offset(), x2.storage_offset()) == (want1.storage_offset(), want2.storage_offset())
    inbox.prefetch_next(cmds, 2)
    assert log[-1] == ("prefetch", 3)
    with pytest.raises(RuntimeError, match=r"read before its prefetch completed \(copy 3\)"):
        inbox.pop(other)  # the read waits for its copy back on the compute stream


def test_each_clock_prefetches_its_own_next_reader():
    """The next reader is found per clock: a clock asked after another is not read with the first one's readers."""
    log: list = []
    inbox = Inbox(FakeCopies(log))
    first, second = Key(1, "act", 0), Key(2, "act", 0)
    for key in (first, second):
        inbox[key] = inbox.park(key, (torch.zeros(2),))
    clock_a = [PostP2P(batch="act"), ForwardPass(0, 1, consumes=first)]
    clock_b = [PostP2P(batch="act"), ForwardPass(0, 2, consumes=second)]
    inbox.prefetch_next(clock_a, 0)
    inbox.prefetch_next(clock_b, 0)
    assert [k for k, _ in inbox.on_device()] == [first, second] and log[2:] == [("prefetch", 2), ("prefetch", 3)]
    inbox.prefetch_next(clock_b, 1)  # the clock's last instruction: no reader after it
    assert log[4:] == []


def test_a_message_of_tensors_with_storages_of_their_own_moves_as_them():
    """Each tensor alone in its storage, whole and contiguous (most messages): one allocation a tensor and one copy
    for the whole message, no byte view per storage or rebuilt view per tensor; the same values and layouts back,
    in copies of their own. A message in an autograd graph is copied out of it."""
    from petra_ds.diagnostics.host_cost import OpCounter

    torch.set_default_dtype(torch.float64)
    inbox = Inbox(StreamCopies())
    sent = ((torch.randn(3, 4), torch.randn(3, 4)), torch.arange(3))
    with OpCounter() as out:
        inbox[Key(1, "act", 0)] = inbox.park(Key(1, "act", 0), sent)
    assert dict(out.by_name) == {"empty": 3, "_foreach_copy_": 1}
    with OpCounter() as back:
        (a, b), labels = inbox.pop(Key(1, "act", 0))
    assert dict(back.by_name) == {"empty": 3, "_foreach_copy_": 1}
    for got, want in ((a, sent[0][0]), (b, sent[0][1]), (labels, sent[1])):
        assert torch.equal(got, want) and got.stride() == want.stride() and got.dtype == want.dtype
        assert got.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()
    mixed = (pair(0, 0), torch.arange(4))  # two views of one storage go by their storage, the labels as themselves
    with OpCounter() as out:
        inbox[Key(1, "act", 1)] = inbox.park(Key(1, "act", 1), mixed)
    assert dict(out.by_name) == {"empty": 5, "set_": 3, "_foreach_copy_": 1}
    (a, b), labels = inbox.pop(Key(1, "act", 1))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and torch.equal(labels, mixed[1])
    in_graph = (torch.randn(3, 4, requires_grad=True) * 2, torch.randn(3, 4))
    inbox[Key(1, "grad", 0)] = parked = inbox.park(Key(1, "grad", 0), in_graph)
    assert not any(t.requires_grad for t in parked.host)
    assert all(torch.equal(got, want) and not got.requires_grad
               for got, want in zip(inbox.pop(Key(1, "grad", 0)), in_graph))


def test_a_message_read_without_a_prefetch_is_fetched_by_its_read():
    torch.set_default_dtype(torch.float64)
    inbox = Inbox(StreamCopies())  # on CPU: plain copies, nothing to wait for
    sent = (pair(3, 0),)
    inbox[Key(1, "act", 3)] = parked = inbox.park(Key(1, "act", 3), sent)
    assert inbox[Key(1, "act", 3)] is parked.host  # indexing gives the host copy (what a checkpoint saves)
    ((a, b),) = inbox.pop(Key(1, "act", 3))
    assert torch.equal(a, sent[0][0]) and torch.equal(b, sent[0][1]) and a.data_ptr() != sent[0][0].data_ptr()


def test_only_what_an_instruction_of_this_rank_reads_is_parked():
    inbox, fields = Inbox(StreamCopies()), (pair(0, 0),)
    assert isinstance(inbox.park(Key(1, "grad", 0), fields), Entry)
    assert isinstance(inbox.park(Key(1, "eval", 0), fields), Entry)
    assert inbox.park(Key(1, "act", 0), fields, receiver_here=False) is fields  # another rank's: its exchange's
    assert inbox.park(Key(1, "tied_weight", 0), fields) is fields  # applied as the commit receives it
    assert inbox.park(Key(0, "data", 0), fields) is fields  # read in the clock that loads it


def test_the_watch_is_flushed_before_each_message_that_leaves_the_device_and_only_then():
    """``before_park`` (the NaN watch's flush) runs once before each parked message's copy out, never for a message
    that stays, nor without the offload."""
    log: list = []

    def flush() -> None:
        log.append("flush")

    inbox, fields = Inbox(FakeCopies(log), flush), (pair(0, 0),)
    inbox.park(Key(1, "act", 0), fields)
    inbox.park(Key(1, "act", 1), fields, receiver_here=False)
    inbox.park(Key(1, "tied_weight", 0), fields)
    inbox.park(Key(1, "grad", 0), fields)
    assert log == ["flush", ("offload", 0), "flush", ("offload", 1)]  # each before its own copy out
    Inbox(None, flush).park(Key(1, "act", 2), fields)
    assert log.count("flush") == 2


def test_without_the_offload_nothing_is_parked_or_copied():
    inbox = Inbox()
    fields = (pair(0, 0),)
    assert inbox.park(Key(1, "act", 0), fields) is fields
    inbox[Key(1, "act", 0)] = fields
    assert inbox.pop(Key(1, "act", 0)) is fields


# --- training, with and without the offload ---

@functools.lru_cache(maxsize=None)
def _run(spec_json: str) -> list[dict]:
    return launch(json.loads(spec_json))


def run(**spec: Any) -> list[dict]:
    return _run(json.dumps(spec, sort_keys=True))


def assert_same_training(spec: dict) -> tuple[list[dict], list[dict]]:
    """The run with ``message_offload: "cpu"`` against the run without: parameters, every step's gradients and
    the losses bit for bit. Returns (plain, offloaded) results, both with a memory report per clock."""
    petra = spec.get("petra", {})
    plain = run(**{**spec, "memory_trace": True})
    parked = run(**{**spec, "memory_trace": True, "petra": {**petra, "message_offload": "cpu"}})
    assert_same_bits(parked, plain)
    return plain, parked


def held_messages(results: list[dict]) -> dict[tuple[int, int], tuple[int, int]]:
    """(clock, stage) -> (message bytes on the device, on the host) at each clock's end, over the ranks."""
    return {(clock, j): (entry["messages"], entry["messages_host"])
            for r in results for clock, report in r["memory"] for j, entry in report.items()}


TOY = {"k": 2, "train_batches": 4, "optimizer": SGD, "dropout": 0.1}


def test_all_stages_in_one_process_train_the_same_bits_and_hold_no_message_on_the_device():
    """J = 4 in one process: every message is between stages of the rank, so between clocks each stage's
    messages are all in host memory, exactly the bytes the run without the offload holds on the device; an
    evaluation afterwards (its own schedule, its messages parked too) gives the same losses."""
    plain, parked = assert_same_training({**TOY, "pipe": 1, "stages_per_rank": 4, "eval_batches": 2,
                                          "probe": "test_fifo_offload:settings_probe"})
    assert [r["evals"] for r in parked] == [r["evals"] for r in plain] and len(plain[0]["evals"]) == 2
    before, after = held_messages(plain), held_messages(parked)
    assert before.keys() == after.keys()
    for at, (device, host) in after.items():
        assert device == 0 and host == before[at][0] and before[at][1] == 0, at
    assert max(host for _, host in after.values()) > 0
    said = "messages between stages of one rank: wait in host memory (message_offload)"
    assert said in parked[0]["probe"] and said not in plain[0]["probe"]


def test_two_ranks_park_only_the_messages_between_their_own_stages():
    """J = 4 on two ranks, two stages each: stage 0 -> 1 and 2 -> 3 (and back) stay on one rank and are parked;
    1 -> 2 and 2 -> 1 cross ranks and stay in their receive buffers. Same bits; the bytes move, none appear."""
    plain, parked = assert_same_training({**TOY, "pipe": 2, "stages_per_rank": 2})
    before, after = held_messages(plain), held_messages(parked)
    assert before.keys() == after.keys()
    for at, (device, host) in after.items():
        assert device + host == before[at][0], at
    assert max(host for _, host in after.values()) > 0 and max(device for device, _ in after.values()) > 0


@pytest.mark.parametrize("resume_with", ["cpu", "none"])
def test_a_run_resumes_bit_for_bit_from_a_checkpoint_saved_with_parked_messages(tmp_path, resume_with):
    """Saved between windows (messages in host memory: the file holds their host copies), loaded by new engines
    with the offload or without it (it does not change training, so a checkpoint resumes under either): the
    uninterrupted run's parameters."""
    common = {**TOY, "pipe": 1, "stages_per_rank": 4, "train_batches": 5, "petra": {"message_offload": "cpu"}}
    whole = merged_params(run(**{**common, "petra": {}}))
    ckpt = str(tmp_path / "ckpt")
    first = launch({**common, "save_dir": ckpt, "save_after": 2, "save_tag": "c4"})
    assert max((merged_params(first)[n] - whole[n]).abs().max().item() for n in whole) == 0.0
    resumed = launch({**common, "petra": {"message_offload": resume_with}, "load_dir": ckpt})
    assert resumed[0]["clock"] == first[0]["clock"]
    got = merged_params(resumed)
    assert max((got[n] - whole[n]).abs().max().item() for n in whole) == 0.0


REVNET = {"model": "revnet", "k": 4, "train_batches": 3, "micro_batch": 2, "optimizer": SGD, "dropout": 0.0}


def test_revnet18_with_every_stage_in_one_process_trains_the_same_bits():
    """RevNet18 at J = 10 in one process, the paper's single-GPU setting, with its FIFOs offloaded too."""
    plain, parked = assert_same_training({**REVNET, "pipe": 1, "stages_per_rank": 10,
                                          "petra": {"fifo_offload": "cpu"}})
    assert all(device == 0 for device, _ in held_messages(parked).values())


def test_revgpt_with_tied_embeddings_in_one_process_trains_the_same_bits():
    """Tied embedding and head: the owner's new weights and the reader's gradient of them travel as messages too,
    between stages of the one process; the tied weights a commit applies are never parked."""
    plain, parked = assert_same_training({"model": "revgpt", "tie_embeddings": True, "k": 2, "micro_batch": 2,
                                          "dropout": 0.1, "train_batches": 3, "optimizer": SGD, "pipe": 1,
                                          "stages_per_rank": 4})
    assert max(host for _, host in held_messages(parked).values()) > 0


@pytest.mark.parametrize("extra", [
    pytest.param({"petra": {"reconstruct_overlap": True, "fifo_offload": "cpu"}}, id="overlap-and-fifo-offload"),
    pytest.param({"dp": 2, "petra": {"delay_compensation": "weight_prediction"}}, id="two-replicas-prediction"),
])
def test_it_composes_with_the_other_settings_of_a_stage(extra):
    """With the FIFOs offloaded too and the reconstruction overlapped, and on two data-parallel replicas with
    weight prediction: the same bits, and no message left on the device between clocks."""
    plain, parked = assert_same_training({**TOY, "pipe": 1, "stages_per_rank": 4, **extra})
    assert all(device == 0 for device, _ in held_messages(parked).values())


def test_the_nan_watch_keeps_no_parked_message_on_the_device(world_of_one):
    """With the offload the NaN / Inf watch reduces what it holds before a message leaves the device (the inbox
    flushes it at each park): a reference kept to the clock's end would keep every message of the clock on the
    device after its send. RevNet18 in one process, both offloads: the
    device's peak within a steady-state train_batch (the allocator tracker, host copies apart) with the watch on is
    that with it off, give or take one message (on a CPU the watch's foreach absolute value copies the report it
    reduces). Holding the references to the clock's end measured 8.2 MB here against 1.0 MB."""
    from benchmarks.lib import host_overhead
    from petra_ds.diagnostics.allocated import AllocatedStorages

    args = host_overhead.parse_args(["--revnet-width", "16", "--revnet-image", "16", "--revnet-batch", "16"])
    m = host_overhead.model("revnet18", args)
    largest = 16 * 16 * 16 * 16 * 4  # the stem's output, the largest message

    def peak(check_finite: bool) -> int:
        torch.manual_seed(0)
        engine = host_overhead.petra_engine(m, args.k, petra={"fifo_offload": "cpu", "message_offload": "cpu",
                                                              "check_finite": check_finite})
        data = host_overhead.data(m)
        for _ in range(host_overhead.fill_calls(m["J"], args.k)):
            engine.train_batch(data)
        with AllocatedStorages() as tracker:
            before = tracker.live_bytes
            engine.train_batch(data)
            return tracker.peak_bytes - before

    watched, unwatched = peak(True), peak(False)
    assert unwatched > 0 and watched <= unwatched + 2 * largest, (watched, unwatched)
