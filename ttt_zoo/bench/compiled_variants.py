"""Count the compiled variants of every Triton kernel a model launches, over many input shapes, without a GPU.

Triton compiles a kernel once per key of its ``JITFunction`` cache: the specialization its binder builds from the
arguments (the dtype of each pointer, 16-byte alignment and ``== 1`` of each integer not in ``do_not_specialize``),
the constexprs and the launch options.  Here a model runs forward and backward on the meta device (no memory, no
GPU; a convolution keeps a channels-last layout as on CUDA) on the Triton backend; the ``ttt_zoo::`` custom ops are
opened so that their launchers run (``kernels.utils.launch_on_meta``), and each launch records that key, with the
binder of an sm_90 target, instead of compiling (issue 48: "at most one compiled variant per dtype and head
dim for the standard shapes").

    >>> calls, dims = compile_keys("vit3_tiny", sizes=(224, 384), batches=(1, 64))
    >>> variants_per_kernel(calls, dims)   # {(kernel, dtype, head dims): most keys one call site gets over sizes}

Under ``TRITON_INTERPRET=1`` the kernels are the interpreter's and there is no compile key: :func:`available` says so.
"""
from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["STANDARD_SIZES", "STANDARD_BATCHES", "STANDARD_DTYPES", "Launch", "available", "compile_keys",
           "compile_launch", "configs", "head_dims", "variants_per_kernel"]

STANDARD_SIZES = (224, 256, 384, 512, 1024)  # image px (DiT: latents of px / 8, up to a multiple of the patch)
STANDARD_BATCHES = (1, 32, 64)
STANDARD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

Call = Tuple[str, str, str, int]  # (kernel, dtype of the model, compile key, call site: the n-th call of the kernel)


def available() -> str:
    """Why compile keys cannot be recorded here, or '' when they can."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: the kernels are interpreted, there is no compile key"
    try:
        from triton.runtime import jit  # noqa: F401
        from triton.backends.compiler import BaseBackend  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return ""


def _channels_last(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous() and \
        t.is_contiguous(memory_format=torch.channels_last)


class _OpenOps(TorchDispatchMode):
    """On meta tensors: run the ``ttt_zoo::`` custom ops' implementations (their launchers), not their fakes, and
    give a convolution of a channels-last input a channels-last output, as CUDA's convolutions do (the meta kernel
    returns a contiguous one; the layout decides the strides, and so the compile keys, of what reads it)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "ttt_zoo":
            opdef = _maybe_get_opdef(func)
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        if func is torch.ops.aten.convolution.default and _channels_last(args[0]):
            out = out.contiguous(memory_format=torch.channels_last)
        elif func is torch.ops.aten.convolution_backward.default and _channels_last(args[1]):
            out = tuple(o.contiguous(memory_format=torch.channels_last) if o is not None and o.dim() == 4 and i == 0
                        else o for i, o in enumerate(out))
        return out


#: the GPU whose binder keys the launches (its specialization rules; no GPU is needed to build it)
TARGET = ("cuda", 90, 32)


@contextlib.contextmanager
def _record(calls: List[Tuple[str, str]], launches: Optional[Dict[Tuple[str, str], Launch]] = None
            ) -> Iterator[None]:
    """``JITFunction.run`` records (kernel, key) (and in ``launches`` what compiling that key needs) and launches
    nothing."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit

    backend = make_backend(GPUTarget(*TARGET))
    binders = {}
    original = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if self not in binders:
            binders[self] = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, spec, _ = binders[self](*args, **kwargs)
        options = sorted((k, v) for k, v in kwargs.items() if k in ("num_warps", "num_stages", "num_ctas"))
        name = f"{self.fn.__module__.rsplit('.', 2)[-2]}.{self.fn.__name__}"
        key = f"{spec}{options}"
        calls.append((name, key))
        if launches is not None and (name, key) not in launches:
            launches[(name, key)] = Launch(self, dict(kwargs), bound, spec)

    jit.JITFunction.run = run
    try:
        yield
    finally:
        jit.JITFunction.run = original


class Launch(NamedTuple):
    """What compiling one recorded launch for :data:`TARGET` needs (:func:`compile_launch`)."""
    fn: object  # the JITFunction
    kwargs: dict  # its launch keywords (constexprs passed by name, num_warps, ...)
    bound: dict  # the bound arguments
    spec: list  # the binder's specialization


def compile_launch(launch: Launch, arch: int = 90):
    """Compile a recorded launch for ``sm_<arch>`` exactly as that launch would be (no GPU): a
    ``triton.compiler.CompiledKernel`` whose ``asm['ptx']`` ptxas can take."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options, signature, constexprs, attrs = launch.fn._pack_args(backend, launch.kwargs, launch.bound, launch.spec,
                                                                 None)
    return triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def head_dims(model: torch.nn.Module) -> str:
    """The head dims of the model's TTT mixers, e.g. ``'32'`` or ``'32/64'``."""
    dims = sorted({m.head_dim for m in model.modules() if isinstance(getattr(m, "head_dim", None), int)})
    return "/".join(map(str, dims)) or "-"


def _inputs(model: torch.nn.Module, px: int, batch: int, dtype: torch.dtype) -> tuple:
    from .launches import is_conditioned
    if is_conditioned(model):  # a DiT: latents of px / 8 (up to a multiple of the patch), timesteps, labels
        patch = max(getattr(model, "patch_size", 1) or 1, 1)
        side = -(-(px // 8) // patch) * patch
        x = torch.empty(batch, model.in_chans, side, side, dtype=dtype, requires_grad=True)
        return x, torch.empty(batch, dtype=dtype), torch.zeros(batch, dtype=torch.long)
    return (torch.empty(batch, 3, px, px, dtype=dtype, requires_grad=True),)


def compile_keys(name: str, sizes: Sequence[int] = STANDARD_SIZES, batches: Sequence[int] = STANDARD_BATCHES,
                 dtypes: Sequence[torch.dtype] = STANDARD_DTYPES,
                 launches: Optional[Dict[Tuple[str, str], Launch]] = None) -> Tuple[List[Call], str]:
    """(kernel, dtype, key) of every Triton launch of a forward and backward of timm model ``name`` (on the meta
    device, the Triton backend) at each square size, batch and dtype, and the model's head dims; ``launches`` (a
    dict) gets one :class:`Launch` per new (kernel, key), for :func:`compile_launch`."""
    reason = available()
    if reason:
        raise RuntimeError(f"cannot record compile keys: {reason}")
    import timm
    from ttt_zoo.kernels.backend import use_backend
    from ttt_zoo.kernels.utils import launch_on_meta

    out: List[Call] = []
    dims = "-"
    for dtype in dtypes:
        with torch.device("meta"):
            model = timm.create_model(name).to(dtype)
            dims = head_dims(model)
            for px in sizes:
                for batch in batches:
                    calls: List[Tuple[str, str]] = []
                    with use_backend("triton"), launch_on_meta(), _record(calls, launches), _OpenOps():
                        model(*_inputs(model, px, batch, dtype)).float().sum().backward()
                    model.zero_grad(set_to_none=True)
                    seen: Dict[str, int] = defaultdict(int)
                    for kernel, key in calls:  # the n-th call of a kernel in a step is one call site
                        out.append((kernel, str(dtype).replace("torch.", ""), key, seen[kernel]))
                        seen[kernel] += 1
    return out, dims


def variants_per_kernel(calls: Sequence[Call], dims: str = "-") -> Dict[Tuple[str, str, str], int]:
    """(kernel, dtype, head dims) -> compiled variants that the input size causes: the most distinct compile keys
    one call site of the kernel gets over the sizes and batches.  Call sites with different constexprs (a block's
    CPE and its MLP's conv through one kernel) are different kernels, compiled once each: see :func:`configs`."""
    keys: Dict[Tuple[str, str, str], Dict[int, Set[str]]] = defaultdict(lambda: defaultdict(set))
    for kernel, dtype, key, site in calls:
        keys[(kernel, dtype, dims)][site].add(key)
    return {k: max(len(v) for v in sites.values()) for k, sites in sorted(keys.items())}


def configs(calls: Sequence[Call], dims: str = "-") -> Dict[Tuple[str, str, str], int]:
    """(kernel, dtype, head dims) -> distinct compile keys over every call site, size and batch."""
    keys: Dict[Tuple[str, str, str], Set[str]] = defaultdict(set)
    for kernel, dtype, key, _ in calls:
        keys[(kernel, dtype, dims)].add(key)
    return {k: len(v) for k, v in sorted(keys.items())}
