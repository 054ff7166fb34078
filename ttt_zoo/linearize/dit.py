"""Softmax DiT -> DiT5 (half TTT, half neighbourhood attention), inheriting every tensor of the DiT.

"Linearizing Vision Transformer with Test-Time Training" (arXiv 2605.02772), ``DiT5/models.py`` of the official
code.  No trained DiT5 weights are released: this is how a DiT5 is made from a pretrained ``dit_*``.
"""
from typing import List, Tuple

from ttt_zoo.layers import SoftmaxAttention
from ttt_zoo.models.dit import DiT
from ttt_zoo.models.dit5 import dit5_cfg_for

__all__ = ["linearize_dit"]


def linearize_dit(model: DiT, kernel_size: int = 5, dilation: int = 1) -> Tuple[DiT, List[str]]:
    """Convert a softmax DiT into DiT5, inheriting every tensor of ``model``.

    The DiT5 model has the same size, patch size, classes and latent size; every entry of ``model.state_dict()``
    (embedders, pos_embed, adaLN, qkv/proj, MLPs, final layer) is copied exactly.  Only the DiT5-specific mixer
    parameters are new, initialised as in the official code: ``w1``/``w2`` trunc-normal(.02), ``qk_scale_ttt`` 1,
    ``qk_offset_ttt`` 0, ``q_conv2d``/``k_conv2d`` PyTorch's default conv init.

    Returns:
        (dit5 model on the device/dtype of ``model``, in its train/eval mode; sorted names of the new parameters)
    """
    if not isinstance(model, DiT) or not all(isinstance(b.attn, SoftmaxAttention) for b in model.blocks):
        raise TypeError("linearize_dit expects a softmax DiT (a ttt_zoo DiT built with mixer='softmax', e.g. "
                        f"timm.create_model('dit_s_2')), got {type(model).__name__}"
                        + (f" with mixer {model.mixer!r}" if isinstance(model, DiT) else "") + ".")
    if any(b.cpe is not None for b in model.blocks):
        raise TypeError("linearize_dit expects a DiT without CPE (DiT5 blocks have none).")
    blk = model.blocks[0]
    ref = model.pos_embed
    kwargs = dict(input_size=model.grid_size[0] * model.patch_size, patch_size=model.patch_size,
                  in_chans=model.in_chans, hidden_size=model.hidden_size, depth=len(model.blocks),
                  num_heads=blk.attn.num_heads, mlp_ratio=blk.mlp.fc1.out_features / model.hidden_size,
                  class_dropout_prob=model.y_embedder.dropout_prob, num_classes=model.num_classes,
                  learn_sigma=model.learn_sigma, mixer_kwargs=dict(kernel_size=kernel_size, dilation=dilation))
    new = DiT(mixer="dit5_mixed", **kwargs)
    if model.grid_size[0] != model.grid_size[1]:
        raise ValueError(f"linearize_dit supports models built for square latents, got grid {model.grid_size}.")
    new = new.to(device=ref.device, dtype=ref.dtype)
    src = model.state_dict()
    missing, unexpected = new.load_state_dict(src, strict=False)
    if unexpected:
        raise RuntimeError(f"linearize_dit: source tensors with no place in DiT5: {unexpected[:5]}")
    new.train(model.training)
    arch = str((getattr(model, "pretrained_cfg", None) or {}).get("architecture", "dit"))
    new.pretrained_cfg = dict(dit5_cfg_for(arch))
    # how to build it again by name (a run records it: its readers rebuild the model without the source)
    new.build_spec = {"model": "dit5_s_2", "model_kwargs": kwargs}  # every size argument given
    return new, sorted(missing)
