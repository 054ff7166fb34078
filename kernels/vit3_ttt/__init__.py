from .reference import swiglu_ttt_reference, dwconv_ttt_reference

__all__ = ["swiglu_ttt_reference", "dwconv_ttt_reference"]
