"""``python -m benchmarks.gpu``'s reading of a profiled call: how long the device was busy against the kernel time
summed, which is what tells a host-bound call from a device-bound one."""

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from benchmarks.lib.single_gpu import (DeviceMemory, channels_last_share, host_by_instruction, host_by_op, host_line,
                                       kernel_group, kernel_summary, micro_batches, model, parse_args, run_petra,
                                       run_plain, to_layout)
from petra_ds.runtime.observe import INSTRUCTION_LABEL


def test_busy_time_counts_overlapping_work_once():
    work = [("void cudnn::conv_fwd", 0.0, 100.0),  # two streams: the copy runs under the convolution
            ("Memcpy DtoH (Device -> Pinned)", 50.0, 150.0),
            ("at::native::vectorized_elementwise_kernel", 300.0, 310.0),  # after an idle gap of 150 us
            ("at::native::vectorized_elementwise_kernel", 305.0, 308.0)]  # inside the one before
    summary = kernel_summary(work)
    assert summary["device_seconds"] == pytest.approx((100.0 + 100.0 + 10.0 + 3.0) / 1e6)
    assert summary["device_busy_seconds"] == pytest.approx((150.0 + 10.0) / 1e6)
    assert summary["device_groups"]["elementwise"] == {"seconds": pytest.approx(13e-6), "count": 2}
    assert summary["top_kernels"][0]["count"] == 1 and summary["top_kernels"][-1]["count"] == 2


def test_no_device_work_is_zero_not_an_error():
    assert kernel_summary([]) == {"device_seconds": 0.0, "device_busy_seconds": 0.0, "device_groups": {},
                                  "top_kernels": []}


def test_kernels_are_grouped_by_what_they_compute():
    assert kernel_group("sm90_xmma_fprop_implicit_gemm_bf16") == "convolution"
    assert kernel_group("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "matmul"
    assert kernel_group("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert kernel_group("bn_fw_tr_1C11_kernel_NCHW") == "norm"
    assert kernel_group("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert kernel_group("void at::native::multi_tensor_apply_kernel<LpNormFunctor>") == "multi-tensor"
    assert kernel_group("void at::native::batch_norm_collect_statistics_kernel") == "norm"
    assert kernel_group("void at::native::(anonymous namespace)::fused_adamw_kernel") == "optimizer"
    assert kernel_group("Memset (Device)") == "memset"
    assert kernel_group("void at::native::unrolled_elementwise_kernel<copy>") == "cast"
    assert kernel_group("some_new_kernel") == "other"


def test_host_time_is_summed_by_instruction_kind_from_the_engine_s_labels():
    def event(key, device_type=DeviceType.CPU, us=0.0, count=1):
        return SimpleNamespace(key=key, device_type=device_type, cpu_time_total=us, count=count)

    events = [event("petra ForwardPass(buffer_id=0)", us=30.0, count=2),
              event("petra ForwardPass(buffer_id=1)", us=10.0),
              event("petra DelayedBackward(buffer_id=0)", us=50.0),
              event("petra DelayedBackward(buffer_id=0)", DeviceType.CUDA, us=99.0),  # its span on the device
              event("aten::conv2d", us=500.0)]
    assert host_by_instruction(events) == {
        "DelayedBackward": {"seconds": pytest.approx(50e-6), "count": 1, "device_seconds": 0.0},
        "ForwardPass": {"seconds": pytest.approx(40e-6), "count": 3, "device_seconds": 0.0}}


def test_kernel_time_counts_for_the_instruction_whose_range_held_its_launch_on_any_thread():
    def event(name, start, end, kernels=(), thread=1, device_type=DeviceType.CPU):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                               device_type=device_type, kernels=[SimpleNamespace(duration=d) for d in kernels])

    launches = [event("petra ForwardPass(buffer_id=0)", 0, 100),
                event("aten::conv2d", 10, 20, kernels=[7.0, 3.0]),
                event("petra DelayedBackward(buffer_id=0)", 100, 300, kernels=[1.0]),
                event("aten::convolution_backward", 150, 160, kernels=[40.0], thread=2),  # autograd's own thread
                event("petra ForwardPass(buffer_id=1)", 300, 400),
                event("aten::relu", 310, 311, kernels=[5.0]),
                event("aten::add_", 450, 451, kernels=[1000.0]),  # between instructions: no instruction's
                event("petra ForwardPass(buffer_id=1)", 300, 400, kernels=[2.0], device_type=DeviceType.CUDA)]
    averages = [SimpleNamespace(key=k, device_type=DeviceType.CPU, cpu_time_total=1.0, count=n)
                for k, n in (("petra ForwardPass(buffer_id=0)", 2), ("petra DelayedBackward(buffer_id=0)", 1))]
    kinds = host_by_instruction(averages, launches)
    assert kinds["ForwardPass"]["device_seconds"] == pytest.approx(15e-6)
    assert kinds["DelayedBackward"]["device_seconds"] == pytest.approx(41e-6)


def test_host_time_is_split_by_self_time_between_python_ops_and_other_threads():
    def event(name, start, self_us, thread=1, device_type=DeviceType.CPU):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start), thread=thread,
                               self_cpu_time_total=self_us, device_type=device_type)

    events = [event("petra ForwardPass(buffer_id=0)", 0, 30.0),  # the first to start: its thread is the caller's
              event("aten::conv2d", 5, 20.0),
              event("cudaLaunchKernel", 6, 4.0),
              event("petra ForwardPass(buffer_id=1)", 50, 10.0),
              event("petra DelayedBackward(buffer_id=0)", 100, 50.0),
              event("aten::convolution_backward", 110, 70.0, thread=2),  # autograd's device thread
              event("cudaLaunchKernel", 111, 2.0, thread=2),
              event("petra DelayedBackward(buffer_id=0)", 100, 999.0, device_type=DeviceType.CUDA)]
    split = host_by_op(events, wall=200e-6, top=3)
    assert split["self_seconds"] == {"caller": pytest.approx(114e-6), "other": pytest.approx(72e-6)}
    assert split["outside_seconds"] == pytest.approx(86e-6)
    assert split["instructions_self_seconds"] == pytest.approx(90e-6)
    assert split["top"] == [
        {"name": "aten::convolution_backward", "thread": "other", "seconds": pytest.approx(70e-6), "count": 1},
        {"name": "petra DelayedBackward", "thread": "caller", "seconds": pytest.approx(50e-6), "count": 1},
        {"name": "petra ForwardPass", "thread": "caller", "seconds": pytest.approx(40e-6), "count": 2}]
    assert host_by_op([], wall=1.0) == {}


def test_the_report_line_says_the_split_in_milliseconds():
    split = {"outside_seconds": 0.0123, "self_seconds": {"caller": 0.05, "other": 0.002},
             "instructions_self_seconds": 0.01,
             "top": [{"name": "cudaLaunchKernel", "thread": "caller", "seconds": 0.02, "count": 1174}]}
    assert host_line(split) == ("12.3 ms outside every event, 50.0 ms in events (10.0 ms the instructions' own), "
                                "2.0 ms on other threads; by self time: cudaLaunchKernel 20.0 ms (1174)")


def test_self_times_on_the_calling_thread_add_up_to_the_time_its_events_cover():
    """What ``outside_seconds`` rests on, in a real trace: an event's self time is its time less its children's, so
    the calling thread's self times sum to the time covered by its outermost events, nested ops counted once."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(32, 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        for m in range(3):
            with record_function(f"{INSTRUCTION_LABEL}ForwardPass(buffer_id={m})"):
                y = torch.nn.functional.gelu(x @ x).sum()
            y.backward()
    events = trace.events()
    caller = min(events, key=lambda e: e.time_range.start).thread
    outermost = [(e.name, e.time_range.start, e.time_range.end) for e in events
                 if e.thread == caller and e.cpu_parent is None]
    covered = kernel_summary(outermost)["device_busy_seconds"]  # the union of intervals, overlaps counted once
    split = host_by_op(events, wall=1.0)
    assert split["self_seconds"]["caller"] == pytest.approx(covered, rel=1e-3)
    forward = next(entry for entry in split["top"] if entry["name"] == f"{INSTRUCTION_LABEL}ForwardPass")
    assert forward["count"] == 3 and 0 < split["instructions_self_seconds"] <= split["self_seconds"]["caller"]


@pytest.mark.parametrize("flag", [False, True], ids=["contiguous", "channels_last"])
def test_channels_last_puts_revnet18_s_weights_and_inputs_in_that_layout(flag):
    """``--channels-last``: every RevNet18 weight whose layouts differ, and each micro-batch, channels-last; RevGPT as
    it is."""
    args = parse_args(["--tiny", "--device", "cpu"] + (["--channels-last"] if flag else []))
    specs, *_ = model("revnet18", args)
    layers = torch.nn.ModuleList([spec.build(log=False) for spec in specs])
    to_layout(layers, "revnet18", args)
    assert channels_last_share(layers) == float(flag)
    x, _ = micro_batches("revnet18", args, 2, torch.device("cpu"))[0]
    assert x.is_contiguous() is not flag
    assert x.is_contiguous(memory_format=torch.channels_last if flag else torch.contiguous_format)
    revgpt = torch.nn.ModuleList([spec.build(log=False) for spec in model("revgpt", args)[0]])
    before = [p.stride() for p in revgpt.parameters()]
    to_layout(revgpt, "revgpt", args)
    assert channels_last_share(revgpt) == 0.0 and [p.stride() for p in revgpt.parameters()] == before


def test_fp16_runs_plain_backprop_through_a_grad_scaler_and_petra_through_its_stages_scales(world_of_one):
    """``--dtypes fp16`` (CPU, tiny RevGPT): plain backprop steps through torch's GradScaler, PETRA with one loss
    scale per stage, and neither scale moved (no overflow at these sizes)."""
    args = parse_args(["--tiny", "--device", "cpu", "--dtypes", "fp16"])
    runs = {}
    for variant, dtype in (("plain", "fp16"), ("petra", "fp16"), ("plain", "bf16")):
        with DeviceMemory(torch.device("cpu")) as memory:
            run = run_plain if variant == "plain" else run_petra
            runs[variant, dtype] = run("revgpt", args, dtype, memory)["precision"]
    assert runs["plain", "fp16"] == "fp16 autocast, GradScaler at 65536"
    assert runs["petra", "fp16"].startswith("fp16, dynamic loss scale per stage from 2^16")
    assert runs["petra", "fp16"].endswith("at [65536.0]") and runs["plain", "bf16"] == "bf16"
