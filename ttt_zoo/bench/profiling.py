"""Summing a ``torch.profiler`` step once, as torch's own table (``key_averages().table()``) does.

A kernel's time is in its own row (device type CUDA) and again in the row of the CPU event that launched it
(``cudaLaunchKernel``: its ``self_device_time_total`` is the kernel's duration), so the sum over every row counts
it twice.  Device time is the sum over the device rows only (torch's "Self CUDA time total"); CPU time the sum of
every row's self CPU time (torch's "Self CPU time total").
"""
import re
from typing import Dict, Iterable, Optional

from torch.autograd import DeviceType

__all__ = ["DEVICE_TYPES", "is_device_row", "device_time_us", "cpu_time_us", "is_copy", "kernel_is_fp32",
           "step_summary"]

DEVICE_TYPES = (DeviceType.CUDA, DeviceType.PrivateUse1, DeviceType.MTIA, DeviceType.XPU)

_COPY = re.compile(r"^(Memcpy|Memset)\b")
# kernel names carry their element type: cuBLAS/CUTLASS (sm90_xmma_gemm_bf16bf16_..., ampere_sgemm_...), ATen's
# templates (vectorized_elementwise_kernel<4, ..., float> / <c10::BFloat16>); a half-precision mark wins (a bf16
# GEMM accumulating in f32 is a bf16 kernel, a cast <c10::Half, float> moves half-precision data)
_HALF = re.compile(r"bf16|bfloat16|f16|fp16|half|s16816|h884|h1688|h16816|hmma", re.IGNORECASE)
_FP32 = re.compile(r"float|f32|fp32|tf32|sgemm|s1688|s884|s161616", re.IGNORECASE)


def is_device_row(evt) -> bool:
    """A row whose self device time is the device's own: a kernel, copy or set on the device (or, in the legacy
    profiler, a CPU event holding its kernel's time); user annotations (``record_function`` on the device) span
    kernels already counted."""
    if evt.device_type == DeviceType.CPU:
        return bool(getattr(evt, "is_legacy", False))
    return evt.device_type in DEVICE_TYPES and not getattr(evt, "is_user_annotation", False)


def device_time_us(events: Iterable) -> float:
    """Device time of the events (``FunctionEvent`` or ``key_averages()`` rows), each kernel once (us)."""
    return sum(evt.self_device_time_total for evt in events if is_device_row(evt))


def cpu_time_us(events: Iterable) -> float:
    """Self CPU time of the events, each interval once (us)."""
    return sum(evt.self_cpu_time_total for evt in events)


def is_copy(name: str) -> bool:
    """A device copy or fill (CUPTI names them ``Memcpy HtoD (...)``, ``Memset (Device)``)."""
    return bool(_COPY.match(name))


def kernel_is_fp32(name: str) -> Optional[bool]:
    """From the kernel's name: True for a float32 kernel, False for a half-precision one, None when the name does
    not say (e.g. a Triton kernel, named after its function)."""
    if _HALF.search(name):
        return False
    if _FP32.search(name):
        return True
    return None


def step_summary(rows: Iterable, wall_us: float, steps: int = 1) -> Dict:
    """Per step, from the ``key_averages()`` rows of ``steps`` profiled steps and their wall time (us): device ms,
    GPU-busy % (device time / wall time), kernels and copies launched, copy ms, and the share of kernel time in
    float32 kernels, in half-precision ones and in kernels whose name does not say (by :func:`kernel_is_fp32`)."""
    kernel_us = copy_us = 0.0
    kernels = copies = 0
    by_type = {True: 0.0, False: 0.0, None: 0.0}
    for evt in rows:
        if not is_device_row(evt):
            continue
        t = evt.self_device_time_total
        if is_copy(evt.key):
            copy_us += t
            copies += evt.count
        else:
            kernel_us += t
            kernels += evt.count
            by_type[kernel_is_fp32(evt.key)] += t
    device_us = kernel_us + copy_us
    return dict(device_ms=device_us / steps / 1e3, wall_ms=wall_us / steps / 1e3,
                busy_pct=100.0 * device_us / wall_us if wall_us > 0 else None,
                kernels=kernels / steps, copies=copies / steps, copy_ms=copy_us / steps / 1e3,
                fp32_share=100.0 * by_type[True] / kernel_us if kernel_us else None,
                half_share=100.0 * by_type[False] / kernel_us if kernel_us else None,
                unknown_dtype_share=100.0 * by_type[None] / kernel_us if kernel_us else None)
