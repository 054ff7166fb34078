"""TTT ops (installed as ``ttt_zoo.kernels``): one folder per op with its reference and kernels."""
from .dispatch import available_ops, get_op, register_op, resolve_backend
from .vit3_ttt import dwconv_ttt_reference, swiglu_ttt_reference
from .ttt_linear import inner_rope, token_tau, ttt_linear_reference
from .ttt_linear import ttt_linear_bidir as _ttt_linear_bidir

register_op("vit3_swiglu_ttt", swiglu_ttt_reference)
register_op("vit3_dwconv_ttt", dwconv_ttt_reference)
register_op("ttt_linear", ttt_linear_reference)


def swiglu_ttt(q, k, v, w1, w2, scale, normalize_grad=True, backend=None):
    """ViT3 SwiGLU inner step + apply; see ``vit3_ttt.reference.swiglu_ttt_reference``."""
    return get_op("vit3_swiglu_ttt", q.device, backend)(q, k, v, w1, w2, scale, normalize_grad)


def dwconv_ttt(q, k, v, w3, scale, normalize_grad=True, backend=None):
    """ViT3 3x3 depthwise-conv inner step + apply; see ``vit3_ttt.reference.dwconv_ttt_reference``."""
    return get_op("vit3_dwconv_ttt", q.device, backend)(q, k, v, w3, scale, normalize_grad)


def ttt_linear(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch=16, ln_residual=True, eps=1e-6,
               return_grad_norm=False, backend=None):
    """Causal TTT-Linear mini-batch scan; see ``ttt_linear.reference.ttt_linear_reference``."""
    return get_op("ttt_linear", q.device, backend)(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual,
                                                    eps, return_grad_norm)


def ttt_linear_bidir(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch=16, ln_residual=True, rope_theta=10000.0,
                     eps=1e-6, return_grad_norm=False, backend=None):
    """Forward + flipped TTT-Linear scans stacked on the batch axis, summed (Vision-TTT Eq. 12)."""
    scan = get_op("ttt_linear", q.device, backend)
    return _ttt_linear_bidir(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, rope_theta, eps,
                             scan=scan, return_grad_norm=return_grad_norm)


__all__ = ["available_ops", "get_op", "register_op", "resolve_backend", "swiglu_ttt", "dwconv_ttt",
           "swiglu_ttt_reference", "dwconv_ttt_reference",
           "ttt_linear", "ttt_linear_bidir", "ttt_linear_reference", "inner_rope", "token_tau"]
