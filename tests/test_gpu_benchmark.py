"""``python -m benchmarks.gpu``'s reading of a profiled call: how long the device was busy against the kernel time
summed, which is what tells a host-bound call from a device-bound one."""

import pytest

from benchmarks.lib.single_gpu import kernel_group, kernel_summary


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
    assert kernel_group("void at::native::batch_norm_collect_statistics_kernel") == "norm"
    assert kernel_group("void at::native::(anonymous namespace)::fused_adamw_kernel") == "optimizer"
    assert kernel_group("Memset (Device)") == "memset"
    assert kernel_group("void at::native::unrolled_elementwise_kernel<copy>") == "cast"
    assert kernel_group("some_new_kernel") == "other"
