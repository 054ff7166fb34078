"""Whole-model measurements, run inside a fresh child process (see ``child.py``).

One call measures one (model, image size, phase) with the shared :func:`~ttt_zoo.bench.measure.measure_steps`:
``inference`` is ``model.eval()`` under ``torch.no_grad()``; ``train`` is ``model.train()``, forward,
cross-entropy against random labels (mean square for non-logit outputs), backward, gradients set to None before
each step; no optimizer step, so the time is the model's alone.  A diffusion transformer (dit, dit3, dit5) is
measured as it samples and trains: ``forward(x, t, y)`` on the SD VAE's latents of an image of ``img_size`` pixels
(4 channels, 8x smaller), random timesteps and classes.
"""

import contextlib
import os
from typing import Dict, List, Tuple

import torch
from ttt_zoo.torchcompile import compile_model

__all__ = ["create", "bench_model", "profile_model", "count_gmacs"]


def _latent_size(img_size: Tuple[int, int]) -> Tuple[int, int]:
    from ttt_zoo.sampling import SD_VAE_FACTOR
    h, w = img_size
    if h % SD_VAE_FACTOR or w % SD_VAE_FACTOR:
        raise ValueError(f"a diffusion model's image size {h}x{w} is not a multiple of the VAE factor {SD_VAE_FACTOR}")
    return h // SD_VAE_FACTOR, w // SD_VAE_FACTOR


def _is_diffusion(name: str) -> bool:
    """A zoo diffusion transformer (``forward(x, t, y)``); any other name (a timm or --import model) takes images."""
    from ttt_zoo.registry import is_diffusion_model, list_zoo_models
    return name in list_zoo_models(include_diffusion=True) and is_diffusion_model(name)


def create(name: str, img_size: Tuple[int, int], model_kwargs: Dict, device=None) -> torch.nn.Module:
    """``timm.create_model`` at ``img_size`` where the model takes ``img_size`` (timm ViTs do), else as is; a
    diffusion model at the latent size of an ``img_size`` image."""
    import timm
    with torch.device(device) if device is not None else contextlib.nullcontext():
        if _is_diffusion(name):
            return timm.create_model(name, **{"input_size": _latent_size(img_size), **model_kwargs})
        try:
            return timm.create_model(name, img_size=tuple(img_size), **model_kwargs)
        except TypeError as e:
            if "img_size" not in str(e):
                raise
            return timm.create_model(name, **model_kwargs)


def count_gmacs(name: str, img_size: Tuple[int, int], model_kwargs: Dict, model=None) -> float:
    """Multiply-accumulates per sample (GMACs, as timm and the papers count them), on the meta device; where a
    model cannot be built there (e.g. it calls ``.item()`` while initialising), with ``model`` itself, batch 1."""
    from torch.utils.flop_counter import FlopCounterMode
    try:
        model = create(name, img_size, model_kwargs, device="meta").eval()
        device = "meta"
    except Exception:  # noqa: BLE001
        if model is None:
            raise
        device = next(model.parameters()).device
    inputs = _inputs(model, name, img_size, 1, device)
    was_training = model.training
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()(*inputs)
    model.train(was_training)
    return counter.get_total_flops() / 2 / 1e9


def _inputs(model: torch.nn.Module, name: str, img_size: Tuple[int, int], batch: int, device) -> Tuple:
    """The forward's arguments: images; for a diffusion model latents, timesteps and class labels."""
    in_chans = getattr(model, "in_chans", 3)
    if not _is_diffusion(name):
        return (torch.randn(batch, in_chans, *img_size, device=device),)
    t = torch.randint(0, 1000, (batch,), device=device)
    y = torch.randint(0, max(model.num_classes, 1), (batch,), device=device)
    return torch.randn(batch, in_chans, *_latent_size(img_size), device=device), t, y


def _ort_session(model: torch.nn.Module, img_size: Tuple[int, int], spec: Dict):
    """The model exported by ``ttt_zoo.export.export_onnx`` (dynamo exporter) in an onnxruntime CPU session with
    the run's thread count (inference only)."""
    import os
    import tempfile
    if spec["phase"] == "train" or torch.device(spec["device"]).type != "cpu":
        raise ValueError("--runtime onnxruntime measures CPU inference only (--bench inference --device cpu)")
    try:
        import onnxruntime as ort
    except ImportError:
        raise ValueError("--runtime onnxruntime needs onnxruntime (pip install onnxruntime)") from None
    from ttt_zoo.export import export_onnx
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        export_onnx(model, path, img_size)
        opts = ort.SessionOptions()
        if spec.get("threads"):
            opts.intra_op_num_threads = spec["threads"]
            opts.inter_op_num_threads = 1
        return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


class _Setup:
    """Model, input and one step as the spec asks (shared by the benchmark and the profiler)."""

    def __init__(self, spec: Dict):
        self.spec = spec
        self.device = spec["device"]
        self.train = spec["phase"] == "train"
        torch.manual_seed(0)
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        h, w = spec["img_size"]
        model = create(spec["model"], (h, w), spec.get("model_kwargs") or {})
        self.param_count = sum(p.numel() for p in model.parameters())
        for key, value in (spec.get("set_attr") or {}).items():  # e.g. T5 mixers' `recompute` switch
            hits = [m for m in model.modules() if hasattr(m, key)]
            if not hits:
                raise ValueError(f"--set-attr {key}: no submodule of {spec['model']} has an attribute {key!r}")
            for m in hits:
                setattr(m, key, value)
        if spec.get("grad_checkpointing"):
            if not hasattr(model, "set_grad_checkpointing"):
                raise ValueError(f"--grad-checkpointing: {spec['model']} has no set_grad_checkpointing()")
            model.set_grad_checkpointing(True)
        fmt = torch.channels_last if spec.get("channels_last") else torch.contiguous_format
        model = model.to(self.device, memory_format=fmt).train(self.train)
        self.model = model
        self.inputs = _inputs(model, spec["model"], (h, w), spec["batch_size"], self.device)
        self.inputs = (self.inputs[0].contiguous(memory_format=fmt),) + self.inputs[1:]
        self.x = self.inputs[0]
        self.target = torch.randint(0, max(getattr(model, "num_classes", 0) or 1, 1), (spec["batch_size"],),
                                    device=self.device)
        mode = spec.get("torchcompile_mode")
        self.run = compile_model(model, spec.get("torchcompile") or None, mode or None)
        # CUDA graphs (mode reduce-overhead): each training step starts a new graph replay
        self.mark_step = mode == "reduce-overhead" and spec.get("torchcompile") and self.train
        self.ort = _ort_session(model, (h, w), spec) if spec.get("runtime") == "onnxruntime" else None
        amp = spec.get("amp_dtype")
        dev_type = torch.device(self.device).type
        self.autocast = (lambda: torch.autocast(dev_type, dtype=getattr(torch, amp))) if amp else \
            contextlib.nullcontext

    def loss(self, out):
        out = out[0] if isinstance(out, (tuple, list)) else out
        if out.ndim == 2 and out.shape[-1] > 1:
            return torch.nn.functional.cross_entropy(out.float(), self.target)
        return out.float().square().mean()

    def step(self):
        if self.ort is not None:
            return self.ort.run(None, {"image": self.x.numpy()})
        elif self.train:
            if self.mark_step:
                torch.compiler.cudagraph_mark_step_begin()
            self.model.zero_grad(set_to_none=True)
            with self.autocast():
                loss = self.loss(self.run(*self.inputs))
            loss.backward()
            return loss
        with torch.no_grad(), self.autocast():
            return self.run(*self.inputs)


def _saved_tensor_mb(s: _Setup) -> float:
    """MiB of distinct non-parameter storages autograd keeps after one training forward (deterministic)."""
    params = {p.untyped_storage().data_ptr() for p in s.model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), s.autocast():
        s.loss(s.run(*s.inputs))
    return sum(seen.values()) / 2 ** 20


def bench_model(spec: Dict) -> Dict:
    """timm's result keys (``samples_per_sec``, ``step_time`` in ms, ``batch_size``, ``img_size``, ``param_count``
    in millions, ``gmacs`` per sample) plus ``peak_mem_mb``, ``cpu_time`` (ms, CPU only) and ``threads``."""
    from .measure import measure_steps
    s = _Setup(spec)
    try:
        m = measure_steps(s.step, s.device, spec["num_warm_iter"], spec["num_bench_iter"])
    except torch.cuda.OutOfMemoryError as e:  # report it in the table, do not hide it
        return dict(error=f"CUDA out of memory: {str(e)[:120]}")
    h, w = spec["img_size"]
    out = dict(samples_per_sec=round(1e3 * spec["batch_size"] / m["step_time"], 3), step_time=round(m["step_time"], 3),
               step_times=[round(t, 3) for t in m["step_times"]],
               batch_size=spec["batch_size"], img_size=h if h == w else f"{h}x{w}",
               param_count=s.param_count / 1e6, peak_mem_mb=None if m["peak_mem_mb"] is None else
               round(m["peak_mem_mb"], 2), threads=torch.get_num_threads(),
               malloc_trim=os.environ.get("MALLOC_TRIM_THRESHOLD_") == "0")  # glibc read it at start-up
    if m["cpu_time"] is not None:
        out["cpu_time"] = round(m["cpu_time"], 3)
    try:
        out["gmacs"] = round(count_gmacs(spec["model"], (h, w), spec.get("model_kwargs") or {}, s.model), 4)
    except Exception as e:  # noqa: BLE001 - a model the meta device cannot run still gets its timings
        out["gmacs"] = None
        out["gmacs_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    if spec.get("saved_mem") and s.train:
        out["saved_mb"] = round(_saved_tensor_mb(s), 2)
    return out


def profile_model(spec: Dict) -> Dict:
    """torch.profiler operator breakdown: the ``top`` operators by self time, per step, over ``num_bench_iter`` steps.

    Each step is profiled on its own and only its per-operator totals are kept: the profiler holds every event of
    what it records, and one training step of Vision-TTT at 1024 records ~10^5 operators (the scan's mini-batches),
    so recording 10 steps at once grew the child past 23 GB and the kernel killed it.

    On CUDA the rows are the device's (kernels, copies), each counted once (``profiling.device_time_us``), with
    the step's GPU-busy %, kernels per step, copy time and fp32 share (``profiling.step_summary``); on the CPU the
    rows are the operators by self CPU time.
    """
    import time
    from torch.profiler import ProfilerActivity, profile
    from .profiling import is_device_row, step_summary
    s = _Setup(spec)
    for _ in range(max(spec["num_warm_iter"], 1)):
        s.step()
    cuda = s.device.startswith("cuda")
    iters = max(spec["num_bench_iter"], 1)
    totals: Dict[str, List] = {}  # row -> [self time (us), calls] over all steps
    device_rows: Dict[str, "_Row"] = {}  # device row -> its totals (for the step summary)
    wall_us = cpu_us = 0.0
    for _ in range(iters):
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            t0 = time.perf_counter()
            s.step()
            if cuda:
                torch.cuda.synchronize()
            wall_us += (time.perf_counter() - t0) * 1e6
        for e in prof.key_averages():
            cpu_us += e.self_cpu_time_total
            if cuda and not is_device_row(e):
                continue  # its device time is its kernels', counted in their own rows
            t = totals.setdefault(e.key, [0.0, 0])
            t[0] += e.self_device_time_total if cuda else e.self_cpu_time_total
            t[1] += e.count
            if cuda:
                r = device_rows.setdefault(e.key, _Row(e))
                r.self_device_time_total += e.self_device_time_total
                r.count += e.count
        del prof
    ops = sorted(((k, t, n) for k, (t, n) in totals.items() if t > 0), key=lambda x: -x[1])
    total = sum(t for _, t, _ in ops)
    rows: List = [dict(op=k, ms=t / iters / 1e3, share=100.0 * t / total, calls=n // iters)
                  for k, t, n in ops[:spec.get("top", 12)]]
    out = dict(total_ms=total / iters / 1e3, cpu_ms=cpu_us / iters / 1e3, wall_ms=wall_us / iters / 1e3,
               num_ops=len(ops), ops=rows, time="device" if cuda else "cpu")
    if cuda:
        out.update(step_summary(device_rows.values(), wall_us, iters))
    return out


class _Row:
    """A device row's totals over the profiled steps (the attributes ``profiling.step_summary`` reads)."""

    def __init__(self, evt):
        self.key, self.device_type, self.is_legacy = evt.key, evt.device_type, getattr(evt, "is_legacy", False)
        self.is_user_annotation = getattr(evt, "is_user_annotation", False)
        self.self_device_time_total, self.count = 0.0, 0
