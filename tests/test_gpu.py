"""PETRA on one CUDA device: NCCL as a world of one hosting all J stages, against the float64 CPU oracle.

Run on a machine with a GPU: ``pytest -m gpu tests/test_gpu.py -ra``. On CPU every test here is skipped
and ``-ra`` shows why. One spawned process (NCCL needs a fresh one) runs every engine configuration;
the tests compare what it recorded.

Tolerances, relative to the largest reference value of the compared set (max |got - ref| / max |ref|):

- fp32 (TF32 off): unit roundoff u = 2^-24 ~ 6e-8. Each forward / reconstruction / VJP op rounds
  once per dot-product term (length n <= 16 here) and the toy model is 9 layers deep (3 of them
  reconstructed, which adds the inversion's rounding), so even the worst case, (3 x 9) x 16 x u ~ 3e-5, is
  inside FP32_TOL = 1e-4, while TF32 (u = 2^-11) or a stray bf16 cast (2^-8) lands at 1e-3 .. 1e-2 and fails.
- bf16 autocast with fp32 streams and parameters: F and G see their inputs rounded to bf16 (u = 2^-9
  ~ 2e-3) and accumulate in fp32; per layer ~ sqrt(n) u ~ 8e-3 in the worst dot product, adding up like
  a random walk over ~18 rounded evaluations (9 layers forward, 9 backward): sqrt(18) x 8e-3 ~ 3e-2.
  BF16_TOL = 1e-1 leaves ~3x, still an order of magnitude below what a wrong gradient (a stale or missing
  term) gives. The reconstruction itself stays exact to fp32 rounding: F and G are evaluated under
  the same autocast as in the forward, on the same fp32 stream values, so the error bound
  (RECONSTRUCTION_TOL, the CPU bf16 test's) is the same as in fp32.
- ``reconstruct_overlap`` on vs off: bit for bit. The second stream runs the same kernels on the same
  values; a block's VJPs run on the stream its graph was built on, after events that order them as the
  plain order does, and GEMMs, reductions and keyed (Philox) dropout are deterministic run to run.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

import oracle
from harness import launch, model_for, run_rank
from petra_ds.runtime.graphed import GraphedForward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False); run on a GPU with -m gpu"),
]

FP32_TOL = 1e-4
BF16_TOL = 1e-1
FP16_TOL = 2e-2  # fp16's u = 2^-11 in the bf16 bound's place; per-stage loss scales are exact powers of two
RECONSTRUCTION_TOL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

J, K, BATCHES = 3, 2, 4  # J = 3: stage 1 reconstructs three blocks (Swap, Additive, Swap)
FROZEN = {"type": "SGD", "params": {"lr": 0.0}}
SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
FUSED_SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "fused": True}}
BASE = {"pipe": 1, "stages_per_rank": J, "k": K, "train_batches": BATCHES, "dtype": "float32", "dropout": 0.0}
RUNS = {
    "fp32": {"optimizer": FROZEN},
    "bf16": {"optimizer": FROZEN, "bf16": True},
    "fp32_sgd": {"optimizer": SGD},
    "bf16_sgd": {"optimizer": SGD, "bf16": True},
    "fp16": {"optimizer": FROZEN, "config": {"fp16": {"enabled": True}}},
    "fp16_sgd": {"optimizer": SGD, "config": {"fp16": {"enabled": True}}},
    # every evaluation casting the weights anew, as without a clock's shared casts (petra_ds/nn/casts.py)
    "bf16_sgd_casts_anew": {"optimizer": SGD, "bf16": True, "casts_anew": True},
    "revgpt_fp32": {"optimizer": FROZEN, "model": "revgpt"},
    "revgpt_bf16": {"optimizer": FROZEN, "model": "revgpt", "bf16": True},
    "fp32_sgd_overlap": {"optimizer": SGD, "petra": {"reconstruct_overlap": True}},
    "bf16_sgd_overlap": {"optimizer": SGD, "bf16": True, "petra": {"reconstruct_overlap": True}},
    # dropout on CUDA (keyed Philox streams), frozen so that x~ = x up to rounding (with lr > 0 the
    # reconstruction uses newer weights: PETRA's approximation, not an error)
    "dropout": {"optimizer": FROZEN, "dropout": 0.1, "track_reconstruction": True},
    "dropout_overlap": {"optimizer": FROZEN, "dropout": 0.1, "track_reconstruction": True,
                        "petra": {"reconstruct_overlap": True}},
    "bf16_dropout": {"optimizer": FROZEN, "dropout": 0.1, "bf16": True, "track_reconstruction": True},
    "bf16_dropout_overlap": {"optimizer": FROZEN, "dropout": 0.1, "bf16": True, "track_reconstruction": True,
                             "petra": {"reconstruct_overlap": True}},
    # "petra": {"compile": true}: inductor with keyed dropout
    "dropout_compiled": {"optimizer": FROZEN, "dropout": 0.1, "track_reconstruction": True,
                         "petra": {"compile": True}},
    # "petra": {"cuda_graphs": true}: training, bf16 autocast, keyed dropout, RevGPT's attention, replayed graphs
    "fp32_sgd_graphs": {"optimizer": SGD, "petra": {"cuda_graphs": True}},
    "bf16_sgd_graphs": {"optimizer": SGD, "bf16": True, "petra": {"cuda_graphs": True}},
    "dropout_graphs": {"optimizer": FROZEN, "dropout": 0.1, "track_reconstruction": True,
                       "petra": {"cuda_graphs": True}},
    "revgpt_bf16_graphs": {"optimizer": FROZEN, "model": "revgpt", "bf16": True, "petra": {"cuda_graphs": True}},
    # RevNet18 (J = 10) with torch's fused SGD, which pairs a weight's elements with its gradient's in memory order,
    # contiguous and converted to channels-last before initialize (cuDNN's NHWC kernels)
    "revnet_fused": {"optimizer": FUSED_SGD, "model": "revnet", "stages_per_rank": 10},
    "revnet_fused_channels_last": {"optimizer": FUSED_SGD, "model": "revnet", "stages_per_rank": 10,
                                   "before_initialize": "test_gpu:channels_last"},
}


def channels_last(model: torch.nn.Module) -> None:
    """(before_initialize, in the rank) the model to channels-last, as PyTorch's recipe converts it."""
    model.to(memory_format=torch.channels_last)


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _run(spec: dict) -> dict:
    """``run_rank`` on the GPU, with the engine's device, backend and side streams; ``"casts_anew"``: no clock shares
    its bf16 casts."""
    import contextlib

    import petra_ds
    import petra_ds.runtime.local_stages as local_stages
    from petra_ds.nn.casts import shares_casts

    initialize, clock_casts = petra_ds.initialize, local_stages.clock_casts
    seen = {}

    def initialize_and_note(*args, **kwargs):
        out = initialize(*args, **kwargs)
        seen["engine"] = out[0]
        return out

    petra_ds.initialize = initialize_and_note
    spec = dict(spec)
    if spec.pop("casts_anew", False):
        local_stages.clock_casts = contextlib.nullcontext
    try:
        result = run_rank({**BASE, **spec})
    finally:
        petra_ds.initialize, local_stages.clock_casts = initialize, clock_casts
    result["shares_casts"] = shares_casts()
    engine = seen.pop("engine")
    result["device"] = str(engine.device)
    result["channels_last"] = any(p.dim() == 4 and p.stride(-1) != 1 for p in engine.module.parameters())
    result["backend"] = torch.distributed.get_backend()
    result["side_streams"] = {j: st.side_stream is not None for j, st in engine.stages.items()}
    result["graph_replays"] = sum(m.forward.replays for m in engine.module.modules()
                                  if isinstance(m.__dict__.get("forward"), GraphedForward))
    return _cpu(result)


def _all_runs(_spec: dict) -> dict:
    """Every configuration of :data:`RUNS`; one that raises leaves its traceback, and the others still run."""
    import traceback

    import petra_ds

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (TF32 would cost 1e-3, see the top)
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(0)
    petra_ds.init_distributed(dist_backend="nccl")  # run_rank's gloo request then finds it initialized
    results = {}
    for name, spec in RUNS.items():
        try:
            results[name] = _run(spec)
        except Exception:  # noqa: BLE001 - reported by the tests that read this run
            results[name] = {"error": traceback.format_exc()}
    return results


class Runs(dict):
    """The runs by name; reading one that raised fails the reading test with the run's traceback."""

    def __getitem__(self, name: str) -> dict:
        result = super().__getitem__(name)
        if "error" in result:
            pytest.fail(f"the GPU run {name!r} raised:\n{result['error']}")
        return result


@functools.lru_cache(maxsize=None)
def runs() -> Runs:
    # fresh: the runs set process-wide CUDA flags (TF32 off, the device) that a pooled process would keep; spawned,
    # not forked from the pool's server, so that CUDA is first initialised in the rank itself
    (results,) = launch({}, world_size=1, target=_all_runs, timeout=900, fresh="spawn")
    return Runs(results)


def rel(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys() and got
    scale = max(r.abs().max().item() for r in ref.values())
    return max((got[n].double() - ref[n]).abs().max().item() for n in got) / scale


def oracle_for(name: str):
    """The float64 CPU oracle's stages with the run's own float32 initial weights, and the run's data."""
    spec = {**BASE, **RUNS[name]}
    layer_specs, loss_fn, data_fn = model_for(spec)
    torch.set_default_dtype(torch.float32)  # the run's: token_data's noise draws depend on it
    data = [(x.double() if x.is_floating_point() else x, y)
            for x, y in data_fn(K * BATCHES, spec.get("micro_batch", 4), 0, torch.float32)]
    stages = oracle.build_stages(J, dropout=spec["dropout"], specs=layer_specs)  # float64 from here
    frozen = "revgpt_fp32" if spec.get("model") == "revgpt" else "fp32"  # lr 0: final weights = initial ones
    initial = runs()[frozen]["params"]
    with torch.no_grad():
        for stage in stages:
            for n, p in oracle.named_params(stage).items():
                p.copy_(initial[n].double())
    return stages, data, loss_fn


def test_it_ran_on_the_gpu_with_nccl_as_a_world_of_one():
    for name in RUNS:
        result = runs()[name]
        assert result["device"].startswith("cuda") and result["backend"] == "nccl", name
        assert result["stages"] == list(range(RUNS[name].get("stages_per_rank", J))), name
        assert result["reconstructs"][1], name
        assert result["side_streams"][1] == bool(RUNS[name].get("petra", {}).get("reconstruct_overlap")), name
        assert (result["graph_replays"] > 0) == bool(RUNS[name].get("petra", {}).get("cuda_graphs")), name


@pytest.mark.parametrize("name,tol", [("fp32", FP32_TOL), ("bf16", BF16_TOL), ("fp16", FP16_TOL),
                                      ("revgpt_fp32", FP32_TOL), ("revgpt_bf16", BF16_TOL),
                                      ("revgpt_bf16_graphs", BF16_TOL)])
def test_frozen_gradients_match_the_float64_oracle(name, tol):
    """lr = 0: every stage's gradient of every step is plain autograd's (the lr = 0 oracle of tests/oracle.py)."""
    stages, data, loss_fn = oracle_for(name)
    grads = runs()[name]["grads"]
    for step in range(BATCHES):
        ref = oracle.autograd_group_grads(stages, data, range(step * K, (step + 1) * K), 0, loss=loss_fn)
        for j in range(J):
            assert rel(grads[j][step], ref[j]) < tol, (name, step, j)


@pytest.mark.parametrize("name,tol", [("fp32_sgd", FP32_TOL), ("bf16_sgd", BF16_TOL), ("fp16_sgd", FP16_TOL),
                                      ("fp32_sgd_graphs", FP32_TOL), ("bf16_sgd_graphs", BF16_TOL)])
def test_training_matches_the_float64_delayed_reference(name, tol):
    """lr > 0: the parameters after 4 steps are PETRA's clock replayed in float64 (``oracle.delayed_training``);
    the error is measured against how far training moved them."""
    stages, data, _ = oracle_for(name)
    start = {n: p.detach().clone() for s in stages for n, p in oracle.named_params(s).items()}
    final, _ = oracle.delayed_training(stages, data, K, 0.1, 0.9, 0)
    got = runs()[name]["params"]
    moved = max((final[n] - start[n]).abs().max().item() for n in final)
    assert moved > 1e-3
    error = max((got[n].double() - final[n]).abs().max().item() for n in final)
    assert error / moved < tol, (name, error, moved)


@pytest.mark.parametrize("name", ["fp32_sgd", "bf16_sgd", "dropout", "bf16_dropout"])
def test_overlap_on_cuda_changes_no_bit(name):
    off, on = runs()[name], runs()[name + "_overlap"]
    for n in off["params"]:
        assert torch.equal(on["params"][n], off["params"][n]), n
    for j, steps in off["grads"].items():
        for a, b in zip(steps, on["grads"][j]):
            assert all(torch.equal(a[n], b[n]) for n in a), j
    assert on["reconstruction_errors"] == off["reconstruction_errors"]


def test_sharing_a_clock_s_bf16_casts_on_cuda_changes_no_bit():
    """bf16 training whose clocks share each weight's cast between the forward and the reconstruction (when this
    torch keeps a cast cached under no_grad differentiable) against every evaluation casting anew: the same bits."""
    shared, anew = runs()["bf16_sgd"], runs()["bf16_sgd_casts_anew"]
    for n in anew["params"]:
        assert torch.equal(shared["params"][n], anew["params"][n]), (n, shared["shares_casts"])
    for j, steps in anew["grads"].items():
        for a, b in zip(steps, shared["grads"][j]):
            assert all(torch.equal(a[n], b[n]) for n in a), (j, shared["shares_casts"])


@pytest.mark.parametrize("name", ["dropout", "dropout_overlap", "bf16_dropout", "bf16_dropout_overlap"])
def test_reconstruction_with_dropout_on_cuda_is_exact_to_fp32_rounding(name):
    errors = runs()[name]["reconstruction_errors"][1]
    assert len(errors) == K * BATCHES
    assert max(errors) < RECONSTRUCTION_TOL, errors


def test_compiled_stages_on_cuda_train_as_eager_ones_do():
    """Compiled F, G and layers (inductor) against eager on the same frozen run: the same gradients to fp32
    rounding, and the reconstruction with keyed dropout still exact."""
    name = "dropout_compiled"
    eager, compiled = runs()["dropout"], runs()[name]
    for j, steps in eager["grads"].items():
        for a, b in zip(steps, compiled["grads"][j]):
            assert rel(b, a) < FP32_TOL, (name, j)
    assert max(compiled["reconstruction_errors"][1]) < RECONSTRUCTION_TOL


def test_graphed_stages_on_cuda_train_as_eager_ones_do():
    """Replayed CUDA graphs against eager on the same runs: the same gradients and weights to fp32 rounding (the
    same kernels; keyed dropout draws its masks from the seed the keyed scope set, at the same Philox offsets), and
    the reconstruction with dropout still exact, which fails if the forward's and the reconstruction's graphs drew
    different masks."""
    for eager, graphed in (("dropout", "dropout_graphs"), ("fp32_sgd", "fp32_sgd_graphs")):
        for j, steps in runs()[eager]["grads"].items():
            for a, b in zip(steps, runs()[graphed]["grads"][j]):
                assert rel(b, a) < FP32_TOL, (graphed, j)
    assert rel(runs()["fp32_sgd_graphs"]["params"], runs()["fp32_sgd"]["params"]) < FP32_TOL
    assert max(runs()["dropout_graphs"]["reconstruction_errors"][1]) < RECONSTRUCTION_TOL


def test_a_channels_last_revnet_on_cuda_trains_as_a_contiguous_one():
    """cuDNN's NHWC convolutions and torch's fused SGD on channels-last weights: every step's gradients and the final
    weights equal the contiguous run's to fp32 rounding (a gradient paired with its weight in the wrong order is off
    by the weights' scale)."""
    contiguous, converted = runs()["revnet_fused"], runs()["revnet_fused_channels_last"]
    assert converted["channels_last"] and not contiguous["channels_last"]
    for j, steps in contiguous["grads"].items():
        for a, b in zip(steps, converted["grads"][j]):
            assert rel(b, a) < FP32_TOL, j
    assert rel(converted["params"], contiguous["params"]) < FP32_TOL


def test_benchmark_script_runs_on_the_gpu(tmp_path):
    """``python -m benchmarks.gpu --tiny`` end to end on CUDA: peak memory of PETRA and plain backprop recorded."""
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--tiny", "--output", str(out)], cwd=ROOT, check=True,
                   timeout=600)
    report = json.loads(out.read_text())
    assert report["device_type"] == "cuda"
    for row in report["memory"]:
        assert row["petra_peak_bytes"] > 0 and row["plain_peak_bytes"] > 0, row
        assert row["petra_reserved_peak_bytes"] > 0 and row["plain_reserved_peak_bytes"] > 0, row
        for v in ("petra", "petra_offload", "petra_offload_messages"):  # memory_report names no byte CUDA does not
            assert 0 < row[f"{v}_explained_bytes"] <= row[f"{v}_allocated_after_bytes"], (v, row)  # hold
        if row["model"] == "revnet18":  # its downsampling stages keep FIFOs: in host memory with the offload
            offloaded, kept = row["petra_offload_memory_report"], row["petra_memory_report"]
            assert offloaded["fifo_host"] > 0 and offloaded["input_buffer"] < kept["input_buffer"], row
        parked = row["petra_offload_messages_memory_report"]  # one process: every message between its stages
        assert parked["messages"] == 0 and parked["messages_host"] == row["petra_memory_report"]["messages"], row
    assert {row["model"] for row in report["memory"]} == {"revnet18", "revgpt"}
    for row in report["time"]:  # the device cannot be busy longer than the call, nor longer than its kernels ran
        for v in ("plain", "petra"):
            busy = row[f"{v}_device_busy_seconds_per_call"]
            assert 0 < busy <= row[f"{v}_device_seconds_per_call"] * (1 + 1e-9), (v, row)
            assert busy <= row[f"{v}_profiled_wall_seconds_per_call"], (v, row)
        kinds = row["petra_host_by_instruction"]  # a backward's kernels, launched by autograd's thread, count too
        assert kinds["ForwardPass"]["device_seconds"] > 0 and kinds["DelayedBackward"]["device_seconds"] > 0, row
        for v in ("plain", "petra"):  # autograd runs a CUDA backward on its device thread: the split sees it there
            split = row[f"{v}_host_by_op"]
            assert split["self_seconds"]["other"] > 0 and split["top"], (v, split)


def synchronising_calls(caught: list) -> list[str]:
    """The warnings ``set_sync_debug_mode("warn")`` raises for a synchronising call; not its once-per-process
    notice that the mode is a prototype (torch 2.11 words both with "synchroniz")."""
    return [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]


def _steady_state_syncs(_spec: dict) -> dict:
    """Per model of ``python -m benchmarks.host_overhead`` (CI sizes, fused AdamW, clipping): the synchronising CUDA
    calls ``torch.cuda.set_sync_debug_mode("warn")`` reports during one steady-state ``train_batch``."""
    import warnings

    import petra_ds

    from benchmarks.lib import host_overhead

    torch.cuda.set_device(0)
    petra_ds.init_distributed(dist_backend="nccl")
    args = host_overhead.parse_args(["--tiny"])
    found = {}
    for name in host_overhead.MODELS:
        m = host_overhead.model(name, args)
        engine = host_overhead.petra_engine(m, args.k)
        stream = host_overhead.data(m)
        for _ in range(host_overhead.fill_calls(m["J"], args.k)):
            engine.train_batch(stream)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.train_batch(stream)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found[name] = synchronising_calls(caught)
    return found


def test_a_steady_state_train_batch_synchronises_once():
    """What ``HostSyncs`` counts on CPU (tests/test_host_overhead.py), seen by CUDA itself: the window's one read
    of its loss and NaN / Inf checks, nothing per clock, micro-batch or step."""
    (found,) = launch({}, world_size=1, target=_steady_state_syncs, timeout=600, fresh="spawn")
    for name, syncs in found.items():
        assert len(syncs) <= 1, (name, syncs)


#: the toy model at J = 4 in one process, every stage but the ends keeping its inputs (stage 1: 5 entries deep)
OFFLOAD = {"pipe": 1, "stages_per_rank": 4, "k": 2, "train_batches": 5, "dtype": "float32", "dropout": 0.1,
           "optimizer": SGD, "memory_trace": True}


def _offload_runs(_spec: dict) -> dict:
    """The same training with ``fifo_offload`` "none" and "cpu" on CUDA, and the synchronising CUDA calls
    ``torch.cuda.set_sync_debug_mode("warn")`` reports during each whole run."""
    import warnings

    import petra_ds

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.set_device(0)
    petra_ds.init_distributed(dist_backend="nccl")
    found = {}
    for name, petra in (("none", {}), ("cpu", {"fifo_offload": "cpu"}), ("auto", {"fifo_offload": "auto"}),
                        ("messages", {"fifo_offload": "cpu", "message_offload": "cpu"})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = run_rank({**OFFLOAD, "petra": {"input_buffer": "all", **petra},
                                   "setup": "test_gpu:keep_the_planner", "probe": "test_gpu:planner_decisions"})
            finally:
                torch.cuda.set_sync_debug_mode("default")
        result["syncs"] = synchronising_calls(caught)
        found[name] = _cpu(result)
    return found


@functools.lru_cache(maxsize=None)
def offload_runs() -> dict:
    """The runs of :func:`_offload_runs`, launched once for the tests that read them."""
    (found,) = launch({}, world_size=1, target=_offload_runs, timeout=600, fresh="spawn")
    return found


_planners: list = []


def keep_the_planner(engine) -> None:
    """The engine's own ``fifo_offload: "auto"`` planner, if it made one (it leaves the observers once decided)."""
    from petra_ds.runtime.offload_plan import OffloadPlanner

    _planners[:] = [o for o in engine.observers if isinstance(o, OffloadPlanner)]


def planner_decisions(engine) -> dict | None:
    return _planners[0].decisions if _planners else None


def test_fifo_offload_auto_on_cuda_decides_every_stage_and_changes_no_bit():
    """"auto" measures the link and each stage's forward in the first train_batch and decides each stage that keeps
    inputs (stage 0's micro-batches, stages 1 and 2's FIFOs), by the rule of ``runtime/offload_plan.py``; whatever
    it decides, training equals training without the offload bit for bit."""
    from petra_ds.runtime.offload_plan import copies_hide

    found = offload_runs()
    plain, auto = found["none"], found["auto"]
    for n in plain["params"]:
        assert torch.equal(auto["params"][n], plain["params"][n]), n
    decisions = auto["probe"]
    assert plain["probe"] is None and sorted(decisions) == [0, 1, 2], decisions
    for d in decisions.values():
        assert d["forward_s"] > 0 and d["entry_bytes"] > 0
        assert d["offload"] == (d["copies_s"] <= 3 * d["forward_s"]) == copies_hide(
            d["entry_bytes"], 2 * d["entry_bytes"] / d["copies_s"], d["forward_s"])


def assert_trained_alike(plain: dict, other: dict) -> None:
    """The same parameters and every step's gradients bit for bit, and no synchronising call more."""
    for n in plain["params"]:
        assert torch.equal(other["params"][n], plain["params"][n]), n
    for j, steps in plain["grads"].items():
        for a, b in zip(steps, other["grads"][j], strict=True):
            assert all(torch.equal(a[n], b[n]) for n in a), j
    assert len(other["syncs"]) == len(plain["syncs"]), (other["syncs"], plain["syncs"])


def test_fifo_offload_on_cuda_changes_no_bit_and_adds_no_host_sync():
    """Entries copied to pinned host memory on a side stream and back one clock before their backward, ordered
    by events: the same parameters and gradients bit for bit, no synchronising call more than without the offload,
    and between clocks only each FIFO's head on the device."""
    found = offload_runs()
    assert_trained_alike(found["none"], found["cpu"])
    entries = [entry for _, report in found["cpu"]["memory"] for entry in report.values()]
    assert max(entry["fifo_host"] for entry in entries) > 0
    assert all(entry["input_buffer_micro_batches"] <= 1 for entry in entries)


def test_message_offload_on_cuda_changes_no_bit_and_adds_no_host_sync():
    """With the FIFOs, the messages between the four stages of the process parked in pinned host memory on the side
    stream and brought back one instruction before their readers: the same bits, no synchronising call more, and
    between clocks no message left on the device."""
    found = offload_runs()
    assert_trained_alike(found["none"], found["messages"])
    entries = [entry for _, report in found["messages"]["memory"] for entry in report.values()]
    assert max(entry["messages_host"] for entry in entries) > 0 and all(entry["messages"] == 0 for entry in entries)


def test_the_nan_watch_fuses_its_reduction_over_contiguous_tensors_beside_the_halves_of_a_coupling():
    """Forty contiguous tensors and the two channel halves of a coupling's output, as RevNet18's first stages report
    them: torch's foreach norm reduces the halves one by one and must not take the forty with them (an H200 ran
    one reduction per tensor, 218 a RevNet18 call); the values, by the order given, are each tensor's max |x|."""
    from torch.profiler import ProfilerActivity, profile

    from petra_ds.runtime.finite import max_abs_each

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(64, 32, device="cuda", generator=g) for _ in range(40)]
    tensors += list(torch.randn(8, 16, 4, 4, device="cuda", generator=g).chunk(2, dim=1))
    max_abs_each(tensors)  # warm-up: the kernels' first launch is not what is counted
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        maxima, order = max_abs_each(tensors)
        torch.cuda.synchronize()
    per_tensor = [e.name for e in prof.events() if "AbsMax" in e.name and e.device_type.name == "CUDA"]
    assert len(per_tensor) == 2, per_tensor
    for value, i in zip(maxima.tolist(), order or range(len(tensors))):
        assert value == tensors[i].abs().max().item(), i
