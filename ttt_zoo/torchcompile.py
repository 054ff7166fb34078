"""``--torchcompile [BACKEND]`` and ``--torchcompile-mode MODE`` (timm's spellings) of every command that runs a model
(``train``, ``validate``, ``predict``, ``sample``, ``bench``): the flags, their one check and the one place that
compiles.  ``--torchcompile --torchcompile-mode reduce-overhead`` is inductor with CUDA graphs; a training loop calls
:func:`mark_step` before each step (``torch.compiler.cudagraph_mark_step_begin``)."""
from __future__ import annotations

from typing import Optional

from .errors import UsageError

__all__ = ["MODES", "add_torchcompile_args", "check_torchcompile", "compile_model", "mark_step"]

#: torch.compile's modes (inductor's); reduce-overhead = CUDA graphs
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def add_torchcompile_args(p, mode_help: str = "torch.compile mode (reduce-overhead: CUDA graphs); needs "
                                              "--torchcompile's inductor") -> None:
    p.add_argument("--torchcompile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile the model (default backend inductor; eager / aot_eager: dynamo only)")
    p.add_argument("--torchcompile-mode", default=None, choices=MODES, help=mode_help)


def check_torchcompile(backend: Optional[str], mode: Optional[str] = None) -> None:
    """Refuse an unknown backend, and a mode without ``--torchcompile`` or with a backend that ignores it."""
    if backend is None:
        if mode is not None:
            raise UsageError(f"--torchcompile-mode {mode} needs --torchcompile; add --torchcompile (inductor) or "
                             f"leave out --torchcompile-mode")
        return
    import torch._dynamo
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise UsageError(f"--torchcompile {backend!r} is not a torch.compile backend; give one of "
                         f"{', '.join(torch._dynamo.list_backends())}, eager or aot_eager, or leave out the name "
                         f"for inductor")
    if mode not in (None, "default") and backend != "inductor":
        raise UsageError(f"--torchcompile-mode {mode} is inductor's and the {backend} backend ignores it; give "
                         f"--torchcompile inductor (or no name), or leave out --torchcompile-mode")


def compile_model(model, backend: Optional[str], mode: Optional[str] = None, forward_only: bool = False):
    """``torch.compile(model, backend=backend, mode=mode)`` (``model`` itself when ``backend`` is None), as timm's
    ``train.py`` / ``validate.py``: moved to its device first, and the uncompiled module keeps the weights and the
    state dict (no ``_orig_mod.`` keys).  ``forward_only``: compile ``model.forward`` in place instead, so that
    methods calling ``self.forward`` (DiT's ``forward_with_cfg``) run compiled too."""
    check_torchcompile(backend, mode)
    if backend is None:
        return model
    import torch
    if forward_only:
        model.forward = torch.compile(model.forward, backend=backend, mode=mode)
        return model
    return torch.compile(model, backend=backend, mode=mode)


def mark_step(compiled: bool) -> None:
    """Before each step of a compiled model: a new CUDA graph replay (``reduce-overhead``); harmless on the CPU."""
    if compiled:
        import torch
        torch.compiler.cudagraph_mark_step_begin()
