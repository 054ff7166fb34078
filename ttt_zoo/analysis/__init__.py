"""Linear-attention forms of the TTT mixers and attention maps ("TTT with KV binding is secretly linear attention")."""
from .linear_attention import (KernelForm, PatchForm, ScanForm, SwiGLUForm, T5Form, ViT3Form, VisionTTTForm,
                               form_from_inputs, has_linear_attention_form, linear_attention,
                               mixer_inputs)
from .attention_map import explicit_attention_map, image_attention_maps, implicit_attention_map
from .inner_steps import record_inner_losses, vit3_inner_losses

__all__ = ["linear_attention", "has_linear_attention_form", "mixer_inputs", "form_from_inputs", "SwiGLUForm", "PatchForm", "KernelForm",
           "ScanForm", "ViT3Form", "T5Form", "VisionTTTForm", "implicit_attention_map", "explicit_attention_map",
           "image_attention_maps", "vit3_inner_losses", "record_inner_losses"]
