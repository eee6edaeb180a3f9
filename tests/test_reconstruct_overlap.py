"""``petra.reconstruct_overlap``: a reversible stage's backward block by block (PaReprop's order) gives
the plain order's gradients, reconstructed input and batch-norm statistics bit for bit (CPU, one stream);
the two-stream schedule is checked here with CUDA's stream API faked, and on a GPU in test_gpu.py."""

import contextlib
import copy
import functools

import pytest
import torch
from torch import nn

import petra_ds
from petra_ds.runtime.config import PetraConfig, PetraConfigError
from petra_ds.nn import AdditiveCoupling, ReversibleSequential, SwapCoupling
from petra_ds.nn.reversible import SequentialTape, reconstruct, reconstruct_and_backward
from petra_ds.runtime.stage import Stage, StageOptions
from petra_ds.tools.toy import Additive, Swap

from harness import launch, run_rank


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tensors of a few dozen numbers: one thread, so that OpenMP does not spin against whatever else
    runs on the machine (2 threads on a loaded 2-core machine cost 100x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


BLOCKS = {"additive": [Additive] * 3, "swap": [Swap] * 3, "mixed": [Swap, Additive, Swap, Additive]}
WIDTH = 4  # petra_ds.tools.toy's stream width


def stage_pair(blocks, dropout, batchnorm, **options):
    """Two identical middle stages (they reconstruct), the overlap off and on."""
    torch.manual_seed(0)
    layers = [cls(dropout, batchnorm) for cls in BLOCKS[blocks]]
    stages = []
    for overlap in (False, True):
        opts = StageOptions(gradient_accumulation_steps=2, seed=7, reconstruct_overlap=overlap, **options)
        stages.append(Stage(1, 3, copy.deepcopy(layers), opts))
    return stages


def assert_same(a, b, what):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    assert len(a) == len(b), what
    for s, t in zip(a, b):
        assert s.dtype == t.dtype and torch.equal(s, t), what


def train(stage, data, deltas, lr=0.1):
    """PETRA's order at one middle stage: every forward, then the delayed backwards with an SGD step
    every k = 2 (so later reconstructions use parameters the forward did not); what each backward gave."""
    ys = [stage.forward(m, x) for m, x in enumerate(data)]
    out = []
    for m, (y, delta) in enumerate(zip(ys, deltas)):
        stage.reconstruct(m, y, delta)
        dx, x_tilde = stage.backward(m)
        out.append((dx, x_tilde, [p.grad.clone() for p in stage.params]))
        if m % 2 == 1:
            with torch.no_grad():
                for p in stage.params:
                    p -= lr * p.grad
                    p.grad = None
    return out


@pytest.mark.parametrize("blocks", sorted(BLOCKS))
@pytest.mark.parametrize("dropout,batchnorm", [(0.0, False), (0.2, False), (0.2, True)],
                         ids=["plain", "dropout", "dropout+bn"])
@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16-autocast"])
def test_block_by_block_is_bit_identical_to_the_plain_order(blocks, dropout, batchnorm, bf16):
    dtype = torch.float32 if bf16 else torch.float64  # bf16 autocast keeps fp32 streams
    torch.set_default_dtype(dtype)
    options = {"autocast_dtype": torch.bfloat16} if bf16 else {}
    plain, overlap = stage_pair(blocks, dropout, batchnorm, **options)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, WIDTH, generator=g), torch.randn(6, WIDTH, generator=g)) for _ in range(4)]
    deltas = [(torch.randn(6, WIDTH, generator=g), torch.randn(6, WIDTH, generator=g)) for _ in range(4)]
    got, want = train(overlap, data, deltas), train(plain, data, deltas)
    for m, ((dx, x, grads), (dx0, x0, grads0)) in enumerate(zip(got, want)):
        assert_same(dx, dx0, f"dx of micro-batch {m}")
        assert_same(x, x0, f"x~ of micro-batch {m}")
        for i, (a, b) in enumerate(zip(grads, grads0)):
            assert torch.equal(a, b), f"grad {i} of micro-batch {m}"
    for a, b in zip(overlap.params, plain.params):
        assert torch.equal(a, b)
    for a, b in zip(overlap.norms, plain.norms):
        assert torch.equal(a.running_mean, b.running_mean) and torch.equal(a.running_var, b.running_var)
    if batchnorm:  # the default policy: the reconstruction, not the forward, moved the running statistics
        assert all(int(bn.num_batches_tracked) == len(data) for bn in overlap.norms)
    if dropout and not bf16:  # keyed masks: without them x~ would be far from x even before the first step
        fresh, _ = stage_pair(blocks, dropout, batchnorm)
        y = fresh.forward(0, data[0])
        fresh.reconstruct(0, y, deltas[0])
        _, x_tilde = fresh.backward(0)
        assert max((a - b).abs().max().item() for a, b in zip(x_tilde, data[0])) < 1e-12


def test_with_weight_stashing_too():
    """The param_buffer ablation: both orders reconstruct and differentiate with the forward's weights."""
    torch.set_default_dtype(torch.float64)
    plain, overlap = stage_pair("mixed", 0.2, False, param_buffer=True)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(5, WIDTH, generator=g), torch.randn(5, WIDTH, generator=g)) for _ in range(4)]
    deltas = [(torch.randn(5, WIDTH, generator=g), torch.randn(5, WIDTH, generator=g)) for _ in range(4)]
    got = train(overlap, data, deltas)
    for (dx, x, grads), (dx0, x0, grads0) in zip(got, train(plain, data, deltas)):
        assert_same(dx, dx0, "dx")
        assert_same(x, x0, "x~")
        assert all(torch.equal(a, b) for a, b in zip(grads, grads0))
    # the stashed weights are the forward's: x~ = x even after the first step
    errors = [(a - b).abs().max().item() for (_, x, _), true in zip(got[2:], data[2:]) for a, b in zip(x, true)]
    assert max(errors) < 1e-12
    assert all(torch.equal(a, b) for a, b in zip(overlap.params, plain.params))


def test_the_chain_order_matches_its_tape_and_walks_nested_chains():
    """``reconstruct_and_backward`` on a chain with a nested ``ReversibleSequential`` equals
    ``reconstruct`` + ``SequentialTape.backward`` (parameter gradients included)."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(3)

    def mlp():
        return nn.Sequential(nn.Linear(WIDTH, 8), nn.Tanh(), nn.Linear(8, WIDTH))

    chain = [SwapCoupling(mlp()), ReversibleSequential(AdditiveCoupling(mlp(), mlp()), SwapCoupling(mlp())),
             AdditiveCoupling(mlp(), mlp())]
    twin = copy.deepcopy(chain)
    y = (torch.randn(5, WIDTH), torch.randn(5, WIDTH))
    dy = (torch.randn(5, WIDTH), torch.randn(5, WIDTH))
    x, tapes = y, []
    for layer in reversed(twin):
        x, tape = reconstruct(layer, x)
        tapes.append(tape)
    dx = SequentialTape(tapes).backward(dy)
    x2, dx2 = reconstruct_and_backward(chain, y, dy)
    assert_same(x2, x, "x")
    assert_same(dx2, dx, "dx")
    for a, b in zip(nn.ModuleList(chain).parameters(), nn.ModuleList(twin).parameters()):
        assert torch.equal(a.grad, b.grad)


def test_at_most_two_blocks_graphs_are_alive_at_once():
    """The plain order holds the graphs of all the stage's blocks before its first VJP; block by block
    holds two (the block being differentiated and the one being rebuilt): 2/4 of it for four blocks."""
    from petra_ds.diagnostics.held import HeldTracker

    torch.set_default_dtype(torch.float64)
    peaks = []
    for overlap in (False, True):
        torch.manual_seed(0)
        stage = Stage(1, 3, [Additive() for _ in range(4)], StageOptions(reconstruct_overlap=overlap))
        x = (torch.randn(64, WIDTH), torch.randn(64, WIDTH))
        y = stage.forward(0, x)
        tracker = HeldTracker(exclude=stage.params)
        with tracker.recording():
            stage.reconstruct(0, y, y)
            stage.backward(0)
        peaks.append(tracker.peak_bytes)
    plain, overlap = peaks
    assert 0.4 * plain < overlap <= 0.55 * plain, peaks


class _Block(SwapCoupling):
    """A swap coupling that logs where its reconstruction and its VJPs were issued."""

    def __init__(self, i, log, streams):
        super().__init__(nn.Linear(WIDTH, WIDTH))
        self.i, self.log, self.streams = i, log, streams

    def reconstruct(self, y):
        self.log.append(("rebuild", self.i, self.streams.now))
        x, tape = super().reconstruct(y)
        vjp = tape.backward

        def logged(dy):
            self.log.append(("vjp", self.i, self.streams.now))
            return vjp(dy)

        tape.backward = logged
        return x, tape


class _FakeCuda:
    """Just enough of torch.cuda's stream API to record what ``reconstruct_and_backward`` issues where."""

    def __init__(self, log):
        self.log, self.now, self.events = log, "main", 0

    def stream(self, name):
        @contextlib.contextmanager
        def on():
            before, self.now = self.now, name
            yield
            self.now = before
        return on()

    def wait_stream(self, waiter, other):
        self.log.append(("wait_stream", waiter, other))

    def event(self):
        fake, self.events = self, self.events + 1
        name = f"e{self.events}"

        class Event:
            def record(self, stream):
                self.name = name
                fake.log.append(("record", stream.name, name))
        return Event()


def happens_before(log):
    """For every rebuild / vjp entry of ``log``, the set of entries it is ordered after on the device:
    stream order, plus what ``wait_event`` / ``wait_stream`` add (CUDA's rules)."""
    streams, recorded, after = {}, {}, {}
    for entry in log:
        kind = entry[0]
        if kind in ("rebuild", "vjp"):
            stream = entry[2]
            after[entry[:2]] = set(streams.get(stream, set()))
            streams.setdefault(stream, set()).add(entry[:2])
        elif kind == "record":
            recorded[entry[2]] = set(streams.get(entry[1], set()))
        elif kind == "wait":
            streams.setdefault(entry[1], set()).update(recorded[entry[2]])
        elif kind == "wait_stream":
            streams.setdefault(entry[1], set()).update(streams.get(entry[2], set()))
    return after, streams


def test_the_two_stream_schedule_orders_what_depends_and_overlaps_the_rest(monkeypatch):
    """The CUDA path, its streams faked on CPU: block i's VJPs run on the stream its graph was built on,
    after block i+1's VJPs (delta); block i-1's reconstruction is issued before block i's VJPs, on the
    other stream, after block i's reconstruction only; the caller's stream ends after everything."""
    torch.set_default_dtype(torch.float64)
    log = []
    cuda = _FakeCuda(log)

    class Stream:
        def __init__(self, name):
            self.name, self.device = name, "fake"

        def wait_stream(self, other):
            cuda.wait_stream(self.name, other.name)

        def wait_event(self, event):
            log.append(("wait", self.name, event.name))

    main, side = Stream("main"), Stream("side")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: cuda.stream(s.name))
    monkeypatch.setattr(torch.cuda, "Event", cuda.event)
    L = 5
    chain = [_Block(i, log, cuda) for i in range(L)]
    y = (torch.randn(3, WIDTH), torch.randn(3, WIDTH))
    x, dx = reconstruct_and_backward(chain, y, y, side_stream=side)
    monkeypatch.undo()
    twin = copy.deepcopy(chain)  # the same numbers as without streams
    assert_same(x, reconstruct_and_backward(twin, y, y)[0], "x")
    after, streams = happens_before(log)
    ops = [e[:3] for e in log if e[0] in ("rebuild", "vjp")]
    for n, i in enumerate(reversed(range(L))):  # n-th block from the last: layer i
        stream = ("main", "side")[n % 2]
        assert ("rebuild", i, stream) in ops and ("vjp", i, stream) in ops
        assert ("rebuild", i) in after[("vjp", i)]
        if i + 1 < L:
            assert ("vjp", i + 1) in after[("vjp", i)]  # delta
            assert ("rebuild", i + 1) in after[("rebuild", i)]  # its input
            assert ("vjp", i + 1) not in after[("rebuild", i)]  # free to overlap block i+1's VJPs
            assert ops.index(("rebuild", i, stream)) < ops.index(("vjp", i + 1, ("main", "side")[(n - 1) % 2]))
    assert streams["main"] >= {("vjp", 0), ("rebuild", 0)}  # the caller's stream waits for the side stream


def test_deferred_reconstruction_contract():
    """With the option, ``reconstruct`` records x~_j (returns None) and ``backward`` returns (dx, x~);
    a backward without its reconstruction, or a checkpoint taken between the two, is refused."""
    torch.set_default_dtype(torch.float64)
    _, stage = stage_pair("mixed", 0.0, False)
    x = (torch.randn(3, WIDTH), torch.randn(3, WIDTH))
    y = stage.forward(0, x)
    with pytest.raises(RuntimeError, match="without its reconstruction"):
        stage.backward(0)
    assert stage.reconstruct(0, y, y) is None
    with pytest.raises(RuntimeError, match="in the middle of a clock"):
        stage.state_dict()
    dx, x_tilde = stage.backward(0)
    assert len(dx) == len(x_tilde) == 2 and stage.reconstruction is None
    assert max((a - b).abs().max().item() for a, b in zip(x_tilde, x)) < 1e-12


def test_config_value_is_validated():
    assert PetraConfig().reconstruct_overlap is False
    assert PetraConfig.from_dict({"reconstruct_overlap": True}).reconstruct_overlap is True
    with pytest.raises(PetraConfigError, match='"petra.reconstruct_overlap" must be true or false, got \'yes\''):
        PetraConfig.from_dict({"reconstruct_overlap": "yes"})


# --- the engine, one process hosting every stage ---

RUNS = {  # J = 3: stage 1 is Swap, Additive, Swap of the toy model; RevGPT's stage 1 is two blocks
    "toy": {"stages_per_rank": 3, "dropout": 0.1},
    "toy_bn": {"stages_per_rank": 3, "dropout": 0.1, "batchnorm": True},
    "revgpt": {"stages_per_rank": 3, "dropout": 0.1, "model": "revgpt", "micro_batch": 3},
}
COMMON = {"pipe": 1, "k": 2, "train_batches": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}


def _with_option(spec):
    """``run_rank`` with ``petra.reconstruct_overlap`` in the config; notes whether the engine handed it to
    its stages and which stages reconstruct."""
    initialize = petra_ds.initialize
    seen = {}

    def initialize_and_note(*args, **kwargs):
        out = initialize(*args, **kwargs)
        engine = out[0]
        wanted = engine.petra_config.reconstruct_overlap
        seen["passed"] = all(st.options.reconstruct_overlap == wanted for st in engine.stages.values())
        seen["reconstructing"] = [j for j, st in engine.stages.items() if st.reconstructs]
        seen["stages"] = list(engine.stages.values())
        return out

    petra_ds.initialize = initialize_and_note
    try:
        result = run_rank(spec)
    finally:
        petra_ds.initialize = initialize
    seen["block_wise_backwards"] = sum(st.block_wise_backwards for st in seen.pop("stages"))
    return {**result, **seen}


def _all_runs(_spec):
    """Every configuration with the option off and on, in one process (one DeepSpeed import)."""
    return {(name, overlap): _with_option({**COMMON, **spec, "petra": {"reconstruct_overlap": overlap}})
            for name, spec in RUNS.items() for overlap in (False, True)}


@functools.lru_cache(maxsize=None)
def engine_runs():
    (results,) = launch({}, world_size=1, target=_all_runs, timeout=600)
    return results


@pytest.mark.parametrize("name", sorted(RUNS))
def test_engine_with_the_option_trains_the_same_parameters(name):
    off, on = engine_runs()[(name, False)], engine_runs()[(name, True)]
    assert on["reconstructing"] == [1] and on["reconstructs"][1]
    # every micro-batch fed in 3 calls of k = 2, drained: six backwards at stage 1, all block by block
    assert (on["block_wise_backwards"], off["block_wise_backwards"]) == (6, 0)
    assert on["params"].keys() == off["params"].keys()
    for n in off["params"]:
        assert torch.equal(on["params"][n], off["params"][n]), n
    assert len(on["losses"]) == len(off["losses"])  # nan: a call in which no micro-batch finished
    assert all(a == b or (a != a and b != b) for a, b in zip(on["losses"], off["losses"]))
    for j, steps in off["grads"].items():
        assert len(steps) == len(on["grads"][j]) == COMMON["train_batches"]
        for a, b in zip(steps, on["grads"][j]):
            assert all(torch.equal(a[n], b[n]) for n in a), j


def test_the_engine_hands_the_option_to_its_stages():
    assert engine_runs()[("toy", True)]["passed"] and engine_runs()[("toy", False)]["passed"]


def test_a_stage_without_bf16_rebuilds_its_input_in_its_caller_s_autocast_state():
    """A stage without bf16 evaluates its forward and its reconstruction in whatever autocast state its caller is
    in: under the caller's bf16 autocast both compute F and G alike, so the reconstruction undoes the forward to
    fp32 rounding (F and G evaluated once in bf16 and once in fp32 leave bf16's rounding: 5e-3 here)."""
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    stage = Stage(1, 3, [Swap() for _ in range(3)], StageOptions())
    x = (torch.randn(16, WIDTH), torch.randn(16, WIDTH))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = stage.forward(0, x)
        rebuilt = stage.reconstruct(0, y, y)
    assert max(float((a - b).abs().max()) for a, b in zip(rebuilt, x)) <= 1e-5
