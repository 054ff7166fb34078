"""The ViT3 TTT mixer against independent references: autograd of the stated inner loss, dtypes, devices."""
import pytest
import torch
import torch.nn.functional as F

from ttt_zoo.kernels import dwconv_ttt_reference, swiglu_ttt_reference
from ttt_zoo.layers import ViT3TTT, apply_rope_2d, rope_2d_tables


def _swiglu_by_autograd(q, k, v, w1, w2, scale):
    """One step of gradient descent on L = -(scale/N) sum <(kW1)*silu(kW2), v>, per sample, via autograd."""
    outs = []
    for b in range(q.shape[0]):
        a1 = w1[0].detach().clone().requires_grad_(True)
        a2 = w2[0].detach().clone().requires_grad_(True)
        loss = -(scale / k.shape[-2]) * (((k[b] @ a1) * F.silu(k[b] @ a2)) * v[b]).sum()
        g1, g2 = torch.autograd.grad(loss, (a1, a2))
        g1 = g1 / (g1.norm(dim=-2, keepdim=True) + 1)
        g2 = g2 / (g2.norm(dim=-2, keepdim=True) + 1)
        outs.append((q[b] @ (a1 - g1)) * F.silu(q[b] @ (a2 - g2)))
    return torch.stack(outs)


def _dwconv_by_autograd(q, k, v, w3, scale):
    b, d, h, w = k.shape
    outs = []
    for i in range(b):
        a = w3.detach().clone().requires_grad_(True)
        loss = -(scale / (h * w)) * (F.conv2d(k[i:i + 1], a, padding=1, groups=d) * v[i:i + 1]).sum()
        (g,) = torch.autograd.grad(loss, (a,))
        g = g / (g.flatten(1).norm(dim=1).view(d, 1, 1, 1) + 1)
        outs.append(F.conv2d(q[i:i + 1], a - g, padding=1, groups=d))
    return torch.cat(outs)


def test_swiglu_step_equals_autograd_of_inner_loss():
    q, k, v = (torch.randn(3, 2, 20, 8, dtype=torch.float64) for _ in range(3))
    w1, w2 = (torch.randn(1, 2, 8, 8, dtype=torch.float64) * 0.3 for _ in range(2))
    torch.testing.assert_close(swiglu_ttt_reference(q, k, v, w1, w2, 1 / 3), _swiglu_by_autograd(q, k, v, w1, w2, 1 / 3),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hw", [(5, 5), (3, 7)])
def test_dwconv_step_equals_autograd_of_inner_loss(hw):
    q, k, v = (torch.randn(2, 4, *hw, dtype=torch.float64) for _ in range(3))
    w3 = torch.randn(4, 1, 3, 3, dtype=torch.float64) * 0.3
    torch.testing.assert_close(dwconv_ttt_reference(q, k, v, w3, 1 / 3), _dwconv_by_autograd(q, k, v, w3, 1 / 3),
                               rtol=1e-12, atol=1e-12)


def test_inner_weights_are_per_sample():
    mixer = ViT3TTT(32, 2).double().eval()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    both = mixer(x, (3, 4))
    alone = torch.cat([mixer(x[:1], (3, 4)), mixer(x[1:], (3, 4))])
    torch.testing.assert_close(both, alone, rtol=1e-12, atol=1e-12)


def test_mixer_gradcheck():
    mixer = ViT3TTT(8, 2).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: mixer(t, (2, 3)), (x,), eps=1e-6, atol=1e-5)


def test_rope_uses_runtime_size_and_matches_complex_rotation():
    h, w, c = 5, 9, 16
    cos, sin = rope_2d_tables((h, w), c)
    assert cos.shape == (h, w, c // 2)
    x = torch.randn(2, h, w, c, dtype=torch.float64)
    out = apply_rope_2d(x, cos, sin)
    k = c // 4
    theta = 10000.0 ** (-torch.arange(k, dtype=torch.float64) / k)
    r, col = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    ang = torch.cat([r[..., None] * theta, col[..., None] * theta], -1)
    z = torch.view_as_complex(x.reshape(2, h, w, c // 2, 2).contiguous()) * torch.polar(torch.ones_like(ang), ang)
    torch.testing.assert_close(out, torch.view_as_real(z).reshape(2, h, w, c), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_matches_float64(dtype):
    mixer = ViT3TTT(32, 2, rope=True).eval()
    x = torch.randn(2, 20, 32)
    ref = mixer.double()(x.double(), (4, 5))
    out = mixer.to(dtype)(x.to(dtype), (4, 5))
    assert out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_meta_device():
    with torch.device("meta"):
        mixer = ViT3TTT(64, 4, rope=True)
        out = mixer(torch.empty(2, 35, 64), (5, 7))
    assert out.shape == (2, 35, 64) and out.device.type == "meta"


@pytest.mark.parametrize("rope", [False, True])
def test_recompute_switch_same_grads_and_what_it_keeps(rope):
    """``recompute`` (default) keeps the mixer's input only and recomputes the qkv projection in the backward;
    ``False`` keeps the projection's output instead: the same output and gradients, and the bytes autograd keeps
    are those (B, N, 3C + 3d) floats (plus the conv branch's packed maps) more."""
    from test_op_inner_mlp import _saved_bytes
    torch.manual_seed(0)
    c, heads, fs = 64, 2, (12, 10)
    d = c // heads
    m = ViT3TTT(c, num_heads=heads, rope=rope, backend="torch")
    assert m.recompute  # the default
    x = torch.randn(2, fs[0] * fs[1], c, requires_grad=True)
    res = {}
    for recompute in (True, False):
        m.recompute = recompute
        out, saved = _saved_bytes(lambda: m(x, fs), m)
        grads = torch.autograd.grad(out.square().sum(), [x, m.w1, m.w2, m.w3, m.qkv.weight, m.qkv.bias])
        res[recompute] = (out, grads, saved)
    torch.testing.assert_close(res[True][0], res[False][0], rtol=0, atol=0)
    for a, b in zip(res[True][1], res[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    n_c = x.numel() * 4  # bytes of one (B, N, C) fp32 activation
    kept = (3 * c + 3 * d) / c  # the projection output, in (B, N, C) units
    b, n = x.shape[:2]
    small = 4 * (b * heads * d * 2 * d + b * d * 9 + (2 * n * c if rope else 0))  # the inner gradients, RoPE tables
    assert res[True][2] <= (2 + d / c) * n_c + small, res[True][2] / n_c  # x, the proj input (C + d), small ones
    assert res[False][2] >= res[True][2] + kept * n_c, (res[False][2] / n_c, res[True][2] / n_c)
