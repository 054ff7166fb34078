"""SD3.5-T5: conversion, inheritance, the TTT math against the DiT5 op, persistence, the pipeline, bad input."""
import json
import os

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import SD3Transformer2DModel  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import ttt_zoo  # noqa: E402
from ttt_zoo.kernels import key_norm_reference, mlp_ttt_reference  # noqa: E402
from ttt_zoo.layers.dit5_mixer import DiT5MixedAttention  # noqa: E402
from ttt_zoo.linearize import linearize_sd3, sd3_param_groups  # noqa: E402
from ttt_zoo.sd3 import (SD3LayoutError, SD3T5Transformer2DModel, SD3TTTAttention, TTTProcessorError,  # noqa: E402
                         default_ttt_layers)
from ttt_zoo.sd3.tiny import TINY_TRANSFORMER, tiny_transformer_config  # noqa: E402

WEIGHTS = "diffusion_pytorch_model.safetensors"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _base(**overrides):
    torch.manual_seed(0)
    return SD3Transformer2DModel(**tiny_transformer_config(**overrides)).eval()


def _inputs(b=2, h=8, w=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    c = TINY_TRANSFORMER
    return dict(hidden_states=torch.randn(b, c["in_channels"], h, w, generator=g),
                encoder_hidden_states=torch.randn(b, 7, c["joint_attention_dim"], generator=g),
                pooled_projections=torch.randn(b, c["pooled_projection_dim"], generator=g),
                timestep=torch.tensor([700.0, 30.0][:b]))


def _randomize_new(model):
    """Non-trivial TTT parameters (qk_scale 1 / offset 0 at init would hide mistakes in the affine)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".ttt." in n:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))


# ----- conversion ---------------------------------------------------------------------------------------------------

def test_linearize_inherits_every_tensor_unchanged():
    base = _base()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model, new = ttt_zoo.linearize(base)  # the zoo's dispatch
    assert isinstance(model, SD3T5Transformer2DModel)
    sd = model.state_dict()
    for k, v in before.items():
        assert torch.equal(sd[k], v) and sd[k].dtype == v.dtype, k
    assert sorted(set(sd) - set(before)) == sorted(new)
    assert all(".ttt." in n for n in new)
    # paper's layout at tiny size: attn2 of the 3 dual blocks + joint attn of the last 5
    # -> 8 layers x 8 tensors (w1, w2, qk_scale, qk_offset, 2 convs with bias)
    assert model.config.ttt_dual_layers == [0, 1, 2] and model.config.ttt_joint_layers == [1, 2, 3, 4, 5]
    assert len(new) == 8 * 8
    assert {n.split(".ttt.")[0] for n in new} == {f"transformer_blocks.{i}.attn2" for i in (0, 1, 2)} | {
        f"transformer_blocks.{i}.attn" for i in (1, 2, 3, 4, 5)}
    assert not model.training and model.transformer_blocks[0].attn.__class__.__name__ == "Attention"
    with torch.no_grad():  # copies, not shared storage: the source stays untouched
        model.pos_embed.proj.weight.add_(1.0)
    assert torch.equal(base.pos_embed.proj.weight, before["pos_embed.proj.weight"])


def test_layouts_and_options():
    assert default_ttt_layers(24, range(13)) == (list(range(13)), [19, 20, 21, 22, 23])  # SD3.5-Medium, the paper
    assert default_ttt_layers(38, ()) == ([], list(range(19, 38)))  # SD3.5-Large: joint attention, last half
    large, new = linearize_sd3(_base(dual_attention_layers=()))
    assert large.config.ttt_dual_layers == [] and large.config.ttt_joint_layers == [3, 4, 5]
    custom, new = linearize_sd3(_base(), ttt_dual_layers=[1], ttt_joint_layers=[0, 5], ttt_key_norm_span="separate",
                                ttt_rms_qk_norm="skip")
    assert {n.split(".ttt.")[0] for n in new} == {"transformer_blocks.1.attn2", "transformer_blocks.0.attn",
                                                  "transformer_blocks.5.attn"}
    assert custom.transformer_blocks[5].attn.ttt.key_norm_span == "separate"
    assert custom.transformer_blocks[5].attn.rms_qk_norm == "skip"


def test_param_groups_lr_scale():
    model, new = linearize_sd3(_base())
    groups = sd3_param_groups(model, new, lr_scale=2.0, weight_decay=1e-4)
    named = {id(p): n for n, p in model.named_parameters()}
    seen = [named[id(p)] for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(named.values())  # every parameter exactly once
    for g in groups:
        names = [named[id(p)] for p in g["params"]]
        is_new = all(n in new for n in names)
        assert is_new or not any(n in new for n in names)
        assert g["lr_scale"] == (2.0 if is_new else 1.0) and "lr" not in g
        if any(n.endswith((".bias", ".qk_scale", ".qk_offset")) for n in names):
            assert g["weight_decay"] == 0.0


# ----- the TTT math is DiT5's ---------------------------------------------------------------------------------------

def test_image_only_layer_equals_dit5_ttt_path():
    """attn2 without q/k norm == DiT5MixedAttention's TTT path (proj(_ttt(q, k, v))) with the same weights."""
    model, _ = linearize_sd3(_base(qk_norm=None))
    _randomize_new(model)
    attn = model.transformer_blocks[1].attn2
    dim, heads = attn.inner_dim, attn.heads
    dit5 = DiT5MixedAttention(dim, heads).eval()
    with torch.no_grad():
        dit5.qkv.weight.copy_(torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))
        dit5.qkv.bias.copy_(torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]))
        dit5.proj.load_state_dict(attn.to_out[0].state_dict())
        for a, b in (("w1", "w1"), ("w2", "w2"), ("qk_scale_ttt", "qk_scale"), ("qk_offset_ttt", "qk_offset")):
            getattr(dit5, a).copy_(getattr(attn.ttt, b))
        dit5.q_conv2d.load_state_dict(attn.ttt.q_conv2d.state_dict())
        dit5.k_conv2d.load_state_dict(attn.ttt.k_conv2d.state_dict())
    x = torch.randn(2, 4 * 6, dim)
    with torch.no_grad():
        qkv = dit5.qkv(x)
        q, k, v = qkv.chunk(3, dim=-1)
        ref = dit5.proj(dit5._ttt(qkv, q, k, v, (4, 6)).transpose(1, 2).reshape(x.shape))  # (B, heads, N, d) out
        out = attn(x, feat_size=(4, 6))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("span", ["joint", "separate"])
@pytest.mark.parametrize("rms", ["keep", "skip"])
def test_joint_layer_matches_float64_reference(span, rms):
    """Joint TTT: q/k RMS norm (or not), affine, key instance-norm over the chosen span, DWC on the image tokens
    only, one inner step of the DiT5 reference on [image; text]; outputs split into to_out / to_add_out."""
    model, _ = linearize_sd3(_base(), ttt_key_norm_span=span, ttt_rms_qk_norm=rms)
    _randomize_new(model)
    attn = model.transformer_blocks[2].attn.double()
    h, w, nt = 3, 5, 4
    x, c = torch.randn(2, h * w, attn.inner_dim, dtype=torch.float64), torch.randn(2, nt, attn.inner_dim,
                                                                                dtype=torch.float64)
    with torch.no_grad():
        out, ctx = attn(x, c, feat_size=(h, w))

        def proj(t, lq, lk, lv, nq, nk):
            q, k, v = lq(t), lk(t), lv(t)
            if rms == "keep":
                q = nq(q.unflatten(-1, (attn.heads, -1))).flatten(-2)
                k = nk(k.unflatten(-1, (attn.heads, -1))).flatten(-2)
            return q, k, v
        q, k, v = (torch.cat(p, 1) for p in zip(proj(x, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k),
                                                proj(c, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                                                     attn.norm_added_q, attn.norm_added_k)))
        t = attn.ttt
        q = q * t.qk_scale[..., 0] + t.qk_offset[..., 0]
        k = k * t.qk_scale[..., 1] + t.qk_offset[..., 1]
        n = h * w
        k = key_norm_reference(k, 1.0) if span == "joint" else torch.cat(
            [key_norm_reference(k[:, :n], 1.0), key_norm_reference(k[:, n:], 1.0)], 1)

        def dwc(conv, t_):
            img = t_[:, :n].transpose(1, 2).reshape(2, -1, h, w)
            return torch.cat([t_[:, :n] + conv(img).flatten(2).transpose(1, 2), t_[:, n:]], 1)
        q, k = dwc(t.q_conv2d, q), dwc(t.k_conv2d, k)
        heads = lambda z: z.unflatten(-1, (attn.heads, -1)).transpose(1, 2)  # noqa: E731
        o = mlp_ttt_reference(heads(q), heads(k), heads(v), t.w1, t.w2, t.head_dim ** -0.5).transpose(1, 2).flatten(2)
        ref_out, ref_ctx = attn.to_out[0](o[:, :n]), attn.to_add_out(o[:, n:])
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ctx, ref_ctx, rtol=1e-10, atol=1e-12)


def test_gradient_checkpointing_same_grads_even_after_another_grid():
    model, _ = linearize_sd3(_base())
    model.train()
    inp = _inputs(h=8, w=12)
    other = _inputs(h=12, w=8, seed=2)

    def grads(ckpt):
        model.zero_grad()
        (model.enable_gradient_checkpointing if ckpt else model.disable_gradient_checkpointing)()
        out = model(**inp).sample
        with torch.no_grad():
            model(**other)  # a forward at the transposed grid (same token count) before the backward
        out.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    a, b = grads(False), grads(True)
    assert a.keys() == b.keys() and any(".ttt." in n for n in a)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-7, msg=n)


# ----- persistence ----------------------------------------------------------------------------------------------------

def test_save_load_roundtrip_exact(tmp_path):
    model, _ = linearize_sd3(_base(), ttt_key_norm_span="separate")
    _randomize_new(model)
    model.save_pretrained(tmp_path / "t5")
    assert (tmp_path / "t5" / WEIGHTS).is_file()
    cfg = json.loads((tmp_path / "t5" / "config.json").read_text())
    assert cfg["_class_name"] == "SD3T5Transformer2DModel" and cfg["ttt_joint_layers"] == [1, 2, 3, 4, 5]
    loaded = SD3T5Transformer2DModel.from_pretrained(tmp_path / "t5").eval()
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert loaded.transformer_blocks[5].attn.ttt.key_norm_span == "separate"
    with torch.no_grad():
        assert torch.equal(model(**_inputs()).sample, loaded(**_inputs()).sample)


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_from_pretrained_converts_softmax_folder(tmp_path, low_cpu_mem_usage):
    base = _base()
    base.save_pretrained(tmp_path / "sd3")
    model = SD3T5Transformer2DModel.from_pretrained(tmp_path / "sd3", ttt_joint_layers=[4, 5],
                                                    low_cpu_mem_usage=low_cpu_mem_usage)
    ref, new = linearize_sd3(base, ttt_joint_layers=[4, 5])
    assert sorted(model.new_parameter_names()) == sorted(new)
    assert all(p.device.type == "cpu" for p in model.parameters())
    for k, v in base.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    w = model.transformer_blocks[4].attn.ttt.w1
    assert 0.005 < w.std() < 0.05 and torch.equal(model.transformer_blocks[4].attn.ttt.qk_scale,
                                                   torch.ones_like(model.transformer_blocks[4].attn.ttt.qk_scale))


def test_meta_device_init_is_materialised():
    """What accelerate's init_empty_weights leaves behind for tensors a checkpoint lacks: meta TTT parameters."""
    base = _base()
    with torch.device("meta"):
        model = SD3T5Transformer2DModel(**{k: v for k, v in base.config.items() if not k.startswith("_")})
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False, assign=True)
    assert not unexpected and sorted(missing) == sorted(model.new_parameter_names())
    assert sorted(model.init_new_parameters()) == sorted(missing)
    assert not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        assert torch.isfinite(model(**_inputs()).sample).all()


# ----- the pipeline ---------------------------------------------------------------------------------------------------

def test_pipeline_generates_and_roundtrips(tmp_path):
    from diffusers import DiffusionPipeline
    from ttt_zoo.sd3.tiny import tiny_sd3_pipeline
    pipe = tiny_sd3_pipeline()
    pipe.transformer = ttt_zoo.linearize(pipe.transformer)[0]
    kw = dict(prompt="a red square", negative_prompt="blue", height=32, width=48, num_inference_steps=2,
              guidance_scale=3.5, output_type="np", max_sequence_length=16)
    calls = []
    pipe.transformer.register_forward_hook(lambda m, a, k, o: calls.append(k["hidden_states"].shape), with_kwargs=True)
    img = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    assert img.shape == (1, 32, 48, 3) and (img >= 0).all() and (img <= 1).all() and img.std() > 0
    assert calls and calls[0][0] == 2 and calls[0][-2:] == (16, 24)  # CFG doubles the batch; VAE factor 2
    pipe.save_pretrained(tmp_path / "pipe", safe_serialization=True)
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["transformer"] == ["ttt_zoo.sd3.transformer", "SD3T5Transformer2DModel"]
    assert (tmp_path / "pipe" / "transformer" / WEIGHTS).is_file()
    assert not [f for f in os.listdir(tmp_path / "pipe" / "transformer") if f.endswith((".bin", ".pt"))]
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "pipe")
    assert isinstance(loaded.transformer, SD3T5Transformer2DModel)
    for name in ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae"):
        a, b = getattr(pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    img2 = loaded(generator=torch.Generator().manual_seed(0), **kw).images
    assert (img2 == img).all()


# ----- bad input ------------------------------------------------------------------------------------------------------

def test_errors_not_sd3_and_bad_layers(tmp_path):
    with pytest.raises(TypeError, match="SD3Transformer2DModel"):
        ttt_zoo.linearize(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="linearize_sd3 converts"):
        linearize_sd3(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="already SD3.5-T5"):
        linearize_sd3(linearize_sd3(_base())[0])
    with pytest.raises(ValueError, match="layer index 6 is out of range.*6 blocks"):
        linearize_sd3(_base(), ttt_joint_layers=[2, 6])
    with pytest.raises(ValueError, match="layer index 4 is out of range.*dual-attention"):
        linearize_sd3(_base(), ttt_dual_layers=[4])
    with pytest.raises(ValueError, match="ttt_key_norm_span"):
        linearize_sd3(_base(), ttt_key_norm_span="text")
    from diffusers import UNet2DModel
    unet = UNet2DModel(sample_size=8, block_out_channels=(4, 4), norm_num_groups=2, layers_per_block=1,
                       down_block_types=("DownBlock2D",) * 2, up_block_types=("UpBlock2D",) * 2)
    unet.save_pretrained(tmp_path / "u")
    with pytest.raises(SD3LayoutError, match="not an SD3 transformer"):
        SD3T5Transformer2DModel.from_pretrained(tmp_path / "u")


def test_errors_latent_too_large():
    model, _ = linearize_sd3(_base())  # pos_embed_max_size 16, patch 2 -> at most 32 latent pixels per side
    with torch.no_grad():
        model(**_inputs(h=32, w=8))
        with pytest.raises(ValueError, match="larger than pos_embed_max_size \\* patch_size = 32"):
            model(**_inputs(h=34, w=8))
        with pytest.raises(ValueError, match="multiple of the patch size"):
            model(**_inputs(h=9, w=8))


def test_errors_wrong_layout_checkpoint(tmp_path):
    model, _ = linearize_sd3(_base())
    model.save_pretrained(tmp_path / "t5")
    with pytest.raises(SD3LayoutError, match="does not match the TTT layout"):
        SD3T5Transformer2DModel.from_pretrained(tmp_path / "t5", ttt_joint_layers=[5])
    sd = load_file(tmp_path / "t5" / WEIGHTS)
    sd.pop("transformer_blocks.0.attn2.ttt.w1")
    save_file(sd, tmp_path / "t5" / WEIGHTS, metadata={"format": "pt"})
    with pytest.raises(SD3LayoutError, match="transformer_blocks.0.attn2.ttt.w1"):
        SD3T5Transformer2DModel.from_pretrained(tmp_path / "t5")


def test_processor_guards():
    from diffusers.models.attention_processor import AttnProcessor2_0, JointAttnProcessor2_0
    model, _ = linearize_sd3(_base())
    with pytest.raises(TTTProcessorError, match="softmax"):
        model.set_attn_processor(JointAttnProcessor2_0())
    with pytest.raises(TTTProcessorError, match="fuse_qkv_projections"):
        model.fuse_qkv_projections()
    with pytest.raises(TTTProcessorError):
        model.transformer_blocks[0].attn2.set_processor(AttnProcessor2_0())
    procs = model.attn_processors
    bad = {k: JointAttnProcessor2_0() for k in procs}
    with pytest.raises(TTTProcessorError, match="transformer_blocks"):
        model.set_attn_processor(bad)
    keep = {k: (v if k in model.ttt_processor_names() else JointAttnProcessor2_0()) for k, v in procs.items()}
    model.set_attn_processor(keep)  # softmax layers may change, TTT layers keep theirs
    assert all(isinstance(m, SD3TTTAttention) for _, m in model.ttt_modules())
    assert sum(1 for _ in model.ttt_modules()) == 8


# ----- Hub layout and the conversion tool -----------------------------------------------------------------------------

def test_convert_tool_on_tiny_saved_pipeline(tmp_path, capsys):
    """`ttt-zoo convert SRC --sd3 --out OUT` (and tools/convert_sd3.py SRC OUT, the same command)."""
    import importlib.util
    from pathlib import Path
    from diffusers import DiffusionPipeline
    from ttt_zoo.cli import main as cli_main
    from ttt_zoo.hub.cards import REQUIRED_CARD_KEYS, parse_card
    from ttt_zoo.sd3.tiny import tiny_sd3_pipeline
    spec = importlib.util.spec_from_file_location("convert_sd3", Path(__file__).parents[1] / "tools" / "convert_sd3.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def main(argv):  # SRC OUT [options], as tools/convert_sd3.py takes them
        return cli_main(["convert", argv[0], "--sd3", "--out", argv[1], *argv[2:]])
    src = tiny_sd3_pipeline()
    src.save_pretrained(tmp_path / "sd3", safe_serialization=True)
    assert tool.run([str(tmp_path / "sd3"), str(tmp_path / "out"), "--joint-layers", "4,5",
                     "--base-name", "stabilityai/stable-diffusion-3.5-medium"]) == 0
    index = json.loads((tmp_path / "out" / "model_index.json").read_text())
    assert index["transformer"] == ["ttt_zoo.sd3.transformer", "SD3T5Transformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    meta, body = parse_card((tmp_path / "out" / "README.md").read_text())
    assert all(k in meta for k in REQUIRED_CARD_KEYS) and meta["library_name"] == "diffusers"
    assert "Not fine-tuned" in body and "[4, 5]" in body and "Table 7 of arXiv:2605.02772" in body
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "out")
    assert pipe.transformer.config.ttt_joint_layers == [4, 5]
    sd = pipe.transformer.state_dict()
    for k, v in src.transformer.state_dict().items():  # every pretrained tensor inherited unchanged
        assert torch.equal(sd[k], v), k
    for name in ("vae", "text_encoder_3"):
        a, b = getattr(src, name).state_dict(), getattr(pipe, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    # an existing output folder is kept unless --force; a non-SD3 or already converted folder is refused
    assert main([str(tmp_path / "sd3"), str(tmp_path / "out")]) == 2
    assert (tmp_path / "out" / "transformer" / WEIGHTS).is_file()
    assert main([str(tmp_path / "out"), str(tmp_path / "out2")]) == 2
    assert main([str(tmp_path / "out" / "transformer"), str(tmp_path / "out3")]) == 2
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()
    assert main([str(tmp_path / "sd3" / "transformer"), str(tmp_path / "t"), "--dual-layers", "0"]) == 0
    assert json.loads((tmp_path / "t" / "config.json").read_text())["ttt_dual_layers"] == [0]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # a flag error: argparse's exit, one line
        main([str(tmp_path / "sd3"), str(tmp_path / "t2"), "--joint-layers", "x,1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'x,1' is not a comma-separated list" in err and err.count("\n") == 1
