from .mixer import TTTMixer, create_mixer, list_mixers, register_mixer
from .vit3_ttt import ViT3TTT
from .ttt_linear import TTTLinearMixer
from .block import TTTBlock, TokenMlp, map_to_tokens, tokens_to_map
from .rope import apply_rope_2d, rope_2d_tables

__all__ = ["TTTMixer", "create_mixer", "list_mixers", "register_mixer", "ViT3TTT", "TTTLinearMixer", "TTTBlock", "TokenMlp",
           "map_to_tokens", "tokens_to_map", "apply_rope_2d", "rope_2d_tables"]
