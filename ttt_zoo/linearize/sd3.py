"""Softmax SD3 / SD3.5 transformer -> SD3.5-T5, inheriting every pretrained tensor (needs diffusers)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from ttt_zoo.sd3.transformer import SD3T5Transformer2DModel
from .lr_scales import is_sd3_transformer

__all__ = ["linearize_sd3", "TTT_OPTIONS"]

#: the conversion options (config fields of :class:`SD3T5Transformer2DModel`)
TTT_OPTIONS = ("ttt_dual_layers", "ttt_joint_layers", "ttt_key_norm_span", "ttt_rms_qk_norm", "ttt_key_norm_eps")


def linearize_sd3(model: nn.Module, ttt_dual_layers: Optional[Sequence[int]] = None,
                  ttt_joint_layers: Optional[Sequence[int]] = None, ttt_key_norm_span: str = "joint",
                  ttt_rms_qk_norm: str = "keep", ttt_key_norm_eps: float = 1.0
                  ) -> Tuple[SD3T5Transformer2DModel, List[str]]:
    """``SD3Transformer2DModel`` -> ``SD3T5Transformer2DModel`` (the paper's layout by default).

    Every tensor of ``model.state_dict()`` is copied unchanged; only the ``*.ttt.*`` parameters are new (DiT5's
    init).  Returns ``(model, new_param_names)``; the result has the source's device, dtype and train/eval mode.
    """
    if not is_sd3_transformer(model):
        raise TypeError(f"linearize_sd3 converts a diffusers SD3Transformer2DModel (SD3 / SD3.5), got "
                        f"{type(model).__name__}.")
    if isinstance(model, SD3T5Transformer2DModel):
        raise TypeError("This model is already SD3.5-T5 (SD3T5Transformer2DModel); linearize its softmax source.")
    if any(".to_qkv." in k or ".to_added_qkv." in k for k in model.state_dict()):
        raise ValueError("The source has fused qkv projections (fuse_qkv_projections()); linearize a freshly loaded "
                         "SD3 transformer instead.")
    cfg = {k: v for k, v in model.config.items() if not k.startswith("_")}
    with torch.device("meta"):  # built empty; every tensor is then assigned (inherited) or initialised (new)
        new = SD3T5Transformer2DModel(**cfg, ttt_dual_layers=ttt_dual_layers, ttt_joint_layers=ttt_joint_layers,
                                      ttt_key_norm_span=ttt_key_norm_span, ttt_rms_qk_norm=ttt_rms_qk_norm,
                                      ttt_key_norm_eps=ttt_key_norm_eps)
    src = {k: v.detach().clone() for k, v in model.state_dict().items()}  # copies: the source stays untouched
    new_names = new.new_parameter_names()
    missing, unexpected = new.load_state_dict(src, strict=False, assign=True)
    if unexpected or set(missing) != set(new_names):
        raise RuntimeError(f"Cannot linearize this {type(model).__name__}: source tensors without a place "
                           f"{unexpected[:6]}, tensors neither inherited nor new "
                           f"{sorted(set(missing) - set(new_names))[:6]}.")
    new.init_new_parameters()
    src_buffers = dict(model.named_buffers())
    for name, buf in list(new.named_buffers()):  # non-persistent buffers are not in the state dict
        if buf.device.type == "meta":
            mod, _, leaf = name.rpartition(".")
            new.get_submodule(mod).register_buffer(leaf, src_buffers[name].clone(), persistent=False)
    new.train(model.training)
    return new, new_names
