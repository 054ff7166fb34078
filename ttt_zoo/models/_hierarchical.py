"""The hierarchical TTT backbone API shared by H-ViT3 and Vision-TTT-H.

Stem -> stages ``layers`` (each with ``blocks`` and an optional ``downsample``) -> ``norm`` -> pool -> head.  The
families build their own stem, stages and norm (and their own ``forward_intermediates``: where a stage
downsamples differs); everything else lives here.
"""

from typing import Any, Dict, List, Union

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import register_notrace_function
from timm.models._features import feature_take_indices

from ._common import TTTClassifier

__all__ = ["HierarchicalTTT", "pad_to_multiple"]


@register_notrace_function
def pad_to_multiple(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad an NCHW map on the right/bottom so H and W are multiples of ``multiple`` (the stems' stride)."""
    ph = (multiple - x.shape[-2] % multiple) % multiple
    pw = (multiple - x.shape[-1] % multiple) % multiple
    if ph or pw:
        x = F.pad(x, (0, pw, 0, ph))
    return x


class HierarchicalTTT(TTTClassifier):
    """Subclasses build ``patch_embed``, ``layers``, ``norm``, call :meth:`init_head` and define ``_stem``."""

    def __init__(self, num_classes: int, global_pool: str, in_chans: int, num_features: int,
                 display_name: str = ""):
        super().__init__(num_classes, global_pool, in_chans, display_name)
        self.num_features = self.head_hidden_size = num_features
        self.grad_checkpointing = False

    # ----- timm model API -----
    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r"^patch_embed",
            blocks=r"^layers\.(\d+)" if coarse else [
                (r"^layers\.(\d+)\.downsample", (0,)),
                (r"^layers\.(\d+)\.blocks\.(\d+)", None),
                (r"^norm", (99999,)),
            ])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable
        for stage in self.layers:
            stage.grad_checkpointing = enable

    # ----- forward -----
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the normalised last-stage map (stride 32), laid out as ``output_fmt``."""
        x = self._stem(x)
        for stage in self.layers:
            x = stage(x)
        return self.norm(x)

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        self.layers = self.layers[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices
