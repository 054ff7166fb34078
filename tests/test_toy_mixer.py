"""A new TTT mixer plugs into every family without touching the package (docs/adding_a_mixer.md).

The toy mixer below is defined and registered here, in the test file, and every registered family is built
with it through ``timm.create_model(name, mixer='toy')``: forward (checked against a float64 loop), backward,
``features_only`` and a state-dict round trip.
"""
import functools
import inspect
import io

import pytest
import timm
import torch
from torch import nn
from timm.layers import trunc_normal_

import ttt_zoo
from ttt_zoo.layers import TTTMixer, list_mixers, register_mixer


class ToyTTT(TTTMixer):
    """One inner gradient step of a per-head linear map on (k, v), applied to q:
    W = W0 - lr * (2 / N) k^T (k W0 - v),  out = proj(q W)."""

    inner_param_names = ("w0",)

    def __init__(self, dim: int, num_heads: int = 1, qkv_bias: bool = True, proj_drop: float = 0.0,
                 lr: float = 0.5):
        super().__init__()
        self.num_heads, self.head_dim, self.lr = num_heads, dim // num_heads, lr
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.w0 = nn.Parameter(torch.empty(num_heads, self.head_dim, self.head_dim))
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_inner_parameters()

    def reset_inner_parameters(self) -> None:
        if self.w0.device.type != "meta":
            trunc_normal_(self.w0, std=0.02)

    def forward(self, x: torch.Tensor, feat_size) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        w = self.w0 - self.lr * 2.0 / n * k.transpose(-1, -2) @ (k @ self.w0 - v)
        return self.proj_drop(self.proj((q @ w).transpose(1, 2).reshape(b, n, c)))


if "toy" not in list_mixers():
    register_mixer("toy")(ToyTTT)


def toy_reference(m: ToyTTT, x: torch.Tensor) -> torch.Tensor:
    """The toy mixer in float64, written with einsum over explicit (batch, token, head, channel) indices."""
    d, h, n = m.head_dim, m.num_heads, x.shape[1]
    p = {k: v.detach().double() for k, v in m.state_dict().items()}
    qkv = torch.einsum("bnc,oc->bno", x.detach().double(), p["qkv.weight"]) + p.get("qkv.bias", 0)
    q, k, v = qkv.unflatten(-1, (3, h, d)).unbind(2)  # (b, n, h, d) each
    resid = torch.einsum("bnhi,hij->bnhj", k, p["w0"]) - v
    w = p["w0"] - m.lr * 2.0 / n * torch.einsum("bnhi,bnhj->bhij", k, resid)
    y = torch.einsum("bnhi,bhij->bnhj", q, w).flatten(2)
    return torch.einsum("bnc,oc->bno", y, p["proj.weight"]) + p["proj.bias"]


FAMILIES = ttt_zoo.list_zoo_families(include_diffusion=True)


def _inputs(name: str, model: nn.Module, batch: int = 2):
    g = torch.Generator().manual_seed(0)
    if ttt_zoo.is_diffusion_model(name):
        return (torch.randn(batch, model.in_chans, 8, 8, generator=g), torch.tensor([10.0, 500.0][:batch]),
                torch.tensor([3, 7][:batch]))
    return (torch.randn(batch, 3, 64, 96, generator=g),)


@functools.lru_cache(maxsize=None)
def _shallow(name: str) -> dict:
    """Kwargs for one block per stage (two for plain models), found from the model's own constructor: fast tests."""
    with torch.device("meta"):
        cls = type(timm.create_model(name, mixer="toy"))
    params = inspect.signature(cls.__init__).parameters
    if "depths" in params:
        return dict(depths=(1,) * len(params["depths"].default))
    return dict(depth=3)


def _toy_model(name: str, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(name, mixer="toy", **_shallow(name), **kwargs)
    with torch.no_grad():  # DiT's adaLN-Zero init gates every block to 0: perturb so gradients reach the mixers
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_builds_with_a_toy_mixer(family):
    name = FAMILIES[family]
    if family == "t5_plus":  # T5+ is the 't5' mixer with neighbourhood attention: not a choice of mixer
        with pytest.raises(ValueError, match="na_kernel.*'t5' mixer"):
            timm.create_model(name, mixer="toy")
        return
    model = _toy_model(name).eval()
    mixers = [m for m in model.modules() if isinstance(m, ToyTTT)]
    assert mixers and not any(isinstance(m, TTTMixer) and not isinstance(m, ToyTTT) for m in model.modules())

    # forward: every block ran the toy mixer, as the float64 loop computes it
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0], out))) for m in mixers]
    inputs = _inputs(name, model)
    with torch.no_grad():
        out = model(*inputs)
    for h in hooks:
        h.remove()
    diffusion = ttt_zoo.is_diffusion_model(name)
    assert out.shape == ((2, model.out_channels, 8, 8) if diffusion else (2, model.num_classes))
    assert torch.isfinite(out).all()
    assert len(seen) == len(mixers)
    for mod, x, y in seen:
        torch.testing.assert_close(y.double(), toy_reference(mod, x), rtol=1e-4, atol=1e-5)

    # backward reaches the toy inner weights of every block
    model.train()
    model(*inputs).square().mean().backward()
    for m in mixers:
        assert m.w0.grad is not None and m.w0.grad.abs().sum() > 0

    # state-dict round trip through a weights-only file, into a model built from another seed
    model.eval()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sum(k.endswith("attn.w0") for k in sd) == len(mixers)
    other = _toy_model(name, seed=1).eval()
    other.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(other(*inputs), model(*inputs), rtol=0, atol=0)

    # features_only (image models; the diffusion models have no feature maps)
    if not diffusion:
        fm = timm.create_model(name, mixer="toy", features_only=True, **_shallow(name)).eval()
        with torch.no_grad():
            feats = fm(*inputs)
        assert [f.shape[1] for f in feats] == fm.feature_info.channels()
        assert [96 // f.shape[-1] for f in feats] == fm.feature_info.reduction()
        assert all(torch.isfinite(f).all() for f in feats)
