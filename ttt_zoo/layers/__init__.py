from .mixer import TTTMixer, create_mixer, list_mixers, register_mixer
from .vit3_ttt import ViT3TTT
from .block import TTTBlock, TokenMlp, map_to_tokens, tokens_to_map
from .t5_ttt import T5TTT, neighborhood_attention_2d
from .rope import apply_rope_2d, rope_2d_tables

__all__ = ["TTTMixer", "create_mixer", "list_mixers", "register_mixer", "ViT3TTT", "TTTBlock", "TokenMlp",
           "map_to_tokens", "tokens_to_map", "T5TTT", "neighborhood_attention_2d", "apply_rope_2d", "rope_2d_tables"]
