"""The host cost of a PETRA clock, counted (``python -m benchmarks.host_overhead`` at CI sizes): aten ops per
micro-batch against plain forward + backward of the same layers, host syncs per ``train_batch``, what
``check_finite`` adds, the Python bytecodes around them, and the counters themselves against hand-made programs."""

import pytest
import torch

from petra_ds.diagnostics.host_cost import Bytecodes, OpCounter
from petra_ds.runtime.observe import Observer
from petra_ds.util.host_reads import HostSyncs
from petra_ds.schedule import ClockTemplates, PetraSchedule, Timeline

from benchmarks.lib import host_overhead

TINY = host_overhead.parse_args(["--tiny"])


def test_the_op_counter_counts_each_dispatched_op_once():
    x = torch.randn(4, 4)
    with OpCounter() as counter:
        y = (x @ x).relu_()
        torch._foreach_add_([y, x], 1.0)  # one op for the whole list
    assert counter.by_name == {"mm": 1, "relu_": 1, "_foreach_add_": 1}


def test_the_op_counter_counts_the_tensors_a_multi_tensor_op_would_take_one_by_one_on_cuda():
    """CUDA fuses a multi-tensor op over dense tensors of one dtype; one tensor unlike the others (not dense, or
    another dtype) sends every tensor of the list one by one."""
    x, half = torch.randn(4, 4), torch.randn(4, 8)[:, :4]
    with OpCounter() as counter:
        torch._foreach_abs([x, x.t().contiguous(), torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)])
        torch._foreach_abs([x, half])  # x goes one by one because of half, which cannot be fused anyway
        torch._foreach_add_([x, x.bfloat16()], 1.0)  # two dtypes
    assert counter.dragged == {"_foreach_abs": 1, "_foreach_add_": 2}


def test_the_op_counter_counts_a_replay_of_the_graphs_stand_ins_as_one_launch():
    """What runs inside a replay's range is the graph's (``in_graphs``); the replay is one launch. Other ranges' own
    ops count as ops, as they did before replays had ranges (torch's optimizers open one per step)."""
    from petra_ds.runtime.graphed import REPLAY_LABEL

    x = torch.randn(4, 4)
    with OpCounter() as counter:
        with torch.profiler.record_function(REPLAY_LABEL):
            with torch.profiler.record_function("inside"):
                y = (x @ x).relu_()
            y = y + 1
        with torch.profiler.record_function("elsewhere"):
            x.relu()
    assert counter.by_name == {"graph_replay": 1, "relu": 1, "_record_function_enter_new": 1,
                               "_record_function_exit": 1}
    assert counter.in_graphs == {"mm": 1, "relu_": 1, "add": 1, "_record_function_enter_new": 1,
                                 "_record_function_exit": 1}


def test_host_syncs_counts_every_read_of_values_and_nothing_else():
    x = torch.randn(5)
    with HostSyncs() as syncs:
        y = x * 2 + 1  # no read
        _ = y.sum().item(), bool(y[0] > 0), y.tolist(), float(y.max()), torch.nonzero(y > 0), y.cpu()
    assert syncs.count == 6, syncs.where
    assert all("test_host_overhead.py" in where for where in syncs.where)
    with HostSyncs() as none:
        torch._foreach_mul_([x], 2.0)
    assert none.count == 0


def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def test_the_bytecode_counter_counts_each_bytecode_once_where_its_code_lives():
    """Each iteration of a loop adds the same bytecodes; the code of this file is "other", the counter's own way in and
    out is not counted, and counting stops at the block's end."""
    totals = []
    for n in (0, 10, 20):
        with Bytecodes() as counter:
            _loop(n)
        totals.append(counter.total)
        assert set(counter.by_area) == {"other"}
    assert totals[2] - totals[1] == totals[1] - totals[0] > 0
    with Bytecodes() as counter:
        PetraSchedule.for_window(Timeline(2).train_window(2), 1, 0, stages_per_rank=2).clock_instructions(1)
    assert counter.by_area["petra_ds.schedule"] > 0
    after = counter.total
    _loop(100)
    assert counter.total == after


def test_a_steady_clock_shifted_from_its_template_costs_at_most_0_4x_the_bytecodes_of_deriving_it():
    """RevNet18's cut, J = 10 stages in one process, k = 4: once the pipeline is full, a window of clocks shifted from
    the engine's templates interprets at most 0.4x the bytecodes the clock equations take (measured: 0.33x)."""
    reversible = [False] + [True] * 8 + [False]

    def steady_window(templates: ClockTemplates | None) -> int:
        timeline = Timeline(10)
        for _ in range(8):
            window = timeline.train_window(4)
            timeline.advance(window)
            schedule = PetraSchedule.for_window(window, 1, 0, stages_per_rank=10, gradient_accumulation_steps=4,
                                                reversible=reversible, templates=templates)
            with Bytecodes() as counter:
                clocks = [list(cmds) for cmds in schedule]
        assert sum(map(len, clocks)) >= 200  # a clock's 50 instructions and its steps (no receives in one process)
        return counter.total

    assert steady_window(ClockTemplates()) <= 0.4 * steady_window(None)


@pytest.fixture(scope="module")
def counts(world_of_one):
    """Ops per micro-batch for both models and dtypes, check_finite on and off (the benchmark's own function; plain
    backprop's counts with check_finite on only, where they are compared)."""
    return {(name, dtype, finite): host_overhead.count_ops(name, TINY, dtype, finite, plain=finite)
            for name in host_overhead.MODELS for dtype in host_overhead.DTYPES for finite in (True, False)}


@pytest.mark.parametrize("name", host_overhead.MODELS)
@pytest.mark.parametrize("dtype", host_overhead.DTYPES)
def test_petra_dispatches_at_most_1_5x_the_ops_of_plain_backprop_per_stage(counts, name, dtype):
    """Per micro-batch at steady state, the same optimizer (fused AdamW) and clipping; the arithmetic alone is
    about 4/3 (a second evaluation of every layer). Per stage, first / FIFO / reconstructing / last, against
    that stage's layers alone (what one rank of a J-rank pipeline runs), and the whole model in one process (RevNet18
    at J = 10 takes 10 optimizer steps per k micro-batches against plain's one)."""
    row = counts[(name, dtype, True)]
    for stage in row["stages"]:
        assert stage["ratio"] <= 1.5, stage
    assert {"first", "last", "reconstructing"} <= {s["kind"] for s in row["stages"]}
    assert row["ratio"] <= 1.5, row["ratio"]


@pytest.mark.parametrize("name,bound", [("revgpt", 0.5), ("revnet18", 0.8)])
def test_with_cuda_graphs_a_clock_launches_fewer_kernels_than_plain_backprop(counts, world_of_one, name, bound):
    """Each part (F, G, a non-reversible layer) one replay per evaluation, counted with the graphs' eager stand-ins:
    the launches per micro-batch fall below plain backprop's (about 0.4x RevGPT, 0.7x RevNet18 here), and every
    replay the counter saw is one the parts made."""
    row = host_overhead.count_ops(name, TINY, "fp32", plain=False, graphs=True)
    assert row["graph_replays"] == row["parts_replayed"] > 0
    assert row["petra_ops"] <= bound * counts[(name, "fp32", True)]["plain_ops"], row["petra_ops"]


@pytest.mark.parametrize("name", host_overhead.MODELS)
@pytest.mark.parametrize("dtype", host_overhead.DTYPES)
def test_no_tensor_a_multi_tensor_kernel_could_fuse_goes_one_by_one_because_of_its_list(counts, name, dtype):
    """Every ``_foreach_*`` op of a steady-state call (the NaN watch's, the accumulation's, clipping's) hands CUDA
    lists it fuses: RevNet18's stem and downsampling send the watch channel halves that are not dense, which must
    not take the rest of the clock's tensors one by one with them (218 reductions a call on an H200)."""
    assert counts[(name, dtype, True)]["petra_foreach_dragged"] == 0


@pytest.mark.parametrize("name", host_overhead.MODELS)
@pytest.mark.parametrize("dtype", host_overhead.DTYPES)
def test_check_finite_adds_at_most_3_percent_of_the_ops(counts, name, dtype):
    on, off = counts[(name, dtype, True)], counts[(name, dtype, False)]
    assert on["petra_ops"] <= 1.03 * off["petra_ops"], (on["petra_ops"], off["petra_ops"])


def test_bf16_casts_each_weight_once_per_stage_evaluation(world_of_one):
    """One autocast region per stage and evaluation (``Stage.run``): in a bf16 forward of a RevGPT stage of
    several blocks, each weight matrix is cast to bf16 exactly once, and nothing else of the stage's is
    cast twice."""
    from petra_ds.runtime.stage import Stage, StageOptions

    m = host_overhead.model("revgpt", TINY)
    layers = [spec.build(log=False) for spec in m["specs"][1:-2]]  # the blocks
    stage = Stage(1, 3, layers, StageOptions(autocast_dtype=torch.bfloat16))
    weights = [p for p in stage.params if p.dim() == 2]
    x = (torch.randn(2, TINY.revgpt_seq, TINY.revgpt_d), torch.randn(2, TINY.revgpt_seq, TINY.revgpt_d))
    with torch.no_grad():
        casts = _casts_of(weights, lambda: stage.run(x))
    assert len(layers) > 1 and set(casts) == {p.data_ptr() for p in weights} and set(casts.values()) == {1}


def _casts_of(tensors, call) -> dict[int, int]:
    """How often ``call`` casts (``_to_copy``) each of ``tensors``, by address."""
    from torch.utils._python_dispatch import TorchDispatchMode

    addresses = {t.data_ptr() for t in tensors}

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.of: dict[int, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_to_copy" and args[0].data_ptr() in addresses:
                self.of[args[0].data_ptr()] = self.of.get(args[0].data_ptr(), 0) + 1
            return func(*args, **(kwargs or {}))

    with Casts() as casts:
        call()
    return casts.of


@pytest.mark.parametrize("name", host_overhead.MODELS)
def test_bf16_casts_each_weight_once_per_clock(world_of_one, name):
    """A stage evaluates its layers twice per micro-batch with the weights its clock began with (the forward, then
    the reconstruction or recomputation): the second evaluation reads the first one's casts (``nn/casts.py``), so
    in a steady call of k clocks every weight a layer casts is cast k times, not 2k. The weights cast are those of
    the linear and convolution layers, each of them."""
    from petra_ds.nn.casts import shares_casts

    assert shares_casts()  # this torch keeps a cast cached under no_grad differentiable
    m, k = host_overhead.model(name, TINY), TINY.k
    engine, stream = host_overhead.petra_engine(m, k, "bf16"), host_overhead.data(m)
    for _ in range(host_overhead.fill_calls(m["J"], k) + 1):
        engine.train_batch(stream)
    casts = _casts_of(engine.module.parameters(), lambda: engine.train_batch(stream))
    cast_layers = (torch.nn.Linear, torch.nn.Conv2d)
    castable = {p.data_ptr() for mod in engine.module.modules() if isinstance(mod, cast_layers)
                for p in mod.parameters()}
    assert set(casts) == castable and set(casts.values()) == {k}, (len(casts), len(castable), set(casts.values()))


def test_whether_casts_are_shared_does_not_depend_on_the_caller_s_grad_mode():
    """The question is asked once, by whichever clock runs first: an ``eval_batch`` under ``no_grad`` (or inference
    mode) asking first must not turn the sharing off for the rest of the run."""
    from petra_ds.nn.casts import shares_casts

    answers = []
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        shares_casts.cache_clear()
        with mode():
            answers.append(shares_casts())
    assert answers == [True] * 3


@pytest.mark.parametrize("petra", [{}, {"delay_compensation": "weight_prediction"}, {"param_buffer": True}],
                         ids=["plain", "weight_prediction", "param_buffer"])
def test_sharing_a_clock_s_casts_changes_no_bit(world_of_one, monkeypatch, petra):
    """bf16 RevNet18 at J = 10 trains bit for bit as when every evaluation casts anew, also where weights are
    written in place inside a clock: predicted for the forward and put back after it, or the forward's stashed
    weights swapped in for the reconstruction (each write drops the casts made of the old values)."""
    import contextlib

    import petra_ds.runtime.local_stages as local_stages

    m, k = host_overhead.model("revnet18", TINY), TINY.k

    def trained() -> dict[str, torch.Tensor]:
        engine, stream = host_overhead.petra_engine(m, k, "bf16", petra=petra), host_overhead.data(m)
        for _ in range(host_overhead.fill_calls(m["J"], k) + 3):
            engine.train_batch(stream)
        return {n: t.clone() for n, t in engine.module.state_dict().items()}

    shared = trained()
    monkeypatch.setattr(local_stages, "clock_casts", contextlib.nullcontext)
    anew = trained()
    assert shared.keys() == anew.keys()
    assert all(torch.equal(shared[n], anew[n]) for n in shared), [n for n in shared if not torch.equal(shared[n],
                                                                                                        anew[n])]


def test_op_counts_do_not_depend_on_width_sequence_or_batch(world_of_one):
    """Why the benchmark counts at narrow sizes what ``python -m benchmarks.gpu`` runs wide."""
    narrow = host_overhead.count_ops("revgpt", TINY, "fp32", True)
    wide = host_overhead.count_ops("revgpt", TINY, "fp32", True, d=32, seq=16)
    assert narrow["petra_by_op"] == wide["petra_by_op"]


@pytest.mark.parametrize("name", host_overhead.MODELS)
def test_a_steady_state_train_batch_makes_one_host_sync(world_of_one, name):
    """The window's one read (its loss and every NaN / Inf check together); the optimizer steps are guarded on
    the device (fused AdamW's found_inf), the returned loss is not read."""
    row = host_overhead.count_syncs(name, TINY, "fp32")
    assert row["syncs"] == 1, row["where"]
    assert all("runtime/engine.py" in where and "tolist" in where for where in row["where"])


def test_train_batch_puts_a_module_left_in_eval_mode_back_to_training(world_of_one):
    """As DeepSpeed's ``train_batch`` does, from the module list the engine keeps (not a walk of the tree): a
    submodule left in eval mode (its dropout off) trains again, and a whole model in eval mode too."""
    m, k = host_overhead.model("revgpt", TINY), TINY.k
    engine, stream = host_overhead.petra_engine(m, k), host_overhead.data(m)
    dropout = next(mod for mod in engine.module.modules() if isinstance(mod, torch.nn.Dropout))
    dropout.eval()
    engine.train_batch(stream)
    assert dropout.training
    engine.module.eval()
    engine.train_batch(stream)
    assert all(mod.training for mod in engine.module.modules())


class _Instructions(Observer):
    """Notes the name of every instruction it is shown, before and after."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def before_instruction(self, engine, instruction) -> None:
        self.seen.append(type(instruction).__name__)

    def after_instruction(self, engine, instruction) -> None:
        self.seen.append("/" + type(instruction).__name__)


def test_the_unobserved_instruction_loop_trains_as_the_observed_one_and_both_refuse_an_unknown_instruction(
        world_of_one, monkeypatch):
    """The engine runs a clock's instructions without per-instruction work when nothing watches them and with it
    when an observer does: the same losses and weights, bit for bit, every instruction shown to the observer just
    before and after it runs; an instruction with no handler stops either loop, named."""
    from petra_ds.runtime.engine import PetraEngine

    m, k = host_overhead.model("revgpt", TINY), TINY.k
    calls = host_overhead.fill_calls(m["J"], k) + 1

    def watched_by(watcher):
        engine, stream = host_overhead.petra_engine(m, k), host_overhead.data(m)
        if watcher is not None:
            engine.observe(watcher)
        return engine, stream

    runs = []
    for watcher in (None, _Instructions()):
        engine, stream = watched_by(watcher)
        losses = [engine.train_batch(stream).item() for _ in range(calls)]
        runs.append((losses, [p.detach().clone() for p in engine.module.parameters()], watcher))
    (plain, weights, _), (watched, watched_weights, watcher) = runs
    assert plain == watched and all(torch.equal(a, b) for a, b in zip(weights, watched_weights))
    assert watcher.seen[:2] == ["LoadMicroBatch", "/LoadMicroBatch"] and "ForwardPass" in watcher.seen
    assert watcher.seen[0::2] == [name.lstrip("/") for name in watcher.seen[1::2]]
    known = {cls: handler for cls, handler in PetraEngine._INSTRUCTION_MAP.items() if cls.__name__ != "SendGrad"}
    monkeypatch.setattr(PetraEngine, "_INSTRUCTION_MAP", known)
    for watcher in (None, _Instructions()):
        engine, stream = watched_by(watcher)
        with pytest.raises(RuntimeError, match="does not understand instruction SendGrad"):
            for _ in range(calls):
                engine.train_batch(stream)


def test_an_optimizer_that_cannot_skip_on_the_device_costs_one_sync_per_step(world_of_one):
    """The fallback, counted: torch's non-fused SGD makes the engine read each step's flag."""
    from petra_ds.util.host_reads import HostSyncs

    m, k = host_overhead.model("revgpt", TINY), TINY.k
    saved = host_overhead.OPTIMIZER
    host_overhead.OPTIMIZER = {"type": "SGD", "params": {"lr": 0.01}}
    try:
        engine = host_overhead.petra_engine(m, k)
    finally:
        host_overhead.OPTIMIZER = saved
    stream = host_overhead.data(m)
    for _ in range(host_overhead.fill_calls(m["J"], k)):
        engine.train_batch(stream)
    with HostSyncs() as syncs:
        engine.train_batch(stream)
    steps = m["J"]  # every stage steps once per train_batch of k micro-batches
    assert syncs.count == 1 + steps, syncs.where


def _syncs_of_a_pipeline_rank(spec: dict) -> dict:
    """One rank of a two-rank pipeline (J = 4, two stages each): its host reads in a steady-state train_batch."""
    import petra_ds

    petra_ds.init_distributed(dist_backend="gloo")
    m, k = host_overhead.model("revgpt", TINY, stages=4), TINY.k
    engine = host_overhead.petra_engine(m, k, pipe=2)
    stream = host_overhead.data(m)
    for _ in range(host_overhead.fill_calls(m["J"], k) + 1):  # every channel's layout exchanged, then steady
        engine.train_batch(stream)
    with HostSyncs() as syncs:
        engine.train_batch(stream)
    return dict(syncs.where)


def test_messages_between_ranks_cost_no_host_read_after_their_first_clock():
    """Each channel's layout header is read once, at its first message; a steady-state window of a two-rank
    pipeline reads only its loss and checks (the loss broadcast and the messages are collectives, not reads)."""
    from harness import launch

    for where in launch({}, world_size=2, target=_syncs_of_a_pipeline_rank, timeout=180):
        assert sum(where.values()) == 1 and all("runtime/engine.py" in w for w in where), where


def test_the_time_part_runs_revnet18_at_the_gpu_benchmark_s_cut(world_of_one):
    """``--time-model revnet18``: the host time of RevNet18's J = 10 one-layer stages, the partition whose H100 gap
    the RevGPT part cannot show, against the same variants."""
    args = host_overhead.parse_args(["--tiny", "--parts", "time", "--time-model", "revnet18", "--rounds", "1",
                                     "--calls", "1"])
    report = host_overhead.run(args, [])
    timed = report["time"]
    assert report["time_model"] == "revnet18" and timed["J"] == 10
    assert set(timed["seconds_per_call"]) == {"petra", "deepspeed_1f1b_one_stage", "torch_1f1b_one_stage", "plain",
                                              "plain_and_petra_forwards", "petra_structure", "petra_unchecked"}
    assert timed["petra_us_per_stage_clock"] == pytest.approx(timed["seconds_per_call"]["petra"] / (10 * args.k) * 1e6)


@pytest.mark.parametrize("name", host_overhead.MODELS)
def test_petra_s_work_without_its_engine_trains_as_a_synchronous_petra_call(world_of_one, name):
    """The ``petra_structure`` variant does PETRA's work, not less: one call trains the stages as PETRA's engine does
    in a call that drains (``synchronous_steps``), the same clipping and optimizer per stage, reconstructions
    included (RevGPT's middle stages rebuild their inputs, RevNet18's downsampling stages recompute theirs)."""
    args = host_overhead.parse_args(["--tiny", "--time-model", name, "--time-stages", "3", "--time-blocks", "4"])
    m, k = host_overhead.negligible_model(args), args.k
    engine = host_overhead.petra_engine(m, k, petra={"synchronous_steps": 1})
    kinds = {host_overhead.stage_kind(engine.stages[j]) for j in engine.stages}
    assert {"first", "reconstructing", "last"} <= kinds and (name == "revgpt" or "fifo" in kinds)
    engine.train_batch(host_overhead.data(m))
    module = host_overhead.petra_module(m)
    before = [p.detach().clone() for p in module.parameters()]
    host_overhead.structure_call(m, k, module)()
    pairs = list(zip(engine.module.parameters(), module.parameters(), before))
    assert all(not torch.equal(p, b) for _, p, b in pairs)  # every parameter took its step
    for theirs, ours, _ in pairs:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", host_overhead.MODELS)
def test_the_bytecode_part_counts_every_variant_by_package(world_of_one, name):
    """The benchmark's ``bytecodes`` part: each variant's count is the sum of its packages', the NaN watch's reports
    are bytecodes that ``check_finite: false`` does not interpret, and the engine interprets more than PETRA's work
    without it (petra_structure) and less than twice of it."""
    row = host_overhead.count_bytecodes(name, TINY, ("petra", "petra_unchecked", "petra_structure"))
    for variant, total in row["per_call"].items():
        assert sum(row["by_area"][variant].values()) == total > 0
    calls = row["per_call"]
    assert calls["petra_unchecked"] < calls["petra"]
    assert calls["petra_structure"] < calls["petra_unchecked"] < 2 * calls["petra_structure"]
    assert row["by_area"]["petra"]["petra_ds.runtime"] > row["by_area"]["petra_structure"].get("petra_ds.runtime", 0)


def test_the_offloads_add_one_copy_each_way_per_entry_and_message_and_nothing_else_to_a_fifo(world_of_one):
    """The benchmark's ``offload`` part, RevNet18 at J = 10 in one process: ``fifo_offload`` adds one copy out and one
    back per FIFO entry (each stage that keeps its input stores k a call) and one allocation per tensor, no byte
    views or rebuilt views (its entries' tensors own their storages); with ``message_offload`` too, every activation
    and gradient between the J stages also goes out and back once."""
    m, k = host_overhead.model("revnet18", TINY), TINY.k
    engine = host_overhead.petra_engine(m, k)
    keeping = sum(not stage.reconstructs and not stage.is_last for stage in engine.stages.values())
    row = host_overhead.count_offload("revnet18", TINY)
    fifo, both = row["added_ops"]["fifo_offload"], row["added_ops"]["fifo_and_message_offload"]
    assert set(fifo) == {"empty", "_foreach_copy_"} and fifo["_foreach_copy_"] == 2 * keeping * k > 0
    assert fifo["empty"] >= fifo["_foreach_copy_"]
    assert both["_foreach_copy_"] == 2 * keeping * k + 2 * (2 * (m["J"] - 1) * k)
    assert row["ops_per_call"]["petra"] < row["ops_per_call"]["fifo_offload"] < row["ops_per_call"][
        "fifo_and_message_offload"]


def test_the_engine_shifts_its_steady_clocks_instead_of_deriving_them(world_of_one):
    """RevNet18 at J = 10 in one process: in a steady train_batch the engine's schedule interprets at most 0.6x the
    bytecodes of deriving the same window from the clock equations (measured: 0.46x), so the engine keeps its
    templates across calls."""
    m, k = host_overhead.model("revnet18", TINY), TINY.k
    engine, stream = host_overhead.petra_engine(m, k), host_overhead.data(m)
    for _ in range(host_overhead.fill_calls(m["J"], k) + 1):
        engine.train_batch(stream)
    window = engine.timeline.train_window(k)
    with Bytecodes() as counter:
        engine.train_batch(stream)
    derived = PetraSchedule.for_window(window, 1, 0, stages_per_rank=m["J"], gradient_accumulation_steps=k,
                                       reversible=engine.reversible)
    with Bytecodes() as alone:
        clocks = list(derived)
    assert len(clocks) == k and sum(map(len, clocks)) > 190  # 198: no receives between the stages of one process
    assert 0 < counter.by_area["petra_ds.schedule"] <= 0.6 * alone.by_area["petra_ds.schedule"]
