"""Every TTT op keeps its own precision under autocast: fp32 inputs give the fp32 result inside a bf16 autocast
region, in inference and with autograd, on the default PyTorch paths.

The inner steps accumulate state (over mini-batches, chunks or tokens); autocast must not move their GEMMs to bf16.
It did for three ops: the TTT-Linear inference scan (3.5e-2 off float64 on the photo at N = 3136, see
test_numerics), the linear-attention chunk form and the last-layer step (2.6e-3 and 2.9e-3 here).
"""
import pytest
import torch

from ttt_zoo import kernels as K

B, H, N, D = 1, 3, 1024, 64


def _inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    x = dict(q=r(B, H, N, D, scale=0.5), k=r(B, H, N, D, scale=0.5), v=r(B, H, N, D),
             w1=r(1, H, D, D, scale=0.05), w2=r(1, H, D, D, scale=0.05), w3=r(1, H, D, D, scale=0.05),
             conv=r(D, 1, 3, 3, scale=0.05), lr=torch.rand(B, H, N, generator=g) * 0.01,
             tau=1.0 / torch.arange(1, 17, dtype=torch.float32), w0=r(1, H, D, D, scale=0.02),
             b0=torch.zeros(1, H, 1, D), ln_w=1.0 + r(H, D, scale=0.1), ln_b=r(H, D, scale=0.1))
    return x


def _maps(t):
    return t.reshape(B, H * D, 32, 32)[:, :D]


CASES = {
    "vit3_swiglu_ttt": lambda x: K.swiglu_ttt(x["q"], x["k"], x["v"], x["w1"], x["w2"], 1 / 3, backend="torch"),
    "vit3_dwconv_ttt": lambda x: K.dwconv_ttt(_maps(x["q"]), _maps(x["k"]), _maps(x["v"]), x["conv"], 1 / 3,
                                              backend="torch"),
    "t5_swiglu_ttt": lambda x: K.t5_swiglu_ttt(x["q"], x["k"], x["v"], x["w1"], x["w2"], x["w3"], 1.0,
                                               backend="torch"),
    "dit5_mlp_ttt": lambda x: K.mlp_ttt(x["q"], x["k"], x["v"], x["w1"], x["w2"], 1.0, backend="torch"),
    "key_instance_norm": lambda x: K.key_instance_norm(x["q"].reshape(B, N, H * D), backend="torch"),
    "last_layer_ttt": lambda x: K.last_layer_ttt(x["q"], x["k"], x["v"], x["w1"], 1.0, backend="torch"),
    "last_layer_ttt_mse": lambda x: K.last_layer_ttt(x["q"], x["k"], x["v"], x["w1"], 1.0, loss="mse", steps=2,
                                                     backend="torch"),
    "linear_attention_bidir": lambda x: K.linear_attention_bidir(x["q"], x["k"], x["v"], x["lr"], x["tau"],
                                                                 x["w0"], x["b0"], backend="torch"),
    "ttt_linear_bidir": lambda x: K.ttt_linear_bidir(x["q"], x["q"], x["v"], x["lr"], x["tau"], x["w0"], x["b0"],
                                                     x["ln_w"], x["ln_b"], backend="torch")[0],
    "ttt_linear": lambda x: K.ttt_linear(x["q"], x["k"], x["v"], x["lr"], x["tau"], x["w0"], x["b0"], x["ln_w"],
                                         x["ln_b"], backend="torch")[0],
}


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fp32_inputs_give_the_fp32_result_under_bf16_autocast(name, grad):
    x = _inputs()
    if grad:
        for t in (x["q"], x["k"], x["v"]):
            t.requires_grad_(True)
    with torch.set_grad_enabled(grad):
        ref = CASES[name](x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = CASES[name](x)
    assert out.dtype == torch.float32
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel <= 1e-6, f"{name}: autocast changed the result by {rel:.2e} (a bf16 GEMM inside the op)"
    if grad:
        do = torch.randn_like(ref)
        g_ref = torch.autograd.grad(ref, x["q"], do, retain_graph=True)[0]
        g_out = torch.autograd.grad(out, x["q"], do)[0]
        rel = ((g_out - g_ref).norm() / g_ref.norm()).item()
        assert rel <= 1e-6, f"{name}: autocast changed dq by {rel:.2e}"
