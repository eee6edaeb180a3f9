"""``"petra": {"cuda_graphs": ...}``: the parts of every stage replaying graphs, checked on CPU with the eager
stand-ins of ``"emulate"`` against the same engine without graphs, bit for bit; the replay rules themselves
(results copied out, a VJP only after its own forward) on one part. On a GPU: tests/test_gpu.py."""

import pytest
import torch
from harness import assert_same_bits, launch

from petra_ds.diagnostics.settings import format_settings
from petra_ds.runtime.config import PetraConfig, PetraConfigError
from petra_ds.runtime.graphed import MAX_SIGNATURES, graph_layers

J, K = 3, 2
SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
#: the toy (Stem, Mixes, Head, and couplings) at J = 3 in one process, 4 windows of k = 2 and a drain, with dropout
TOY = {"pipe": 1, "stages_per_rank": J, "k": K, "train_batches": 4, "dropout": 0.1, "optimizer": SGD}


def graphed_parts(engine) -> dict:
    """(in the rank) each graphed part's signatures captured and graphs replayed, and the module's state, running
    statistics included."""
    return {"parts": [(f.captured, f.replays) for st in engine.stages.values() for f in st.graphed],
            "state": {n: t.detach().clone() for n, t in engine.module.state_dict().items()}}


@pytest.mark.parametrize("batchnorm", [False, True], ids=["dropout", "dropout+batchnorm"])
@pytest.mark.parametrize("extra", [{}, {"fifo_offload": "cpu", "input_buffer": "all"}], ids=["", "fifo"])
def test_emulated_graphs_train_as_eager_parts_do_bit_for_bit(batchnorm, extra):
    """Keyed dropout, batch norms' running statistics (updated once per micro-batch, in the reconstruction, though
    each capture runs a part three times), parameter and input gradients: the same bits over 4 windows and a drain,
    every stage's parts replaying their graphs (one without grad for the forward, one with for the backward)."""
    spec = {**TOY, "batchnorm": batchnorm, "probe": "test_cuda_graphs:graphed_parts"}
    eager = launch({**spec, "petra": extra})
    graphed = launch({**spec, "petra": {**extra, "cuda_graphs": "emulate"}})
    assert_same_bits(graphed, eager)
    (eager_probe,), (probe,) = [r["probe"] for r in eager], [r["probe"] for r in graphed]
    assert eager_probe["parts"] == [] and len(probe["parts"]) == 12  # the Stem, Mixes and Head, couplings' F and G
    assert all(captured == 2 for captured, _ in probe["parts"])
    replays = sorted(replayed for _, replayed in probe["parts"])  # the last stage's 4 parts: no reconstruction
    assert min(replays[:4]) >= 4 * K and min(replays[4:]) >= 2 * 4 * K, replays
    state, eager_state = probe["state"], eager_probe["state"]
    assert state.keys() == eager_state.keys()  # graphed in place: the same names, the same checkpoints
    for name, value in eager_state.items():
        assert torch.equal(state[name], value), name


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x):
        return torch.tanh(self.norm(self.linear(x)))


def graphed_tiny():
    torch.manual_seed(0)
    module = Tiny().double()
    (forward,) = graph_layers([module], "emulate", "cpu")
    return module, forward


def test_a_replay_leaves_earlier_results_alone():
    """What a part returned is the caller's: the next replay of the same graph writes only its own memory."""
    module, forward = graphed_tiny()
    with torch.no_grad():
        first = module(torch.ones(4, 3, dtype=torch.float64))
        kept = first.clone()
        second = module(torch.full((4, 3), 2.0, dtype=torch.float64))
    assert torch.equal(first, kept) and not torch.equal(first, second)
    assert forward.captured == 1 and forward.replays == 2


def test_gradients_come_from_the_graph_and_match_eager():
    """A signature with grad runs eagerly once (noting how its gradients come laid out), then replays."""
    module, forward = graphed_tiny()
    eager = Tiny().double()
    eager.load_state_dict(module.state_dict())
    for call in range(3):
        x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        for m in (module, eager):
            dx, *dparams = torch.autograd.grad(m(x).square().sum(), [x, *m.parameters()])
            m.results = dx, dparams
        assert forward.captured == min(call, 1) and forward.replays == 2 * call  # its forward and its VJP
        assert torch.equal(module.results[0], eager.results[0])
        assert all(map(torch.equal, module.results[1], eager.results[1]))
        assert torch.equal(module.norm.running_mean, eager.norm.running_mean)  # one update, not the capture's three


def test_a_backward_after_another_forward_of_its_graph_raises():
    """The VJP graph reads what the latest forward replay saved: an older forward's backward would get another
    micro-batch's gradients, so it fails, naming the setting to turn off."""
    module, forward = graphed_tiny()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    module(x).sum().backward()  # the signature's eager call
    older = module(x).sum()
    assert forward.captured == 1
    module(x * 2).sum().backward()  # the latest forward's own backward is fine
    with pytest.raises(RuntimeError, match='another micro-batch.*"petra.cuda_graphs": false'):
        older.backward()


def test_evaluation_keywords_and_new_signatures_beyond_the_cap_run_eagerly():
    module, forward = graphed_tiny()
    module.eval()
    with torch.no_grad():
        module(torch.ones(4, 3, dtype=torch.float64))
    assert forward.captured == 0 and forward.replays == 0
    module.train()
    with torch.no_grad(), pytest.warns(UserWarning, match=f"more than {MAX_SIGNATURES} argument signatures"):
        for rows in range(2, MAX_SIGNATURES + 4):
            module(torch.ones(rows, 3, dtype=torch.float64))
    assert forward.captured == MAX_SIGNATURES and forward.replays == MAX_SIGNATURES


def test_true_needs_a_cuda_device():
    with pytest.raises(ValueError, match='"petra.cuda_graphs": true needs a CUDA device.*"emulate"'):
        graph_layers([Tiny()], True, "cpu")


@pytest.mark.parametrize("value", [1, "yes", None, [True]])
def test_cuda_graphs_takes_true_false_or_emulate(value):
    with pytest.raises(PetraConfigError, match='"petra.cuda_graphs" must be true, false or "emulate"'):
        PetraConfig.from_dict({"cuda_graphs": value})


@pytest.mark.parametrize("other", [{"compile": True}, {"reconstruct_overlap": True}])
def test_settings_graphs_cannot_serve_are_refused_with_what_to_change(other):
    with pytest.raises(PetraConfigError, match='"petra.cuda_graphs" cannot be combined with .*turn one of them off'):
        PetraConfig.from_dict({"cuda_graphs": True, **other})
    assert PetraConfig.from_dict({"cuda_graphs": False, **other}).cuda_graphs is False


def graph_memory(engine) -> dict:
    """(in the rank) per stage, the graphs' bytes as the memory report and the holdings see them, and as their
    static tensors add up; whether any is a weight itself; and what rank 0 printed."""
    report, stages = engine.memory_report(), {}
    for j, stage in engine.stages.items():
        held = [t for graphed in stage.graphed for t in graphed.held()]
        weights = {p.untyped_storage().data_ptr() for p in stage.params}
        stages[j] = {"reported": report[j]["graphs"], "pools": report[j]["graph_pools"],
                     "held": sum(t.numel() * t.element_size() for t in held),
                     "holdings": engine.holdings(j).categories()["graphs"] == tuple(held),
                     "weights": bool(weights & {t.untyped_storage().data_ptr() for t in held})}
    return {"stages": stages, "printed": format_settings(engine.run_settings)}


def test_memory_report_names_what_the_graphs_hold():
    """The graphs' static tensors are a stage's ``graphs`` bytes (and the held-bytes tracker's category); the eager
    stand-ins reserve no pool."""
    (result,) = launch({**TOY, "dropout": 0.0, "batchnorm": True, "train_batches": 3, "drain": False,
                        "petra": {"cuda_graphs": "emulate"}, "probe": "test_cuda_graphs:graph_memory"})
    for j, stage in result["probe"]["stages"].items():
        assert stage["reported"] == stage["held"] > 0 and stage["holdings"], (j, stage)
        assert stage["pools"] == 0
        assert not stage["weights"]  # copies, not the weights themselves
    assert "CUDA graphs (eager stand-ins): 12 parts of this rank's stages replay graphs" in result["probe"]["printed"]


class Syncing(torch.nn.Module):
    """A batch norm whose momentum is None: its running average's factor is 1 / num_batches_tracked, read on the
    host at every call."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(3, momentum=None)

    def forward(self, x):
        return self.norm(x)


def test_a_part_that_reads_device_values_on_the_host_is_refused_at_capture_with_what_to_do():
    module = Syncing().double()
    graph_layers([module], "emulate", "cpu")
    with pytest.raises(RuntimeError, match=r'cuda_graphs": Syncing cannot be captured.*_local_scalar_dense.*'
                                           r'"petra.cuda_graphs": false'), torch.no_grad():
        module(torch.randn(4, 3, dtype=torch.float64))


@pytest.mark.parametrize("spec", [
    pytest.param({"model": "revnet", "micro_batch": 2, "dropout": 0.0}, id="revnet18"),
    pytest.param({"model": "revgpt", "micro_batch": 2, "dropout": 0.1}, id="revgpt-dropout"),
    pytest.param({"model": "decoder", "micro_batch": 2, "dropout": 0.1}, id="llama-decoder-dropout"),
    pytest.param({"model": "revgpt", "micro_batch": 2, "dropout": 0.1, "petra": {"delay_compensation":
                                                                            "weight_prediction"}},
                 id="revgpt-weight-prediction")])
def test_two_ranks_train_the_same_bits_with_emulated_graphs(spec):
    """RevNet18 (batch norms, downsampling stages keeping FIFOs), RevGPT (attention, keyed dropout, token ids into
    the embedding) and the Llama-style decoder (Hugging Face's attention and MLP modules, rotary positions) at J = 4
    on two ranks, and RevGPT with weight prediction (its forwards on predicted weights, written into the weights'
    storage a graph reads): parameters and every step's gradients as without graphs."""
    common = {**spec, "pipe": 2, "stages_per_rank": 2, "k": 2, "train_batches": 3, "optimizer": SGD}
    graphed = launch({**common, "petra": {**spec.get("petra", {}), "cuda_graphs": "emulate"},
                      "probe": "test_cuda_graphs:replays"})
    assert all(r["probe"] >= 2 * 3 * 2 for r in graphed)  # every rank's parts replayed, forwards and backwards
    assert_same_bits(graphed, launch(common))


def replays(engine) -> int:
    """The replays of the parts of a rank's first stage (run in the rank)."""
    return min(f.replays for f in next(iter(engine.stages.values())).graphed)


def test_a_parameter_moved_to_other_memory_fails_the_next_replay():
    """A graph reads the memory its parameters had at capture: one whose ``.data`` was reassigned would be read stale
    on CUDA, so the replay refuses it (the eager stand-ins too, as they must find what a graph would miss)."""
    module, _ = graphed_tiny()
    x = torch.ones(4, 3, dtype=torch.float64)
    with torch.no_grad():
        module(x)
        module.linear.weight.data = module.linear.weight.data.clone()
        with pytest.raises(RuntimeError, match=r'other memory than when its graph was captured.*in place'):
            module(x)
