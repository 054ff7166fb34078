"""Shared by the per-op test files (tests/test_op_<op>.py): where the Triton kernels can run, and how to mark them."""
import importlib

import pytest
import torch

from ttt_zoo.kernels.backend import HAS_TRITON, triton_unsupported

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton installed, and a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is first imported)
TRITON_OK = triton_unsupported(torch.device(DEV)) is None
# every backend that can run here; forcing 'triton' where it cannot raises (tests/test_op_backend.py)
BACKENDS = ["torch", "torch_naive"] + (["triton"] if TRITON_OK else [])
# the meta device takes the custom ops (fake kernels) whenever Triton is installed
META_BACKENDS = ["torch", "torch_naive"] + (["triton"] if HAS_TRITON else [])


def triton_test(f):
    """A test of the kernels themselves: marked ``triton`` and skipped where they cannot run."""
    return pytest.mark.triton(pytest.mark.skipif(not TRITON_OK, reason="the Triton kernels cannot run here")(f))


def triton_kernels(op: str):
    """``ttt_zoo.kernels.<op>.triton``, or None where the kernels cannot run."""
    return importlib.import_module(f"ttt_zoo.kernels.{op}.triton") if TRITON_OK else None


def compare_kernel(f_new, f_ref, inputs, dtype, names, tol, ref_may_skip=False):
    """Forward and every gradient of ``f_new`` in ``dtype`` against ``f_ref`` run in float32 on float32 copies of the
    same (rounded) data; gradients compared relative to their magnitude.  ``tol``: dtype -> assert_close kwargs.
    ``ref_may_skip``: an input the reference does not use has gradient zero there (``f_new`` must still give one)."""
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    out = f_new(*leaves)
    ref = f_ref(*ref_leaves)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **tol[dtype])
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, do.to(dtype), allow_unused=ref_may_skip)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do, allow_unused=ref_may_skip)
    for name, x, g, r in zip(names, leaves, grads, ref_grads):
        r = torch.zeros_like(x, dtype=torch.float32) if r is None else r
        assert g is not None and g.dtype == dtype and g.shape == r.shape, name
        scale = r.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g.float() / scale, r / scale, **tol[dtype], msg=lambda m: f"d{name}: {m}")


def autograd_dot_scan(q, k, v, lr, tau, w0, b0, mb):
    """An independent reference of the linear-attention scan (inner loss l_j = -<k_j W + b, v_j>): per mini-batch,
    per-token gradients at the incoming state by autograd; token i reads W_i = W - sum_{j<=i} tau_i lr_j grad_j
    (inclusive); the state moves by the last row."""
    bsz, h, n, d = q.shape
    w, b = w0.expand(bsz, h, d, d), b0.expand(bsz, h, 1, d)
    outs = []
    for s in range(0, n, mb):
        e = min(s + mb, n)
        c = e - s
        wr = w.unsqueeze(2).expand(bsz, h, c, d, d).clone().requires_grad_()  # one copy per token
        br = b.unsqueeze(2).expand(bsz, h, c, 1, d).clone().requires_grad_()
        loss = -((k[:, :, s:e, None, :] @ wr + br) * v[:, :, s:e, None, :]).sum()
        gw, gb = torch.autograd.grad(loss, [wr, br])
        eta = torch.tril(tau[:c, None] * lr[:, :, None, s:e])  # (B, H, c, c)
        wi = w.unsqueeze(2) - torch.einsum("bhij,bhjxy->bhixy", eta, gw)
        bi = b.unsqueeze(2) - torch.einsum("bhij,bhjxy->bhixy", eta, gb)
        outs.append((q[:, :, s:e, None, :] @ wi + bi).squeeze(3))
        w = w - torch.einsum("bhj,bhjxy->bhxy", eta[:, :, -1], gw)
        b = b - torch.einsum("bhj,bhjxy->bhxy", eta[:, :, -1], gb)
    return torch.cat(outs, 2)
