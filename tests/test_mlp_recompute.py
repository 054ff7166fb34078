"""The MLPs' training path that recomputes the activations between fc1 and fc2 (ttt_zoo.layers.recompute):
gradients against float64 references (gradcheck, the plain path), fp32 and bf16 autocast at 64x64 tokens, the
memory it saves (bytes autograd keeps), and the fall-backs that keep hooks and dropout exact."""

import pytest
import torch

from ttt_zoo.layers import TokenMlp
from ttt_zoo.models.visionttt import SwiGluMlp

MLPS = {
    "gelu": lambda d: TokenMlp(d, 4 * d),
    "gelu_dwconv": lambda d: TokenMlp(d, 4 * d, dwconv=True),
    "swiglu": lambda d: SwiGluMlp(d, 3 * d),
}


def _grads(m, x, feat_size, g):
    y = m(x, feat_size)
    return [y] + list(torch.autograd.grad(y, [x, *m.parameters()], g))


def _image_tokens(h, w, dim, dtype=torch.float32):
    """Smooth, correlated tokens (an image-like map), not i.i.d. noise."""
    yy, xx = torch.meshgrid(torch.linspace(0, 3, h), torch.linspace(0, 3, w), indexing="ij")
    freqs = torch.linspace(0.5, 4.0, dim)
    t = torch.sin(freqs * yy[..., None] + 0.7 * freqs.flip(0) * xx[..., None]) + 0.1 * torch.randn(h, w, dim)
    return t.reshape(1, h * w, dim).to(dtype)


@pytest.mark.parametrize("kind", sorted(MLPS))
def test_gradcheck_float64(kind):
    torch.manual_seed(0)
    m = MLPS[kind](8).double()
    x = torch.randn(2, 15, 8, dtype=torch.float64, requires_grad=True)
    params = list(m.parameters())

    def f(x, *ps):
        with torch.no_grad():
            for p, v in zip(params, ps):
                p.copy_(v)
        return m(x, (3, 5))

    # gradcheck on the input; the parameter gradients against the plain path below
    assert torch.autograd.gradcheck(lambda x: m(x, (3, 5)), (x,))
    g = torch.randn(2, 15, 8, dtype=torch.float64)
    fast = _grads(m, x, (3, 5), g)
    m.recompute_act = False
    plain = _grads(m, x, (3, 5), g)
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(MLPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_at_4096_tokens(kind, dtype):
    """fp32 and bf16 autocast training, 64x64 tokens, against the float64 plain path."""
    torch.manual_seed(0)
    dim, fs = 32, (64, 64)
    m = MLPS[kind](dim)
    x = _image_tokens(*fs, dim)
    g = torch.randn(1, fs[0] * fs[1], dim)
    ref_m = MLPS[kind](dim).double()
    ref_m.load_state_dict(m.state_dict())
    ref_m.recompute_act = False
    ref = _grads(ref_m, x.double().requires_grad_(), fs, g.double())
    xr = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = _grads(m, xr, fs, g)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(["out", "x"] + [n for n, _ in m.named_parameters()], out, ref):
        assert a.dtype == (dtype if name == "out" else torch.float32), name
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < tol, f"{kind} {dtype} {name}: relative error {err:.2e}"


def _saved_bytes(fn):
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("kind", sorted(MLPS))
def test_keeps_one_hidden_tensor(kind):
    """Autograd keeps the input and fc1's output (plus the weights), not the activations after it."""
    torch.manual_seed(0)
    m = MLPS[kind](32)
    x = torch.randn(2, 256, 32, requires_grad=True)
    fs = (16, 16)
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    h_bytes = x.numel() // 32 * m.fc1.out_features * 4
    _, fast = _saved_bytes(lambda: m(x, fs))
    m.recompute_act = False
    _, plain = _saved_bytes(lambda: m(x, fs))
    assert fast <= x.numel() * 4 + h_bytes + weights
    hidden = x.numel() // 32 * m.fc2.in_features * 4  # one activation of fc2's input width
    extra = {"gelu": 1, "gelu_dwconv": 3, "swiglu": 2}[kind]  # kept by the plain path on top of fc1's output
    assert plain - fast >= extra * hidden - weights, (plain, fast)


def test_hooks_and_dropout_take_the_plain_path():
    torch.manual_seed(0)
    m = TokenMlp(16, 64)
    x = torch.randn(1, 9, 16, requires_grad=True)
    seen = []
    handle = m.fc2.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    m(x, (3, 3)).sum().backward()
    assert seen == [torch.Size([1, 9, 16])]  # fc2 really ran as a module: its hook fired
    handle.remove()
    d = TokenMlp(16, 64, drop=0.5).train()
    torch.manual_seed(1)
    y1 = d(x, (3, 3))
    d.recompute_act = False
    torch.manual_seed(1)
    y2 = d(x, (3, 3))
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)


def test_ttt_linear_output_gate_float64():
    """TTT-Linear's ``o_proj(GELU(u_g) * post_norm(z))`` with the recomputed gate: every gradient as the plain
    path's in float64, and fewer bytes kept."""
    from ttt_zoo.layers import TTTLinearMixer
    torch.manual_seed(0)
    m = TTTLinearMixer(32, head_dim=16, mini_batch=4, backend="torch").double()
    x = torch.randn(2, 48, 32, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 48, 32, dtype=torch.float64)
    fast_saved = _saved_bytes(lambda: m(x, (6, 8)))[1]
    fast = _grads(m, x, (6, 8), g)
    m.recompute_act = False
    plain_saved = _saved_bytes(lambda: m(x, (6, 8)))[1]
    plain = _grads(m, x, (6, 8), g)
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert plain_saved - fast_saved >= 3 * x.numel() * 8 - 2 * 32 * 8  # GELU(u_g), post_norm(z), their product
