"""Count what a step launches: kernel-launching aten ops and Triton kernels, on any device (the CPU included).

A GPU step's cost below a few thousand tokens is its launches, so they are counted, not timed (issue 39).  The
count is taken where a GPU would launch: at the dispatcher, below autograd and below the composite decompositions
(``linear`` is one ``addmm``; ``dropout`` in eval is nothing), with every aten op that is not a view, an allocation
without a fill or a no-op (:data:`NO_LAUNCH`) counted as one launch.  The ``ttt_zoo::`` custom ops are opened: their
own aten ops and Triton kernels are counted (a GPU launches them too).  Triton kernels are counted at their launch
(compiled or under ``TRITON_INTERPRET=1``); the aten ops the interpreter runs inside a launch are not.

    >>> counts = count_launches(lambda: block(x, feat_size))                    # inference
    >>> counts = count_launches(lambda: block(x, feat_size).sum().backward())   # a training step (fwd + bwd)
    >>> counts.aten_total, counts.triton_total, counts.total
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Counter, Iterator, List, Optional

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LaunchCounts", "NO_LAUNCH", "block_launches", "code_paths", "count_launches", "count_triton_launches",
           "is_conditioned", "model_inputs", "skip_triton_kernels", "smallest_img_size"]

OPENED_NAMESPACE = "ttt_zoo"  # custom ops whose insides are counted
# aten ops that launch no kernel (views are recognised from their schema)
NO_LAUNCH = frozenset((
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "detach",
    "lift_fresh", "lift_fresh_copy_noop", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim",
    "is_same_size", "_has_compatible_shallow_copy_type", "resolve_conj", "resolve_neg", "set_", "_nested_tensor_size",
    "is_nonzero_noop", "prim_layout", "record_stream",
))


@dataclass
class LaunchCounts:
    """Launches of one call: ``aten`` (leaf op name -> count) and ``triton`` (kernel name -> count)."""
    aten: Counter = field(default_factory=collections.Counter)
    triton: Counter = field(default_factory=collections.Counter)
    by_op: Counter = field(default_factory=collections.Counter)  # launches inside each ``ttt_zoo::`` op, by op
    # a block's share of model-level work done once for all blocks (DiT's conditioning GEMM: its launches divided by
    # the number of blocks, rounded up), counted in ``total``
    shared: int = 0

    def op_launches(self, name: str) -> int:
        """Launches inside the custom op ``ttt_zoo::<name>`` (aten ops and Triton kernels)."""
        return self.by_op[name]

    @property
    def aten_total(self) -> int:
        return sum(self.aten.values())

    @property
    def triton_total(self) -> int:
        return sum(self.triton.values())

    @property
    def total(self) -> int:
        return self.aten_total + self.triton_total + self.shared

    def table(self) -> List[str]:
        rows = [f"| {n} | {c} |" for n, c in self.aten.most_common()] + \
               [f"| triton {n} | {c} |" for n, c in self.triton.most_common()]
        return ["| op | launches |", "|---|---|"] + rows


def _jit_classes():
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: nothing to count
        return []
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return classes


_inside_triton = [0]  # > 0 while a Triton launch runs: its interpreter's aten ops are not launches
_op_stack: List[str] = []  # the opened ttt_zoo:: ops being run (innermost last)
_by_op: List[Counter] = []  # the by-op counter of the current count_launches call


@contextlib.contextmanager
def count_triton_launches(counter: Counter) -> Iterator[Counter]:
    """Count every Triton kernel launched inside (``kernel[grid](...)``), by kernel name."""
    patched = []
    for cls in _jit_classes():
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            name = getattr(getattr(self, "fn", None), "__name__", None) or getattr(self, "__name__", "kernel")
            if not _inside_triton[0]:
                counter[name] += 1
                if _op_stack and _by_op:
                    _by_op[-1][_op_stack[-1]] += 1
            _inside_triton[0] += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                _inside_triton[0] -= 1

        cls.run = run
        patched.append((cls, original))
    try:
        yield counter
    finally:
        for cls, original in patched:
            cls.run = original


@contextlib.contextmanager
def skip_triton_kernels() -> Iterator[None]:
    """Launch Triton kernels without running them: a launch is still a call of ``kernel[grid](...)`` (counted by
    :func:`count_triton_launches` inside), but its outputs keep whatever the buffers held.  For counting only: a
    block's launches do not depend on the values (no data-dependent branches; tests/test_launch_counts.py checks
    the counts against a run that executes them), and the interpreter's minutes per block become a second."""
    patched = []
    for cls in _jit_classes():
        original = cls.run
        cls.run = lambda self, *args, **kwargs: None
        patched.append((cls, original))
    try:
        yield
    finally:
        for cls, original in patched:
            cls.run = original


def _is_composite(func) -> bool:
    return func.namespace == "aten" and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "CompositeImplicitAutograd")


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class _LaunchCounter(TorchDispatchMode):
    def __init__(self, counter: Counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _op_stack and _is_composite(func):
            # inside an opened op the composite ops (``contiguous``, ``to``, ``reshape``) arrive undecomposed, as
            # views by their schema: run their decomposition here, so that a copy they make is counted
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func.namespace == OPENED_NAMESPACE:
            opdef = _maybe_get_opdef(func)
            if opdef is not None:  # count what the op's implementation launches
                _op_stack.append(func._schema.name.split("::")[-1])
                try:
                    with self:
                        return opdef._init_fn(*args, **kwargs)
                finally:
                    _op_stack.pop()
        if not _inside_triton[0] and func.namespace == "aten" and not _is_view(func) \
                and func._schema.name.split("::")[-1] not in NO_LAUNCH:
            self.counter[func._schema.name.split("::")[-1]] += 1
            if _op_stack and _by_op:
                _by_op[-1][_op_stack[-1]] += 1
        return func(*args, **kwargs)


def count_launches(fn: Callable[[], object]) -> LaunchCounts:
    """Run ``fn()`` once and count its launches (see the module docstring).  Warm up first: lazy initialisation
    (a Triton compile, a cache fill) would count too."""
    counts = LaunchCounts()
    _by_op.append(counts.by_op)
    try:
        with count_triton_launches(counts.triton), _LaunchCounter(counts.aten):
            fn()
    finally:
        _by_op.pop()
    return counts


def is_conditioned(model: torch.nn.Module) -> bool:
    """A DiT-family model: ``forward(x, t, y)`` on latents, timesteps and class labels."""
    return hasattr(model, "t_embedder") and hasattr(model, "y_embedder")


def _strides(model: torch.nn.Module) -> List[int]:
    info = getattr(model, "feature_info", None)
    strides = [f["reduction"] for f in info if "reduction" in f] if isinstance(info, list) else []
    patch = getattr(model, "patch_size", None) or getattr(getattr(model, "patch_embed", None), "patch_size", None)
    patch = max(patch) if isinstance(patch, (tuple, list)) else patch
    strides += [patch] if patch else []
    if not strides:
        raise ValueError(f"{type(model).__name__}: no feature_info reductions and no patch size to size the input")
    return strides


def _neighbourhood_windows(model: torch.nn.Module) -> List[int]:
    """The neighbourhood-attention windows of the model's mixers (T5+'s ``na_kernel``, DiT5's ``kernel_size``)."""
    windows = []
    for m in model.modules():
        windows.append(getattr(m, "na_kernel", 0) or 0)
        k = getattr(m, "kernel_size", None)
        if isinstance(k, int) and hasattr(m, "dilation"):  # a mixer's window (a conv's kernel_size is a tuple)
            windows.append(k * m.dilation)
    return [w for w in windows if w > 1]


def smallest_img_size(model: torch.nn.Module) -> int:
    """The smallest input side at which the first block runs the code path of a full-size input: a 2 x 2 token map
    (a single token skips work), the model's own minimum (``min_size``), and a neighbourhood window that fits the
    map (a smaller map clamps the window: another path).  Launch counts do not depend on the size beyond that, but
    for Python loops over tiles or mini-batches (tests/test_launch_counts.py counts models at two sizes)."""
    first = min(_strides(model))  # the first block's stride
    windows = _neighbourhood_windows(model)
    return max(2 * first, getattr(model, "min_size", 0) or 0, first * max(windows, default=0))


def model_inputs(model: torch.nn.Module, img_size: int, batch: int = 2, seed: int = 0) -> tuple:
    """The positional inputs of ``model``: ``(images,)``, or ``(latents, timesteps, labels)`` for a DiT."""
    g = torch.Generator().manual_seed(seed)
    if is_conditioned(model):
        x = torch.randn(batch, model.in_chans, img_size, img_size, generator=g)
        t = torch.randint(0, 1000, (batch,), generator=g).float()
        y = torch.randint(0, model.num_classes, (batch,), generator=g)
        return x, t, y
    return (torch.randn(batch, 3, img_size, img_size, generator=g),)


class _Captured(Exception):
    pass


def _first_block(model: torch.nn.Module, inputs: tuple):
    """The model's first block and the (args, kwargs) it is called with on ``inputs`` (captured by a hook)."""
    blocks = [m for n, m in model.named_modules() if n.endswith("blocks.0")]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no module named '*blocks.0'")
    seen = {}

    def grab(module, args, kwargs):
        seen["call"] = (args, kwargs)
        raise _Captured  # the rest of the model is not needed (the interpreter would run every block)

    handle = blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(*inputs)
    except _Captured:
        pass
    finally:
        handle.remove()
    return blocks[0], seen["call"]


def block_launches(model: torch.nn.Module, img_size: Optional[int] = None, batch: int = 2, seed: int = 0,
                   run_triton: bool = True):
    """(inference, training) :class:`LaunchCounts` of the model's first block on its input at ``img_size``
    (default: :func:`smallest_img_size`).  DiT-family models get timesteps and labels too: their block's
    conditioning input is counted as an input that needs a gradient, like the tokens.  ``run_triton=False``:
    Triton kernels are launched but not run (:func:`skip_triton_kernels`; the same counts, in seconds).

    Inference: eval mode under ``no_grad``.  Training: train mode, forward + ``.sum().backward()`` with the
    gradients set to None beforehand (as ``optimizer.zero_grad()`` leaves them), after one warm-up step each.
    Work the model does once for all its blocks (a DiT's :meth:`modulations`: one GEMM for every block's adaLN
    vectors) is counted too, as each block's share (``LaunchCounts.shared``).
    """
    with contextlib.nullcontext() if run_triton else skip_triton_kernels():
        return _block_launches(model, img_size or smallest_img_size(model), batch, seed)


def _block_launches(model: torch.nn.Module, img_size: int, batch: int, seed: int):
    model.eval()
    inputs = model_inputs(model, img_size, batch, seed)
    block, (args, kwargs) = _first_block(model, inputs)
    # a list of tensors (a DiT block's modulation vectors, views of the model's one GEMM): leaves of their own
    args = tuple([t.detach().clone() for t in a] if isinstance(a, (list, tuple)) and a
                 and all(isinstance(t, torch.Tensor) for t in a) else a for a in args)
    tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
    run = lambda: block(*args, **kwargs)  # noqa: E731
    with torch.no_grad():
        run()
        infer = count_launches(run)
    block.train()
    for t in tensors:
        t.requires_grad_(t.is_floating_point())

    def step():
        block.zero_grad(set_to_none=True)
        for t in tensors:
            t.grad = None
        out = run()
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    step()  # warm-up
    train = count_launches(step)  # setting gradients to None launches nothing
    if is_conditioned(model) and hasattr(model, "modulations"):
        infer.shared, train.shared = _shared_conditioning(model, args[1], len(model.blocks))
    return infer, train


def _shared_conditioning(model: torch.nn.Module, c: torch.Tensor, blocks: int):
    """A block's share of ``model.modulations(c)`` (inference, training step: forward and backward), rounded up."""
    c = c.detach().clone()
    with torch.no_grad():
        model.modulations(c)
        infer = count_launches(lambda: model.modulations(c))
    c.requires_grad_()
    grads = [torch.ones_like(v) for vs in model.modulations(c) for v in vs]  # the warm-up, and the seeds

    def step():
        model.zero_grad(set_to_none=True)
        c.grad = None
        torch.autograd.backward([v for vs in model.modulations(c) for v in vs], grads)

    step()
    train = count_launches(step)
    return -(-infer.total // blocks), -(-train.total // blocks)


def code_paths(include_diffusion: bool = False) -> List[str]:
    """Every code path at its smallest size: the registry's tiny classifiers and their variants, and with
    ``include_diffusion`` the smallest model of each diffusion family (``*_s_2``)."""
    from ttt_zoo.registry import is_variant_model, list_zoo_models  # absolute: the script loads this file by path
    names = [m for m in list_zoo_models(include_diffusion=False)
             if m.split("_")[-1] == "tiny" or (is_variant_model(m) and "_tiny_" in m)]
    if include_diffusion:
        names += [m for m in list_zoo_models(include_diffusion=True)
                  if m.endswith("_s_2") and not m.startswith("dit_")]  # DiT itself is the softmax peer
    return names
