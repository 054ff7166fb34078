"""ONNX export of the classifiers with torch's dynamo exporter: dynamic batch and image size, written atomically.

The exported graph takes a float image batch (B, C, H, W) with any B, and any H, W that are multiples of the
model's total stride (:func:`input_multiple`: 16 for the plain models, 32 for the hierarchical ones) within
[``min_side``, ``max_side``].  The TTT ops take their plain PyTorch path while exporting (``kernels/backend.py``:
Triton kernels have no ONNX form), and the export runs on the CPU.
"""

import inspect
import math
import os
from typing import List, Optional, Sequence, Tuple

import torch

from ttt_zoo.errors import ExportError  # noqa: F401  (re-exported)
from ttt_zoo.flags import MAX_EXPORT_SIDE as MAX_SIDE  # largest image side the exported graph is declared for

__all__ = ["input_multiple", "export_onnx", "ExportError"]


def input_multiple(model: torch.nn.Module) -> int:
    """What H and W must be multiples of: the largest feature reduction (the stride of the last stage)."""
    info = getattr(model, "feature_info", None) or []
    reductions = [int(f["reduction"]) for f in info if "reduction" in f]
    if reductions:
        return max(reductions)
    patch = getattr(model, "patch_size", None)
    return int(patch[0] if isinstance(patch, (tuple, list)) else patch or 1)


def _dynamic_shapes(model: torch.nn.Module, max_side: int):
    from torch.export import Dim
    m = input_multiple(model)
    lo = max(2, math.ceil(getattr(model, "min_size", 1) / m))  # >= 2: a size of one would be specialised
    h, w = Dim("height_blocks", min=lo, max=max_side // m), Dim("width_blocks", min=lo, max=max_side // m)
    return ({0: Dim("batch", min=1, max=4096), 2: m * h, 3: m * w},), lo * m


def _specialised_sizes(program) -> List[str]:
    """The dynamic sizes (batch, height or width blocks) that tracing turned into one value."""
    ep = getattr(program, "exported_program", None)
    ranges = getattr(ep, "range_constraints", None) or {}
    return sorted(f"{s} = {int(r.lower)}" for s, r in ranges.items()
                  if getattr(s, "is_Symbol", False) and r.lower == r.upper)


def export_onnx(model: torch.nn.Module, out: str, img_size: Optional[Sequence[int]] = None,
                max_side: int = MAX_SIDE, opset: Optional[int] = None, overwrite: bool = True) -> Tuple[int, int]:
    """Export ``model`` (a ttt-zoo / timm classifier) to the ONNX file ``out`` (replaced only when complete).

    ``img_size`` (H, W) is the example input the graph is traced at (default: the model's ``default_cfg``); the
    graph itself takes any batch and any multiple of :func:`input_multiple` between the returned minimum side and
    ``max_side``.  Returns (multiple, min side).  ``overwrite=False`` refuses an existing ``out`` (checked
    before the export runs).
    """
    required = [p for p in inspect.signature(model.forward).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    if len(required) != 1:
        raise ExportError("ONNX export takes image classifiers (one image batch in, logits or features out); "
                          f"{type(model).__name__} is not one (DiT models take (x, t, y)).")
    model = model.eval().cpu()
    mult = input_multiple(model)
    if img_size is None:
        img_size = tuple(getattr(model, "default_cfg", {}).get("input_size", (3, 224, 224))[-2:])
    h, w = (int(img_size[0]), int(img_size[-1]))
    dyn, min_side = _dynamic_shapes(model, max_side)
    if h % mult or w % mult or min(h, w) < min_side or max(h, w) > max_side:
        raise ExportError(f"--img-size {h}x{w}: the example size must be multiples of {mult} between {min_side} "
                          f"and {max_side} for {type(model).__name__} (the exported graph takes every such size).")
    if not overwrite and os.path.exists(out):
        raise ExportError(f"--out {out} already exists; add --force to replace it, or choose another --out")
    x = torch.randn(2, getattr(model, "in_chans", 3), h, w)
    with torch.no_grad():
        program = torch.onnx.export(model, (x,), dynamo=True, dynamic_shapes=dyn, input_names=["image"],
                                    output_names=["output"], opset_version=opset, verbose=False)
    if program is None:
        raise ExportError("torch.onnx.export returned no program (dynamo exporter unavailable?)")
    fixed = _specialised_sizes(program)
    if fixed:  # the exporter only warns ("Ignored guard"); the graph would fail at any other size
        raise ExportError(f"{type(model).__name__}: the traced code fixed a dynamic size ({', '.join(fixed)}), so the "
                          "graph would run at the example size only; nothing was written. This is a bug in the "
                          "model's code (a Python int() of a traced size): please report it.")
    from ttt_zoo.fileio import atomic_path
    with atomic_path(out) as tmp:  # fsynced, renamed when complete, the normal file mode
        program.save(tmp)
    return mult, min_side
