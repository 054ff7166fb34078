"""``ttt-zoo bench``: model and op benchmarks with one measuring code (timm ``benchmark.py`` conventions).

- ``measure.py``: step timing, peak memory (CUDA allocator / CPU peak RSS), the fresh-subprocess runner, machine info;
- ``models.py`` / ``ops.py``: what one child process measures (a model at one size and phase; all shapes of an op);
- ``run.py``: the side-by-side runs, each row handed on the moment it is measured; ``report.py``: results file,
  markdown tables with ratios, plot; ``profiling.py``: a profiled step's times, each kernel counted once.
"""

from typing import Dict, List, Sequence

from .measure import machine_info, measure_steps, peak_kb, reset_peak, rss_kb, run_child
from .report import format_ops_table, format_table, plot_results, scaling_exponents, write_results
from .run import BenchConfig, run_models, run_ops, run_profiles

__all__ = ["BenchConfig", "run_models", "run_ops", "run_profiles", "scaling_table", "format_table",
           "format_ops_table", "write_results", "plot_results", "scaling_exponents", "machine_info", "measure_steps",
           "run_child", "rss_kb", "reset_peak", "peak_kb"]


def scaling_table(models: Sequence[str], sizes: Sequence[int], iters: int = 3, train: bool = False) -> List[Dict]:
    """Batch-1 latency and peak memory of ``models[0]`` next to the others (peers) at square ``sizes``."""
    cfg = BenchConfig(models=list(models[:1]), peers=list(models[1:]), img_sizes=[(s, s) for s in sizes],
                      phases=("train",) if train else ("infer",), num_warm_iter=1, num_bench_iter=iters)
    return run_models(cfg, log=lambda *a: None, progress=False)
