"""Whole-model ``torch.compile`` checks: graph breaks (``torch._dynamo.explain``) and compiled-vs-eager parity.

Used by ``tests/test_compile.py`` (CI, one block per stage; and ``full_depth_check``: every family at its own depth);
``experiments/results/compile_graph_breaks.md`` and ``compile_full_depth.md`` came from these functions.
"""
import copy
import os
import time
from typing import Dict, Sequence, Tuple

import torch

from ttt_zoo.registry import create_model, is_diffusion_model, list_zoo_families
from ttt_zoo.torchcompile import compile_model, mark_step

__all__ = ["SMALL", "IMAGE_SIZES", "LATENT_SIZES", "small_model", "model_inputs", "compiled_parity", "parity_ok",
           "graph_breaks", "full_depth_check", "block_counts"]


def _one_block_kwargs() -> Dict[str, Dict]:
    """family -> its ``ONE_BLOCK_KWARGS`` (each family file keeps its own, beside its size table)."""
    import importlib
    from ttt_zoo.models import MODEL_MODULES
    out = {}
    for m in MODEL_MODULES:
        out.update(getattr(importlib.import_module(f"ttt_zoo.models.{m}"), "ONE_BLOCK_KWARGS", {}))
    return out


# one block (per stage): the same block code as the full models, compiled in a fraction of the time.  The
# hierarchical families keep two of their four stages (stem, blocks, a merge, blocks, head: every code path): with
# dynamic sizes each further stage nests the size expressions one level deeper, and inductor's symbolic-shape work
# grows much faster than the graph (four stages took over 10 min on 2 cores; ``small_model(..., full=True)``)
SMALL = _one_block_kwargs()
# non-square first: dynamo's duck sizing would give a square first call one symbol for H and W, and the
# non-square call would then recompile
IMAGE_SIZES = ((160, 256), (224, 224))  # classifiers (multiples of 32), not square and square
LATENT_SIZES = ((24, 40), (32, 32))  # DiT latents (the s_2 models' default is 32)


def small_model(family: str, full: bool = False) -> Tuple[str, torch.nn.Module, Sequence[Tuple[int, int]]]:
    """The family's smallest registered model (one block per stage unless ``full``; zero-initialised weight
    matrices randomised, so that every output depends on every block) and the two sizes to check."""
    families = list_zoo_families(include_diffusion=True)
    if family not in families:
        raise KeyError(f"unknown family {family!r}; families: {sorted(families)}")
    name = families[family]
    torch.manual_seed(0)
    model = create_model(name, **({} if full else SMALL.get(family, {})))
    with torch.no_grad():  # zero-initialised tensors (DiT's adaLN-zero and final layer) would make the output 0
        for p in model.parameters():
            if p.dim() > 1 and not p.any():
                p.normal_(0.0, 0.02)
    return name, model, LATENT_SIZES if is_diffusion_model(name) else IMAGE_SIZES


def model_inputs(name: str, model: torch.nn.Module, hw: Tuple[int, int], batch: int = 2, seed: int = 0) -> Tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, getattr(model, "in_chans", 3), *hw, generator=g)
    if is_diffusion_model(name):
        return x, torch.rand(batch, generator=g) * 999, torch.randint(0, 1000, (batch,), generator=g)
    return (x,)


def _step(fn, model: torch.nn.Module, args: Tuple) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = fn(*args)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))  # a loss touching every output
    (out * w).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compiled_parity(name: str, model: torch.nn.Module, sizes: Sequence[Tuple[int, int]],
                    backend: str = "inductor", dynamic: bool = True) -> Dict:
    """One ``torch.compile(dynamic=dynamic)`` of ``model`` run at every size, forward and backward, against eager:
    ``fwd`` / ``grad`` = max relative error (max |compiled - eager| / max |eager|) of the output and of every
    parameter gradient; ``fwd_f64`` / ``grad_f64`` the same against eager in float64 (the arbiter where the two
    float32 runs part at a ReLU input within rounding of 0: its gradient flips between them, a measure-zero kink,
    not a compile error); ``graphs`` = graphs dynamo compiled over all sizes; ``seconds``."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.eval()  # no dropout / label dropout: eager and compiled see the same function
    exact = copy.deepcopy(model).double()
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    res = dict(fwd=0.0, grad=0.0, fwd_f64=0.0, grad_f64=0.0, sizes=[])
    t0 = time.perf_counter()
    for hw in sizes:
        args = model_inputs(name, model, hw)
        ref, gref = _step(model, model, args)
        r64, g64 = _step(exact, exact, tuple(a.double() if a.is_floating_point() else a for a in args))
        out, gout = _step(compiled, model, args)
        if set(gout) != set(gref):
            raise AssertionError(f"{name}: the compiled backward reached other parameters than eager's")
        res["fwd"] = max(res["fwd"], _rel(out, ref))
        res["grad"] = max([res["grad"]] + [_rel(gout[k], gref[k]) for k in gref])
        res["fwd_f64"] = max(res["fwd_f64"], _rel(out, r64.float()))
        res["grad_f64"] = max([res["grad_f64"]] + [_rel(gout[k], g64[k].float()) for k in g64])
        res["sizes"].append("x".join(map(str, hw)))
    res["seconds"] = time.perf_counter() - t0
    res["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return res


def parity_ok(res: Dict, tol: float = 1e-4) -> bool:
    """Compiled equals eager within ``tol`` (forward and gradients) in float32, or, where the float32 runs part,
    equals eager float64 within ``tol``."""
    return min(res["fwd"], res["fwd_f64"]) < tol and min(res["grad"], res["grad_f64"]) < tol


def graph_breaks(name: str, model: torch.nn.Module, hw: Tuple[int, int]) -> Dict:
    """``torch._dynamo.explain`` of the eval forward with symbolic sizes (as ``torch.compile(dynamic=True)`` traces
    it): ``graphs``, ``breaks`` and the distinct break reasons."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(assume_static_by_default=False):
        e = torch._dynamo.explain(model.eval())(*model_inputs(name, model, hw))
    return dict(graphs=e.graph_count, breaks=e.graph_break_count, reasons=_reasons(e))


def _reasons(explained) -> list:
    out = []
    for b in explained.break_reasons:
        where = b.user_stack[-1] if b.user_stack else None
        out.append(f"{b.reason.splitlines()[0][:80]} at {os.path.basename(where.filename)}:{where.lineno}"
                   if where else b.reason.splitlines()[0][:80])
    return sorted(set(out))


def block_counts(model: torch.nn.Module):
    """Blocks of a plain model (an int), or of each stage of a hierarchical one (a tuple)."""
    if hasattr(model, "layers"):
        return tuple(len(stage.blocks) for stage in model.layers)
    return len(model.blocks)


def full_depth_check(family: str, steps: int = 2, backend: str = "eager", batch: int = 2,
                     explain: bool = True) -> Dict:
    """The family's smallest registered model at its own depth, as ``--torchcompile --torchcompile-mode
    reduce-overhead`` traces it (static sizes first, at the model's own square size): ``torch._dynamo.explain`` of
    the training forward (``graphs``, ``breaks``, ``reasons``, ``ops``), then ``steps`` training steps (forward and
    backward) of one size through :func:`ttt_zoo.torchcompile.compile_model` with ``backend`` (the mode's code
    generation, inductor and CUDA graphs, sits behind dynamo: the graphs and guards are dynamo's), counting the
    graphs dynamo compiled after each step (``graphs_per_step``; a recompile raises the count) and timing each step
    (``step_s``: the first holds the trace). ``explain_s``: wall time of explain.  ``explain=False`` skips explain
    (a third of the time): ``graphs`` and ``breaks`` then come from dynamo's counters after the first step (a break
    ends one graph and starts another, so one graph means no break), ``reasons`` from its graph-break counter."""
    name, model, sizes = small_model(family, full=True)
    hw = sizes[-1]
    args = model_inputs(name, model, hw, batch=batch)
    model.train()
    torch._dynamo.reset()
    e, explain_s = None, None
    if explain:
        t0 = time.perf_counter()
        e = torch._dynamo.explain(model)(*args)
        explain_s = time.perf_counter() - t0
        torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = compile_model(model, backend)
    graphs, step_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        mark_step(True)
        model.zero_grad(set_to_none=True)
        out = compiled(*args)
        out.float().square().mean().backward()
        step_s.append(time.perf_counter() - t0)
        graphs.append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
        if e is None and len(graphs) == 1:
            reasons = sorted(torch._dynamo.utils.counters["graph_break"])
    if e is not None:
        found = dict(graphs=e.graph_count, breaks=e.graph_break_count, reasons=_reasons(e), ops=e.op_count)
    else:
        found = dict(graphs=graphs[0], breaks=max(graphs[0] - 1, len(reasons)), reasons=reasons, ops=None)
    return dict(family=family, model=name, depth=block_counts(model), size="x".join(map(str, hw)), batch=batch,
                backend=backend, **found, explain_s=explain_s, graphs_per_step=graphs, step_s=step_s)
