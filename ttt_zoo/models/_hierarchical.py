"""The hierarchical TTT backbone API shared by H-ViT3 and Vision-TTT-H.

Stem -> stages ``layers`` (each with ``blocks`` and an optional ``downsample``) -> ``norm`` -> pool -> head.  The
families build their own stem, stages and norm (and their own ``forward_intermediates``: where a stage
downsamples differs); everything else lives here.
"""

from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import register_notrace_function

from ._common import TTTClassifier, drop_path_schedule, init_weights, reset_inner_parameters

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
    """Subclasses build ``patch_embed``, ``layers``, ``norm``, call :meth:`init_head` and define ``_stem``.

    Each stage has ``forward_blocks`` and an optional ``downsample``, run after its blocks (H-ViT3) or, with
    ``downsample_first``, before them (Swin layout, Vision-TTT-H); intermediates are the blocks' outputs."""

    downsample_first: bool = False

    def __init__(self, num_features: int, num_classes: int = 1000, global_pool: str = "avg", in_chans: int = 3,
                 img_size: Any = 224, display_name: str = ""):
        """timm's num_classes, global_pool, in_chans; img_size is accepted and unused (any input size runs)."""
        super().__init__(num_classes, global_pool, in_chans, display_name)
        self.num_features = self.head_hidden_size = num_features
        self.grad_checkpointing = False

    def init_stages(self, depths: Sequence[int], dims: Sequence[int], drop_path_rate: float,
                    make_stage: Callable[[int, List[float]], nn.Module]) -> None:
        """``layers``: ``make_stage(i, drop-path rates of its blocks)`` per stage (the rates rise over all blocks),
        and their ``feature_info`` (stage i: ``dims[i]`` channels at stride 4 * 2**i)."""
        dpr = drop_path_schedule(drop_path_rate, sum(depths))
        self.layers = nn.ModuleList()
        self.feature_info = []
        for i in range(len(depths)):
            start = sum(depths[:i])
            self.layers.append(make_stage(i, dpr[start:start + depths[i]]))
            self.feature_info.append(dict(num_chs=dims[i], reduction=4 * 2 ** i, module=f"layers.{i}"))

    def init_norm_head(self, norm: nn.Module, drop_rate: float) -> None:
        """The final ``norm`` and the head, then the official init of every weight and of the TTT inner ones."""
        self.norm = norm
        self.init_head(self.num_features, drop_rate)
        self.apply(init_weights)
        reset_inner_parameters(self)

    # ----- timm model API -----
    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        # layer decay: a stage's downsample shares the layer of its first block (Swin layout), or of its last block
        # when it runs after them (H-ViT3; timm reads a trailing 99999 as "the previous layer")
        return dict(
            stem=r"^patch_embed",
            blocks=r"^layers\.(\d+)" if coarse else [
                (r"^layers\.(\d+)\.downsample", (0,) if self.downsample_first else (99999,)),
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

    def _intermediates(self, x: torch.Tensor, take_indices: List[int], last: int, norm: bool, output_fmt: str,
                       intermediates_only: bool) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Stage outputs at strides 4, 8, 16, 32 (before the downsample of a ``downsample_first=False`` stage)."""
        x = self._stem(x)
        intermediates = []
        for i in range(last):
            stage = self.layers[i]
            if self.downsample_first and stage.downsample is not None:
                x = stage.downsample(x)
            x = stage.forward_blocks(x)
            if i in take_indices:
                y = self.norm(x) if norm and i == len(self.layers) - 1 else x
                intermediates.append(y if output_fmt == self.output_fmt else y.permute(0, 3, 1, 2).contiguous())
            if not self.downsample_first and stage.downsample is not None and (i < last - 1 or not intermediates_only):
                x = stage.downsample(x)
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates
