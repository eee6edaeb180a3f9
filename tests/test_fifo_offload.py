"""``"petra": {"fifo_offload": "cpu"}``: a non-reversible stage's FIFO entries wait in host memory between the
clock that stores them and the clock before their backward reads them (``petra_ds/runtime/fifo.py``).

The order of copies is checked with a fake copy stream whose copies run only when the test says so (a read
before its prefetch ran raises), over the clocks of a real J = 4 schedule; training with the offload equals
training without it bit for bit (toy model, RevNet18, RevGPT), resumes from a checkpoint bit for bit, and the
memory report splits the FIFO into its device and host bytes."""

from __future__ import annotations

import functools
import itertools
import json
from collections import deque
from typing import Any

import pytest
import torch

from petra_ds.runtime.config import PetraConfig, PetraConfigError
from petra_ds.runtime.fifo import InputFifo, StreamCopies
from petra_ds.runtime.ledger import tensor_bytes
from petra_ds.runtime.stage import Stage, StageOptions
from petra_ds.schedule import DelayedBackward, ForwardPass, PetraSchedule, Timeline, delay
from petra_ds.tools.toy import Mix

from harness import assert_same_bits, launch, merged_grads, merged_params

SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}


# --- a copy stream the test drives ---

class FakeEvent:
    """Marks one queued copy; ``done`` once the stream ran it."""

    def __init__(self, kind: str, number: int) -> None:
        self.kind, self.number, self.done = kind, number, False


class FakeCopies:
    """The ``Copies`` of a stream that runs its copies only at :meth:`run`, in the order queued. Until then a copy's
    destination holds 0xFF bytes (NaN in float64), as unwritten memory would; a read waiting on an event that has
    not passed raises, where a GPU would have waited. Everything is logged with the test's own marks."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.queue: deque = deque()
        self.numbers = itertools.count()
        #: the copy out that wrote each host buffer, by its memory's address
        self.written_by: dict[int, FakeEvent] = {}

    def _queue(self, kind: str, buffers: list[torch.Tensor], device: Any) -> tuple[list[torch.Tensor], FakeEvent]:
        out = [torch.full(b.shape, 0xFF, dtype=b.dtype, device=device) for b in buffers]
        event = FakeEvent(kind, next(self.numbers))
        self.queue.append((out, buffers, event))
        self.log.append((kind, event.number))
        return out, event

    def to_host(self, buffers: list[torch.Tensor]) -> tuple[list[torch.Tensor], FakeEvent]:
        out, event = self._queue("offload", buffers, "cpu")
        self.written_by.update((o.data_ptr(), event) for o in out)
        return out, event

    def to_device(self, buffers: list[torch.Tensor], device: torch.device,
                  after: FakeEvent | None = None) -> tuple[list[torch.Tensor], FakeEvent]:
        """A copy back must be told the copy out that wrote its source: on a GPU the two run on different
        streams, and only that event orders them."""
        for b in buffers:
            if self.written_by.get(b.data_ptr()) not in (None, after):
                raise RuntimeError(f"a prefetch does not wait for the offload (copy "
                                   f"{self.written_by[b.data_ptr()].number}) that wrote its source")
        return self._queue("prefetch", buffers, device)

    def run(self) -> None:
        """The stream catches up: every queued copy runs, in order."""
        while self.queue:
            out, source, event = self.queue.popleft()
            for o, s in zip(out, source):
                o.copy_(s)
            event.done = True
            self.log.append(("done", event.number))

    def wait(self, event: FakeEvent) -> None:
        if not event.done:
            raise RuntimeError(f"an entry was read before its {event.kind} completed (copy {event.number})")
        self.log.append(("wait", event.number))

    def finish(self, event: FakeEvent) -> None:
        self.run()


def schedule_clocks(J: int, k: int, windows: int):
    """(clock, instructions) of one rank hosting all J stages: ``windows`` train_batch windows, then the drain."""
    timeline = Timeline(J)
    for i in range(windows + 1):
        window = timeline.train_window(k) if i < windows else timeline.drain_window()
        schedule = PetraSchedule.for_window(window, 1, 0, stages_per_rank=J, gradient_accumulation_steps=k,
                                            reversible=[False] * J)
        yield from enumerate(schedule, start=window.start_clock)
        timeline.advance(window)


def mix_stage(j: int, J: int) -> Stage:
    """Stage j of J: one non-reversible toy layer, so it keeps its inputs in a FIFO."""
    torch.manual_seed(5)
    return Stage(j, J, [Mix(dropout=0.2)], StageOptions(gradient_accumulation_steps=2, seed=3))


def pair(m: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (4, 4) views of one (4, 8) storage, as a stage's output pair is."""
    y = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * m + salt), dtype=torch.float64)
    return y[:, :4], y[:, 4:]


def drive(j: int, copies_run_at_clock_end: bool = True, clocks: int | None = None):
    """Stage j of a J = 4 schedule with the fake stream, beside the same stage without offload; every output
    compared bit for bit. Returns the log."""
    torch.set_default_dtype(torch.float64)
    J = 4
    log: list = []
    copies = FakeCopies(log)
    stage, plain = mix_stage(j, J), mix_stage(j, J)
    stage.fifo = InputFifo(copies)
    for clock, cmds in schedule_clocks(J, k=2, windows=4):
        if clocks is not None and clock >= clocks:
            break
        log.append(("clock", clock))
        for cmd in cmds:
            if cmd.stage != j:
                continue
            if isinstance(cmd, ForwardPass):
                m = cmd.micro_batch
                log.append(("forward", m))
                y, y_ref = stage.forward(m, pair(m, 0)), plain.forward(m, pair(m, 0))
                assert all(torch.equal(a, b) for a, b in zip(y, y_ref))
            elif isinstance(cmd, DelayedBackward):
                m = cmd.micro_batch
                log.append(("backward", m))
                (dx, x), (dx_ref, x_ref) = stage.backward(m, pair(m, 1)), plain.backward(m, pair(m, 1))
                for a, b in zip([*dx, *x], [*dx_ref, *x_ref]):
                    assert torch.equal(a, b) and a.stride() == b.stride(), (clock, m)
            for fifo in (stage.fifo, plain.fifo):  # the count kept as entries come, go and move, against a walk
                assert fifo.device_bytes == tensor_bytes(fifo.on_device())
        if copies_run_at_clock_end:
            copies.run()
    for p, q in zip(stage.params, plain.params):
        assert torch.equal(p.grad, q.grad)
    return log


def per_micro_batch(log: list) -> dict[int, dict[str, Any]]:
    """From the log: each micro-batch's store clock, whether it was offloaded, the clock its prefetch started,
    the clock it was read and the copy its read waited on."""
    out: dict[int, dict[str, Any]] = {}
    clock, last, prefetch_of = None, None, {}
    for i, entry in enumerate(log):
        kind, value = entry
        if kind == "clock":
            clock = value
        elif kind == "forward":
            out[value] = {"stored": clock, "offloaded": log[i + 1][0] == "offload", "prefetched": None, "waited": None}
            last = value
        elif kind == "backward":
            out[value]["read"] = clock
            last = value
        elif kind == "prefetch":
            head = min(m for m, e in out.items() if "read" not in e)  # after a pop, the new head
            out[head]["prefetched"], prefetch_of[value] = clock, head
        elif kind == "wait":
            out[last]["waited"] = prefetch_of[value]
    return out


@pytest.mark.parametrize("j", [1, 2])
def test_each_entry_goes_out_as_stored_and_back_one_clock_before_its_read(j):
    log = drive(j)
    entries = per_micro_batch(log)
    tau = delay(j, 4)
    assert len(entries) == 8
    for m, e in entries.items():
        assert e["read"] == e["stored"] + tau, m
        if m == 0:  # stored into an empty FIFO: the next one read stays on the device
            assert not e["offloaded"] and e["prefetched"] is None and e["waited"] is None
        else:
            assert e["offloaded"] and e["prefetched"] == e["read"] - 1 and e["waited"] == m, (m, e)
    # within a clock: the forward's offload, then the read (waiting on its prefetch), then the new head's prefetch;
    # the stream runs them at the clock's end
    clock = entries[3]["read"]
    at = log.index(("clock", clock))
    assert [kind for kind, _ in log[at:log.index(("clock", clock + 1))]] == [
        "clock", "forward", "offload", "backward", "wait", "prefetch", "done", "done"]


def test_a_read_before_its_prefetch_completed_fails():
    with pytest.raises(RuntimeError, match="read before its prefetch completed"):
        drive(1, copies_run_at_clock_end=False)


def test_an_entry_comes_back_as_the_same_views_of_one_copy():
    torch.set_default_dtype(torch.float64)
    fifo = InputFifo(StreamCopies())
    entries = {m: pair(m, 0) for m in range(3)}
    for m, x in entries.items():
        fifo.append(m, x)
    assert len(fifo.on_device()) == 1 and fifo.on_device()[0] is entries[0]  # the head is kept as it is
    (host,) = fifo.on_host()[:1]
    assert host[0].untyped_storage().data_ptr() == host[1].untyped_storage().data_ptr()  # one storage, copied once
    assert tensor_bytes(fifo.on_host()) == 2 * tensor_bytes(entries[1])
    for m, x in entries.items():
        got = fifo.pop(m)
        assert all(torch.equal(a, b) and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
                   for a, b in zip(got, x))
        assert len(fifo.on_device()) == min(1, 2 - m) and len(fifo.on_host()) == max(0, 1 - m)
        assert fifo.device_bytes == tensor_bytes(fifo.on_device())
    with pytest.raises(RuntimeError, match="head is micro-batch None, not 3"):
        fifo.pop(3)


def test_entries_held_before_an_offload_starts_leave_but_the_head_and_the_device_bytes_follow():
    torch.set_default_dtype(torch.float64)
    fifo = InputFifo()
    for m in range(3):
        fifo.append(m, pair(m, 0))
    assert fifo.device_bytes == tensor_bytes(fifo.on_device()) == 3 * tensor_bytes(pair(0, 0))
    fifo.start_offloading(StreamCopies())
    assert len(fifo.on_host()) == 2 and fifo.device_bytes == tensor_bytes(fifo.on_device()) == tensor_bytes(pair(0, 0))
    for m in range(3):
        assert all(torch.equal(a, b) for a, b in zip(fifo.pop(m), pair(m, 0)))
        assert fifo.device_bytes == tensor_bytes(fifo.on_device())
    assert fifo.device_bytes == 0


def test_a_checkpoint_holds_the_host_copies_and_reloads_them_offloaded():
    torch.set_default_dtype(torch.float64)
    log: list = []
    fifo = InputFifo(FakeCopies(log))
    for m in range(3):
        fifo.append(m, pair(m, 0))
    state = fifo.state()  # waits for the offloads (the fake stream runs)
    assert [m for m, _ in state] == [0, 1, 2]
    assert all(torch.equal(a, b) for m, x in state for a, b in zip(x, pair(m, 0)))
    again = InputFifo(StreamCopies())
    again.load(state)
    assert len(again.on_device()) == 1 and len(again.on_host()) == 2
    assert again.device_bytes == tensor_bytes(again.on_device()) == tensor_bytes(pair(0, 0))
    assert all(torch.equal(a, b) for m in range(3) for a, b in zip(again.pop(m), pair(m, 0)))


def test_the_config_names_the_allowed_values():
    assert PetraConfig().fifo_offload == "none"
    assert PetraConfig.from_dict({"fifo_offload": "cpu"}).fifo_offload == "cpu"
    with pytest.raises(PetraConfigError,
                       match=r"\"petra.fifo_offload\" must be one of \('none', 'cpu', 'auto'\).*'gpu'"):
        PetraConfig.from_dict({"fifo_offload": "gpu"})


# --- training, with and without the offload ---

@functools.lru_cache(maxsize=None)
def _run(spec_json: str) -> list[dict]:
    return launch(json.loads(spec_json))


def run(**spec: Any) -> list[dict]:
    return _run(json.dumps(spec, sort_keys=True))


def assert_same_training(spec: dict) -> list[dict]:
    """The run with ``fifo_offload: "cpu"`` against the run without: parameters, every step's gradients and the
    losses bit for bit; some stage offloaded, and between clocks no stage kept more than its FIFO's head on the
    device. Returns the offloading run's results."""
    petra = spec.get("petra", {})
    plain = run(**spec)
    offloaded = run(**{**spec, "memory_trace": True, "petra": {**petra, "fifo_offload": "cpu"}})
    assert_same_bits(offloaded, plain)
    entries = [entry for r in offloaded for _, report in r["memory"] for entry in report.values()]
    assert max(entry["fifo_host"] for entry in entries) > 0
    assert all(entry["input_buffer_micro_batches"] <= 1 for entry in entries)  # between clocks: the head at most
    return offloaded


def settings_probe(engine: Any) -> str:
    """What rank 0 printed at start-up."""
    from petra_ds.diagnostics.settings import format_settings

    return format_settings(engine.run_settings)


TOY = {"pipe": 2, "stages_per_rank": 2, "k": 2, "train_batches": 4, "optimizer": SGD, "dropout": 0.1}


def test_toy_on_two_ranks_trains_the_same_bits_and_reports_device_and_host_bytes():
    from petra_ds.tools.toy import IN_FEATURES

    results = assert_same_training({**TOY, "probe": "test_fifo_offload:settings_probe"})
    J, M, entry_bytes, raw_bytes = 4, 8, 4 * 8 * 8, 4 * IN_FEATURES * 8  # a pair of (4, 4) float64; (4, 6) data
    for res in results:
        for clock, report in res["memory"]:
            for j, entry in report.items():
                if res["reconstructs"][j] or j == J - 1:
                    assert entry["input_buffer"] == entry["fifo_host"] == 0
                    continue
                in_flight = sum(1 for m in range(M) if m + j <= clock < m + j + delay(j, J))
                on_device = min(in_flight, 1)  # the head only: the entry its next backward reads
                if j == 0:  # its micro-batches, the head on the device (beside those loaded for the next clock)
                    assert entry["input_buffer"] == 0
                    assert entry["fifo_host_micro_batches"] == in_flight - on_device, (clock, j)
                    assert entry["fifo_host"] == (in_flight - on_device) * raw_bytes, (clock, j)
                    continue
                assert entry["input_buffer_micro_batches"] == on_device, (clock, j)
                assert entry["input_buffer"] == on_device * entry_bytes, (clock, j)
                assert entry["fifo_host_micro_batches"] == in_flight - on_device, (clock, j)
                assert entry["fifo_host"] == (in_flight - on_device) * entry_bytes, (clock, j)
    printed = results[0]["probe"]
    assert "input FIFO: stages 0, 2 offload it to host memory" in printed, printed


def test_toy_resumes_bit_for_bit_from_a_checkpoint_with_offloaded_entries(tmp_path):
    """Saved mid-flight (entries in host memory), loaded by new engines: the uninterrupted run's parameters."""
    common = {**TOY, "train_batches": 5, "petra": {"input_buffer": "all", "fifo_offload": "cpu"}}
    whole = merged_params(run(**{**common, "petra": {"input_buffer": "all"}}))
    ckpt = str(tmp_path / "ckpt")
    first = launch({**common, "save_dir": ckpt, "save_after": 2, "save_tag": "c4"})
    assert max((merged_params(first)[n] - whole[n]).abs().max().item() for n in whole) == 0.0
    resumed = launch({**common, "load_dir": ckpt})
    assert resumed[0]["clock"] == first[0]["clock"]
    got = merged_params(resumed)
    assert max((got[n] - whole[n]).abs().max().item() for n in whole) == 0.0


# --- "auto": offload where the copies hide under the stage's compute ---

class CountingTimer:
    """Marks 0, 1, 2, ...: a forward, marked before and after, takes 1 s."""

    def __init__(self) -> None:
        self.marks = itertools.count()

    def mark(self) -> int:
        return next(self.marks)

    def seconds(self, start: int, end: int) -> float:
        return float(end - start)


#: between the toy's two kinds of stored entry (stage 0's micro-batch, 192 B; stage 2's input, 256 B): with
#: 1 s forwards, copies of 2 x 192 B hide under 3 s, copies of 2 x 256 B do not
LINK = 2 * 224 / 3
_planners: list = []


def plan_with_counted_forwards(engine: Any) -> None:
    from petra_ds.runtime.offload_plan import OffloadPlanner

    _planners[:] = [engine.observe(OffloadPlanner(engine, LINK, CountingTimer()))]


def planner_probe(engine: Any) -> dict:
    (planner,) = _planners
    return {"decisions": planner.decisions, "watching": planner in engine.observers,
            "offloads": {j: st.offloads_inputs for j, st in engine.stages.items()}}


def test_auto_offloads_the_stages_whose_copies_hide_and_trains_the_same_bits():
    """The planner's rule on the toy's two ranks, forwards timed by a counting clock: stage 0 (small entries)
    offloads after the first train_batch, stage 2 keeps its FIFO on the device; training equals training without
    any offload bit for bit, and the planner stops watching once both decided."""
    plain = run(**TOY)
    auto = run(**{**TOY, "memory_trace": True, "setup": "test_fifo_offload:plan_with_counted_forwards",
                  "probe": "test_fifo_offload:planner_probe"})
    got, want = merged_params(auto), merged_params(plain)
    assert max((got[n] - want[n]).abs().max().item() for n in want) == 0.0
    grads = merged_grads(auto)
    for j, steps in merged_grads(plain).items():
        for a, b in zip(steps, grads[j], strict=True):
            assert all(torch.equal(a[n], b[n]) for n in a), j
    assert [[repr(x) for x in r["losses"]] for r in auto] == [[repr(x) for x in r["losses"]] for r in plain]
    decisions = {j: d for r in auto for j, d in r["probe"]["decisions"].items()}
    assert {j: (d["offload"], d["entry_bytes"], d["forward_s"]) for j, d in decisions.items()} == \
        {0: (True, 192, 1.0), 2: (False, 256, 1.0)}
    assert not any(r["probe"]["watching"] for r in auto)
    assert {j: o for r in auto for j, o in r["probe"]["offloads"].items()} == {0: True, 1: False, 2: False, 3: False}
    host = {j: [report[j]["fifo_host"] for clock, report in r["memory"] if j in report]
            for r in auto for j in r["stages"]}
    k = TOY["k"]  # decided at the end of the first train_batch: then every entry of stage 0's but its head left
    waiting = [max(0, sum(1 for m in range(k * TOY["train_batches"]) if m <= clock < m + delay(0, 4)) - 1)
               for clock in range(len(host[0]))]
    assert host[0] == [0] * k + [192 * n for n in waiting[k:]] and max(host[2]) == 0


def test_auto_on_a_cpu_is_none_and_says_so():
    """On a CPU the device is host memory: no planner, nothing offloaded, and the settings print says why."""
    results = run(**{**TOY, "petra": {"fifo_offload": "auto"}, "probe": "test_fifo_offload:settings_probe"})
    assert ("input FIFO: stage 2 keeps it on the device; fifo_offload auto: nothing leaves (on a CPU the device is "
            "host memory)") in results[0]["probe"]
    got, plain = merged_params(results), merged_params(run(**TOY))
    assert got.keys() == plain.keys() and all(torch.equal(got[n], plain[n]) for n in plain)


REVNET = {"model": "revnet", "k": 2, "train_batches": 3, "micro_batch": 2, "optimizer": SGD, "dropout": 0.0}
REVGPT = {"model": "revgpt", "k": 2, "train_batches": 3, "micro_batch": 2, "optimizer": SGD, "dropout": 0.1}


@pytest.mark.parametrize("layout", [pytest.param((2, 2), id="J4-two-ranks"),
                                    pytest.param((1, 10), id="J10-one-process", marks=pytest.mark.slow)])
def test_revnet18_trains_the_same_bits(layout):
    pipe, per_rank = layout
    assert_same_training({**REVNET, "pipe": pipe, "stages_per_rank": per_rank, "k": 2 if pipe == 2 else 4})


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 2, "block"), (1, 10, "half")], ids=["J4-two-ranks", "J10-one-process"])
def test_revgpt_trains_the_same_bits(layout):
    """The tiny RevGPT has 7 layers by block and 11 by half-block: J = 10 takes the half-block grain. The stage
    holding the final norm keeps a FIFO."""
    pipe, per_rank, grain = layout
    assert_same_training({**REVGPT, "pipe": pipe, "stages_per_rank": per_rank, "grain": grain})
