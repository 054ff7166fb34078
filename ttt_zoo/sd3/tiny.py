"""Tiny random SD3 components, built offline (tests, the tiny fine-tune, docs examples).

CLIP-L / CLIP-G / T5 text encoders from ``transformers`` configs with a small word-level vocabulary, an
``AutoencoderKL``, ``FlowMatchEulerDiscreteScheduler`` and a softmax ``SD3Transformer2DModel`` of SD3.5-Medium's
shape (dual-attention blocks first, RMS q/k norm) at a tiny width.  Nothing is downloaded.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["TINY_TRANSFORMER", "tiny_transformer_config", "tiny_sd3_components", "tiny_sd3_pipeline", "WORDS"]

#: SD3.5-Medium's layout at a tiny size: 6 blocks, the first 3 dual-attention -> "Dual (3) + Joint (last 5)"
TINY_TRANSFORMER: Dict[str, Any] = dict(
    sample_size=16, patch_size=2, in_channels=4, num_layers=6, attention_head_dim=8, num_attention_heads=4,
    joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
    pos_embed_max_size=16, dual_attention_layers=(0, 1, 2), qk_norm="rms_norm")
#: the tiny tokenizers' vocabulary (captions of the tiny fine-tune use these words)
WORDS = ("a", "red", "green", "blue", "square", "circle", "stripe", "on", "black", "white", "photo", "of", "big",
         "small", "left", "right", "top", "bottom")


def tiny_transformer_config(**overrides) -> Dict[str, Any]:
    return dict(TINY_TRANSFORMER, **overrides)


def _clip_tokenizer():
    """CLIP BPE over characters, with merges that spell each of ``WORDS`` as one token."""
    from transformers import CLIPTokenizer
    chars = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["<|startoftext|>", "<|endoftext|>"] + list(chars) + [c + "</w>" for c in chars]
    merges = []
    for w in WORDS:
        syms = list(w[:-1]) + [w[-1] + "</w>"]
        while len(syms) > 1:
            merges.append((syms[0], syms[1]))
            syms = [syms[0] + syms[1]] + syms[2:]
            vocab.append(syms[0])
    vocab = list(dict.fromkeys(vocab))
    merges = list(dict.fromkeys(merges))
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges, model_max_length=16)


def _t5_tokenizer():
    from transformers import T5TokenizerFast
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0) for w in WORDS]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=16)


def tiny_sd3_components(seed: int = 0, transformer: bool = True) -> Dict[str, Any]:
    """The keyword arguments of ``StableDiffusion3Pipeline`` (random tiny weights, eval mode)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tok = _clip_tokenizer()
    clip = dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=16, projection_dim=16, bos_token_id=0, eos_token_id=1,
                pad_token_id=1)
    t5tok = _t5_tokenizer()
    t5 = T5Config(vocab_size=len(t5tok), d_model=32, d_kv=8, d_ff=32, num_layers=2, num_heads=4,
                  decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    comps = dict(
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**clip)).eval(), tokenizer=tok,
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**clip)).eval(), tokenizer_2=_clip_tokenizer(),
        text_encoder_3=T5EncoderModel(t5).eval(), tokenizer_3=t5tok,
        vae=AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 8), layers_per_block=1,
                          down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                          latent_channels=4, norm_num_groups=4, sample_size=32, shift_factor=0.0609,
                          scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    if transformer:  # pooled: 2 x 16 (CLIP projections); joint: CLIP hidden 2 x 16 = T5 d_model 32
        comps["transformer"] = SD3Transformer2DModel(**TINY_TRANSFORMER).eval()
    return comps


def tiny_sd3_pipeline(seed: int = 0):
    """A tiny softmax ``StableDiffusion3Pipeline`` (``ttt_zoo.linearize(pipe.transformer)`` makes it SD3.5-T5)."""
    from diffusers import StableDiffusion3Pipeline
    return StableDiffusion3Pipeline(**tiny_sd3_components(seed))
