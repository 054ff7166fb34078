from .reference import mlp_ttt_reference

__all__ = ["mlp_ttt_reference"]
