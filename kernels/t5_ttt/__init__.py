from .reference import t5_inner_update_reference, t5_swiglu_ttt_reference

__all__ = ["t5_swiglu_ttt_reference", "t5_inner_update_reference"]
