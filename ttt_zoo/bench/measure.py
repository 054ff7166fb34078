"""The measuring code every benchmark mode shares: step timing, peak memory, the fresh-subprocess runner, the
machine description (files are written with :mod:`ttt_zoo.fileio`).

Peak memory is the growth over the state before the first measured call (model and inputs already built):
on CUDA ``torch.cuda.max_memory_allocated`` above ``memory_allocated``; on the CPU the process's peak resident set
(VmHWM, reset through ``/proc/self/clear_refs``) above its RSS. That is what a user sees ("training grows my
process by X"), it covers every allocator (PyTorch's CPU allocator is plain malloc) and needs no tracing hooks.
"""

import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, Optional

__all__ = ["rss_kb", "reset_peak", "peak_kb", "PeakMemory", "measure_steps", "run_child", "machine_info",
           "describe_machine", "RESULT_TAG"]

RESULT_TAG = "@@ttt-zoo-bench@@ "  # prefixes the one result line a child prints


def rss_kb() -> int:
    """Current resident set size of this process (KiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, the peak RSS, to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_kb() -> int:
    """Peak resident set size (VmHWM) since the last :func:`reset_peak` (KiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


class PeakMemory:
    """Peak memory growth (MiB) between :meth:`start` and :meth:`stop`; ``None`` where it cannot be read."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.base = None

    def start(self) -> None:
        import torch
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        import gc
        gc.collect()  # garbage freed during the measurement would lower the RSS under the base
        try:
            # reset first, then read: the peak restarts at the RSS of this moment, so it never sits below the base
            # (read before the reset, a base above the later RSS hid a 64 MiB step behind a growth of 0)
            reset_peak()
            self.base = rss_kb() * 1024
        except OSError:  # not Linux: no resettable peak RSS
            self.base = None

    def stop(self) -> Optional[float]:
        import torch
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / 2 ** 20
        if self.base is None:
            return None
        return max(peak_kb() * 1024 - self.base, 0) / 2 ** 20


def _check_finite(out) -> None:
    """A step's output (tensor, array or a list of them) with a NaN or an infinity: no timing of a broken model."""
    import numpy as np
    import torch
    for o in out if isinstance(out, (list, tuple)) else [out]:
        bad = (not bool(torch.isfinite(o.detach().float()).all()) if isinstance(o, torch.Tensor) else
               not bool(np.isfinite(o).all()) if isinstance(o, np.ndarray) and o.dtype.kind == "f" else False)
        if bad:
            raise ValueError("the model output has NaN or infinite values, so its timing would be of a broken "
                             "model; check the weights (--model-kwargs, --set-attr)")


def measure_steps(step: Callable[[], object], device: str, num_warm: int, num_bench: int) -> Dict:
    """``num_warm`` untimed then ``num_bench`` timed calls of ``step``.

    Returns the median wall time per step (ms), the median process CPU time per step (ms; CPU only), every wall
    time, and the peak memory growth over all calls (warm-up included, so one-time allocations count).
    """
    import torch
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mem = PeakMemory(device)
    mem.start()
    for _ in range(num_warm):
        step()
    sync()
    wall, cpu = [], []
    for _ in range(max(num_bench, 1)):
        t0, c0 = time.perf_counter(), time.process_time()
        out = step()
        sync()
        wall.append(1e3 * (time.perf_counter() - t0))
        cpu.append(1e3 * (time.process_time() - c0))
    _check_finite(out)
    return dict(step_time=statistics.median(wall), cpu_time=None if cuda else statistics.median(cpu),
                step_times=wall, peak_mem_mb=mem.stop())


def _package_root() -> str:
    import ttt_zoo
    return os.path.dirname(os.path.dirname(os.path.abspath(ttt_zoo.__file__)))


def run_child(kind: str, spec: Dict, env: Optional[Dict[str, Optional[str]]] = None, src: Optional[str] = None,
              timeout: Optional[float] = None) -> Dict:
    """Run one measurement (``ttt_zoo.bench.child``) in a fresh Python process and return its result dict.

    ``env`` entries are set in the child (``None`` removes one); ``src`` is a source tree whose ``ttt_zoo`` the
    child imports instead of this one. A failed child returns ``{"error": ...}`` with the end of its stderr.
    """
    child_env = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            child_env.pop(k, None)
        else:
            child_env[k] = v
    paths = [p for p in (src, _package_root(), child_env.get("PYTHONPATH")) if p]
    child_env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-m", "ttt_zoo.bench.child", kind, json.dumps(spec)]
    try:
        # `python -m` puts the working directory first on sys.path: run a --before child inside its source tree,
        # or a run started in this checkout's root would import this checkout's ttt_zoo instead
        out = subprocess.run(cmd, capture_output=True, text=True, env=child_env, timeout=timeout, cwd=src)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout:.0f} s")
    results = [line[len(RESULT_TAG):] for line in out.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if results:
        return json.loads(results[-1])
    tail = out.stderr.strip().splitlines()[-12:]
    return dict(error=child_error(out.returncode, out.stderr), traceback="\n".join(tail))


def child_error(returncode: int, stderr: str) -> str:
    """One line on why a child gave no result: the signal that killed it (its last stderr line is then some
    library's log line, not the cause), else its last stderr line (a Python exception's message)."""
    tail = stderr.strip().splitlines()
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (most likely out of memory: try a smaller size or batch)" if name == "SIGKILL" else ""
        return f"child killed by {name}{hint}" + (f"; its last stderr line: {tail[-1]}" if tail else "")
    return tail[-1] if tail else f"child exited with status {returncode} and printed nothing on stderr"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"


def machine_info(device: str, threads: Optional[int] = None) -> Dict[str, str]:
    """What the numbers were measured on: CPU / GPU, library versions, threads, load."""
    import torch
    info = dict(cpu=_cpu_name(), cores=str(os.cpu_count()),
                threads=str(threads or torch.get_num_threads()), torch=torch.__version__,
                timm=_version("timm"), triton=_version("triton"), cuda=str(torch.version.cuda),
                python=platform.python_version())
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    if hasattr(os, "getloadavg"):
        info["load_before"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    info["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return info


def describe_machine(info: Dict[str, str]) -> str:
    parts = [f"GPU {info['gpu']}" if "gpu" in info else None, f"CPU {info['cpu']} ({info['cores']} cores, "
             f"{info['threads']} torch threads)", f"torch {info['torch']}", f"timm {info['timm']}",
             f"triton {info['triton']}", f"CUDA {info['cuda']}", f"load before the run {info.get('load_before', '?')}",
             info["date"]]
    return "; ".join(p for p in parts if p)
