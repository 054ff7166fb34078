from .reference import key_norm_bwd, key_norm_fwd, key_norm_reference, key_norm_torch

__all__ = ["key_norm_reference", "key_norm_torch", "key_norm_fwd", "key_norm_bwd"]
