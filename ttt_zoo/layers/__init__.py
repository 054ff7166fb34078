from .mixer import TTTMixer, create_mixer, family_mixer_kwargs, list_mixers, register_mixer
from .vit3_ttt import ViT3TTT
from .attention import SoftmaxAttention
from .dit5_mixer import DiT5MixedAttention
from .neighborhood import neighborhood_attention_2d
from .ttt_linear import TTTLinearMixer
from .block import ResidualCPE, TTTBlock, TokenMlp, map_to_tokens, tokens_as_map, tokens_to_map
from .t5_ttt import T5TTT
from .rope import apply_rope_2d, rope_2d_tables

__all__ = ["TTTMixer", "create_mixer", "family_mixer_kwargs", "list_mixers", "register_mixer", "ViT3TTT", "TTTLinearMixer", "SoftmaxAttention",
           "DiT5MixedAttention", "T5TTT", "neighborhood_attention_2d", "ResidualCPE", "TTTBlock", "TokenMlp", "map_to_tokens",
           "tokens_to_map", "tokens_as_map", "apply_rope_2d", "rope_2d_tables"]
