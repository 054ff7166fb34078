"""Running a benchmark: every measurement in a fresh subprocess, all configurations side by side in one run."""

import dataclasses
import os
import shutil
import statistics
import subprocess
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from .measure import run_child
from .ops import OPS

__all__ = ["BenchConfig", "run_models", "run_profiles", "run_ops", "export_revision"]


#: glibc's threshold of free memory at the top of the heap kept from the system; 0 returns it at every free, so the
#: peak RSS follows the live tensors instead of the heap glibc retains (the CPU counterpart of CUDA's
#: ``max_memory_allocated``, which counts allocated, not cached, memory)
MALLOC_TRIM_ENV = "MALLOC_TRIM_THRESHOLD_"


@dataclasses.dataclass
class BenchConfig:
    models: Sequence[str] = ("vit3_tiny",)
    peers: Sequence[str] = ()
    img_sizes: Sequence[Tuple[int, int]] = ((224, 224),)
    phases: Sequence[str] = ("infer", "train")
    batch_size: int = 1
    batch_tokens: Optional[int] = None  # batch = max(1, batch_tokens // (H/16 * W/16)) instead of batch_size
    device: str = "cpu"
    amp_dtype: Optional[str] = None  # "bfloat16" | "float16": autocast; None: fp32
    channels_last: bool = False
    grad_checkpointing: bool = False
    torchcompile: Optional[str] = None  # torch.compile backend, e.g. "inductor"
    torchcompile_mode: Optional[str] = None  # torch.compile mode, e.g. "reduce-overhead" (CUDA graphs)
    num_warm_iter: int = 2
    num_bench_iter: int = 10
    threads: Optional[int] = None
    backends: Sequence[Optional[str]] = (None,)  # TTT op backend per run of the zoo models (the child's --backend); None: leave as is
    # "torch" (eager, or --torchcompile), "compile" (torch.compile with --torchcompile's backend, default inductor,
    # side by side with eager) and/or "onnxruntime" (CPU inference)
    runtimes: Sequence[str] = ("torch",)
    model_kwargs: Dict = dataclasses.field(default_factory=dict)
    set_attr: Dict = dataclasses.field(default_factory=dict)  # attribute -> value on every submodule having it
    saved_mem: bool = False
    repeats: int = 1
    before: Optional[Tuple[str, str]] = None  # (label, source tree) of older code also measured for `models`
    top: int = 12  # profile: operators listed
    imports: Sequence[str] = ()  # modules each child imports first (e.g. one registering a local peer with timm)
    timeout: Optional[float] = None  # seconds per child
    malloc_trim: bool = False  # glibc returns freed memory at once in every child (MALLOC_TRIM_THRESHOLD_=0)


def _configs(cfg: BenchConfig) -> List[Dict]:
    """(label, model, backend, role, src) of every configuration, in table order."""
    out = []
    tag_backend = len(cfg.backends) > 1 or cfg.backends[0] is not None
    for name in cfg.models:
        for b in cfg.backends:
            label = f"{name} [{b}]" if tag_backend and b else name
            if cfg.before:
                out.append(dict(label=f"{label} ({cfg.before[0]})", model=name, backend=b, role="model",
                                src=cfg.before[1], runtime="torch"))
            for rt in cfg.runtimes:
                out.append(dict(label=label if rt == "torch" else f"{label} ({rt})", model=name, backend=b,
                                role="model", src=None, runtime=rt))
    for name in cfg.peers:
        for rt in cfg.runtimes:
            out.append(dict(label=name if rt == "torch" else f"{name} ({rt})", model=name, backend=None, role="peer",
                            src=None, runtime=rt))
    return out


def _batch(cfg: BenchConfig, h: int, w: int) -> int:
    return max(1, cfg.batch_tokens // max(1, (h // 16) * (w // 16))) if cfg.batch_tokens else cfg.batch_size


def _env(cfg: BenchConfig) -> Dict[str, Optional[str]]:
    env: Dict[str, Optional[str]] = {}
    if cfg.threads:
        env["OMP_NUM_THREADS"] = str(cfg.threads)
    if cfg.malloc_trim:
        env[MALLOC_TRIM_ENV] = "0"
    return env


def _compile_backend(cfg: BenchConfig, runtime: str) -> Optional[str]:
    """torch.compile backend of a configuration: runtime "compile" compiles (--torchcompile's backend, default
    inductor); "torch" is eager when "compile" runs beside it, else follows --torchcompile (timm's flag)."""
    if runtime == "compile":
        return cfg.torchcompile or "inductor"
    if runtime == "torch" and "compile" not in cfg.runtimes:
        return cfg.torchcompile
    return None


def _spec(cfg: BenchConfig, c: Dict, h: int, w: int, phase: str) -> Dict:
    rt = c.get("runtime", "torch")
    compile_backend = _compile_backend(cfg, rt)
    return dict(model=c["model"], img_size=[h, w], phase=phase, batch_size=_batch(cfg, h, w), device=cfg.device,
                amp_dtype=cfg.amp_dtype, channels_last=cfg.channels_last, torchcompile=compile_backend,
                torchcompile_mode=cfg.torchcompile_mode if compile_backend else None,
                grad_checkpointing=cfg.grad_checkpointing,
                num_warm_iter=cfg.num_warm_iter, num_bench_iter=cfg.num_bench_iter, threads=cfg.threads,
                model_kwargs=cfg.model_kwargs, set_attr=cfg.set_attr if c["role"] == "model" else {},
                saved_mem=cfg.saved_mem, src=c["src"], top=cfg.top, runtime=rt,
                imports=list(cfg.imports), backend=c["backend"])


def _child_takes_backend(src: Optional[str]) -> bool:
    """Whether the benchmark child of source tree ``src`` (None: this one) sets the spec's ``backend`` (older trees
    read the environment instead and would measure the default backend)."""
    if src is None:
        return True
    try:
        with open(os.path.join(src, "ttt_zoo", "bench", "child.py")) as f:
            return "set_backend" in f.read()
    except OSError:
        return False


def _run_model_child(kind: str, cfg: BenchConfig, c: Dict, h: int, w: int, phase: str) -> Dict:
    if c["backend"] is not None and not _child_takes_backend(c["src"]):
        return dict(error=f"the source tree {c['src']} predates passing the TTT backend to the benchmark child; "
                          f"measure it without --backend")
    return run_child(kind, _spec(cfg, c, h, w, "train" if phase == "train" else "inference"), _env(cfg),
                     src=c["src"], timeout=cfg.timeout)


def _merge(runs: List[Dict]) -> Dict:
    """A cell over its repeats: the timed steps of every run pooled, ``step_time`` their median with
    ``step_time_min`` / ``step_time_max`` (the spread; ``samples_per_sec`` likewise) and ``steps`` (how many);
    CPU time and peak memory the median over runs; the rest from the first run."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    out = dict(ok[0])
    for k in ("cpu_time", "peak_mem_mb"):
        vals = [r[k] for r in ok if r.get(k) is not None]
        if vals:
            out[k] = round(statistics.median(vals), 3)
    steps = [t for r in ok for t in (r.get("step_times") or [r["step_time"]])]  # an older child: its median
    out.pop("step_times", None)
    out.update(step_time=round(statistics.median(steps), 3), step_time_min=round(min(steps), 3),
               step_time_max=round(max(steps), 3), steps=len(steps))
    for key, ms in (("samples_per_sec", out["step_time"]), ("samples_per_sec_min", out["step_time_max"]),
                    ("samples_per_sec_max", out["step_time_min"])):
        out[key] = round(1e3 * out["batch_size"] / ms, 3)
    if len(runs) > 1:
        out["repeats"] = len(ok)
    return out


def run_models(cfg: BenchConfig, log=print, on_rows=None, progress: bool = True) -> List[Dict]:
    """One row per (configuration, image size) with timm's ``infer_`` / ``train_`` keys.  ``on_rows(rows)`` is
    called with the rows measured so far after every measurement (to write them at once: a killed run keeps them);
    ``progress``: the measurements done and the run's ETA on stderr (:class:`ttt_zoo.progress.Progress`, once the
    run has taken a few seconds)."""
    from ttt_zoo.progress import Progress
    configs = _configs(cfg)
    todo = [(rep, h, w, c, p) for rep in range(cfg.repeats)  # repeats interleaved, so load from other processes
            for h, w in cfg.img_sizes for c in configs for p in cfg.phases  # hits every config alike
            if not (p == "train" and c.get("runtime") == "onnxruntime")]  # an inference runtime
    runs: Dict[tuple, List[Dict]] = {}
    with Progress(len(todo), "bench", interval=1, unit="measurement", enabled=progress) as bar:
        for rep, h, w, c, p in todo:
            r = _run_model_child("model", cfg, c, h, w, p)
            runs.setdefault((c["label"], h, w, p), []).append(r)
            if "error" in r:
                log(f"FAILED {c['label']} {h}x{w} {p}: {r['error']}\n{r.get('traceback', '')}")
            else:
                log(f"{c['label']:>28} {h}x{w} {p:5s} {r['step_time']:10.2f} ms/step "
                    f"{r['samples_per_sec']:9.2f} samples/s  peak {r['peak_mem_mb'] or 0:8.1f} MB"
                    + (f"  (repeat {rep + 1})" if cfg.repeats > 1 else ""))
            if on_rows is not None:
                on_rows(_rows(cfg, configs, runs))
            bar.update()
    return _rows(cfg, configs, runs)


def _rows(cfg: BenchConfig, configs: List[Dict], runs: Dict[tuple, List[Dict]]) -> List[Dict]:
    """The table rows of the measurements in ``runs`` (a configuration not measured yet has none)."""
    rows = []
    for h, w in cfg.img_sizes:
        for c in configs:
            if not any((c["label"], h, w, p) in runs for p in cfg.phases):
                continue
            row = dict(model=c["model"], label=c["label"], role=c["role"], backend=c["backend"] or "",
                       img_size=h if h == w else f"{h}x{w}", img_h=h, img_w=w, device=cfg.device,
                       amp_dtype=cfg.amp_dtype or "float32", channels_last=cfg.channels_last,
                       torchcompile=_compile_backend(cfg, c.get("runtime", "torch")) or "",
                       torchcompile_mode=(cfg.torchcompile_mode or "") if _compile_backend(cfg, c.get("runtime", "torch"))
                       else "",
                       runtime=c.get("runtime", "torch"))
            for p in cfg.phases:
                if (c["label"], h, w, p) not in runs:
                    continue
                r = _merge(runs[(c["label"], h, w, p)])
                if "error" in r:
                    row[f"{p}_error"] = r["error"]
                    continue
                row.setdefault("param_count", r.pop("param_count"))
                r.pop("param_count", None)
                row.update({f"{p}_{k}": v for k, v in r.items()})
            rows.append(row)
    return rows


def run_profiles(cfg: BenchConfig, log=print, on_rows=None) -> List[Dict]:
    """torch.profiler breakdown per (configuration, size, phase), each in a fresh subprocess; ``on_rows(rows)``
    after each (as :func:`run_models`)."""
    out = []
    for h, w in cfg.img_sizes:
        for c in _configs(cfg):
            for p in cfg.phases:
                r = _run_model_child("profile", cfg, c, h, w, p)
                r.update(label=c["label"], img_size=f"{h}x{w}", phase=p)
                log(f"{c['label']} {h}x{w} {p}: " + (f"FAILED {r['error']}" if "error" in r else
                                                     f"{r['total_ms']:.1f} ms self time per step"))
                out.append(r)
                if on_rows is not None:
                    on_rows(out)
    return out


def run_ops(ops: Sequence[str], device: str, dtype: str, backends: Sequence[str], num_warm: int, num_bench: int,
            dry_run: bool = False, threads: Optional[int] = None, log=print) -> List[Dict]:
    """Every shape x backend of each op; one fresh subprocess per op. ``dry_run``: tiny shapes on the CPU, with
    the Triton kernels in the interpreter, to check the whole path without a GPU."""
    rows = []
    env = {"TRITON_INTERPRET": "1"} if dry_run else {}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    for op in ops:
        spec = dict(op=op, device=device, dtype=dtype, backends=list(backends), num_warm_iter=num_warm,
                    num_bench_iter=num_bench, shapes=OPS[op][3] if dry_run else OPS[op][2])
        r = run_child("ops", spec, env)
        if "error" in r:
            log(f"FAILED {op}: {r['error']}\n{r.get('traceback', '')}")
            rows.append(dict(op=op, shape="-", dtype=dtype, backend="-", error=r["error"]))
        else:
            rows += r["rows"]
    return rows


def export_revision(root: str, rev: str) -> str:
    """The tree of git revision ``rev`` in a temporary folder (``ttt_zoo/kernels`` linked as the package maps it)."""
    dst = tempfile.mkdtemp(prefix="ttt_zoo_bench_")
    try:
        archive = subprocess.run(["git", "-C", root, "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(dst, ignore_errors=True)
        raise ValueError(f"--before {rev}: cannot export it from the git checkout {root} "
                         f"({(e.stderr or b'').decode().strip() or e})") from None
    kernels = os.path.join(dst, "ttt_zoo", "kernels")
    if not os.path.exists(kernels) and os.path.isdir(os.path.join(dst, "kernels")):
        os.symlink(os.path.join(dst, "kernels"), kernels)
    return dst
