"""Attention maps of the TTT mixers: the implicit score dO_i/dV_j (T5 paper, Eq. 13) and the explicit
linear-attention map q_hat_i . k_hat_j of the forms in :mod:`ttt_zoo.analysis.linear_attention`.

Both are per head, shape (B, Q, heads, N) for Q query tokens.  The implicit score reduces the (d x d) Jacobian of a
head to one number, its mean diagonal ``A_h(i, j) = tr(dO_i/dV_j) / d``: for softmax attention ``dO_i/dV_j = a_ij I``
and this is ``a_ij``; for a linear attention with per-channel gates it is the mean of the gated ``q_hat_i . k_hat_j``.
The forward graph is built once and reused for all queries.  ``reduce='trace'`` takes d VJPs per query (cotangent
one-hot at channel c of every head at once; exact); ``reduce='probe'`` a single VJP per query with a Rademacher
cotangent u, ``u^T J u / d``: exact wherever the Jacobian is diagonal per head (softmax, linear attention with v-free
kernels, every case the explicit map is exact), an unbiased estimate of the trace elsewhere.  (The cheaper
``1^T J 1 / d``, one all-ones VJP, is blind to LayerNorm: a LayerNorm output sums to a constant and a LayerNorm gradient
ignores a uniform shift of its target, so Vision-TTT's map would be zero to rounding.)

What V and O are (the token-mixing core, before the output projection and the output-side per-token transforms):

- ViT3: v and o are the SwiGLU heads then the conv head (C + d channels); o is the input of ``proj``.
- T5 / T5+ / DiT5 / softmax: v is the last third of ``qkv``'s output, o the input of ``proj``.
- Vision-TTT: v is ``u_v`` (the last third of ``proj``'s output), o is Z = Z_forth + flip(Z_back), the input of the
  post-norm (the post-norm and the GELU gate act per token on top of it).

``via='mixer'`` takes the VJP through the mixer's own code, ``mixer.implicit_map_io``: by default forward hooks make v
a leaf (replacing the slice of the ``qkv`` / ``proj`` output) and catch o (a pre-hook on ``proj`` / ``post_norm``);
ViT3, whose projection is fused into its op, instead runs its own inner-step ops (``ttt_zoo.kernels.swiglu_ttt`` /
``dwconv_ttt``, or the variant reference) on q, k and a leaf v.  ``via='form'`` takes it through the mixer's
linear-attention form (``mixer.linear_attention_inputs`` -> ``linear_attention_form_from_inputs``), which is exact
and differentiable, so both give the same map.
"""

import copy
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ttt_zoo.layers import TTTMixer
from .linear_attention import form_from_inputs, linear_attention, mixer_inputs

__all__ = ["implicit_attention_map", "explicit_attention_map", "image_attention_maps", "query_index", "find_mixers",
           "capture_mixer_inputs"]

Query = Union[int, Tuple[int, int]]


def query_index(q: Query, feat_size: Tuple[int, int]) -> int:
    """Token index of a query given as an index or a (row, col) position on the feature map."""
    h, w = feat_size
    if isinstance(q, (tuple, list)):
        y, x = int(q[0]), int(q[1])
        if not (0 <= y < h and 0 <= x < w):
            raise ValueError(f"query position {(y, x)} is outside the {h} x {w} feature map")
        return y * w + x
    i = int(q)
    if not 0 <= i < h * w:
        raise ValueError(f"query token {i} is outside 0..{h * w - 1} ({h} x {w} map)")
    return i


def _head_dim(mixer) -> int:
    return mixer.head_dim


def _form_core(mixer, x: Tensor, fs: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
    with torch.no_grad():
        t = mixer_inputs(mixer, x, fs)
    t = {k: z.detach() for k, z in t.items()}
    t["v"] = t["v"].requires_grad_()
    with torch.enable_grad():
        o = form_from_inputs(mixer, t, fs).core()
    return t["v"], o


def implicit_attention_map(mixer: TTTMixer, x: Tensor, feat_size: Tuple[int, int], queries: Sequence[Query],
                           via: str = "mixer", reduce: str = "trace", seed: int = 0) -> Tensor:
    """``A_h(i, j) = tr(dO_i / dV_j) / d`` per head for each query token i: (B, Q, heads, N).

    Args:
        mixer: a mixer (eval mode); x: its input tokens (B, N, C); feat_size: (H, W).
        queries: token indices or (row, col) positions on the feature map.
        via: ``'mixer'`` (the mixer's own code, v and o through hooks) or ``'form'`` (the linear-attention form).
        reduce: ``'trace'`` (d VJPs per query, exact) or ``'probe'`` (one VJP per query, Rademacher probe drawn
            from ``seed``; exact where the per-head Jacobian is diagonal).
    """
    fs = (int(feat_size[0]), int(feat_size[1]))
    idx = [query_index(q, fs) for q in queries]
    if reduce not in ("trace", "probe"):
        raise ValueError(f"reduce must be 'trace' or 'probe', got {reduce!r}")
    if via == "form":
        v, o = _form_core(mixer, x, fs)
    elif via == "mixer":
        v, o = mixer.implicit_map_io(x, fs)
    else:
        raise ValueError(f"via must be 'mixer' or 'form', got {via!r}")
    d = _head_dim(mixer)
    b, n, cv = v.shape
    if reduce == "probe":
        gen = torch.Generator().manual_seed(seed)
        probes = [torch.randint(0, 2, (b, cv), generator=gen).to(o) * 2 - 1]
    else:
        probes = [torch.zeros(b, cv, dtype=o.dtype).index_fill_(1, torch.arange(c, cv, d), 1.0) for c in range(d)]
    maps: List[Tensor] = []
    for k, i in enumerate(idx):
        acc = v.new_zeros(b, n, cv // d)
        for p, u in enumerate(probes):
            last = k == len(idx) - 1 and p == len(probes) - 1
            g, = torch.autograd.grad(o[:, i], v, grad_outputs=u.to(o.device), retain_graph=not last)
            acc = acc + (g * u[:, None, :]).reshape(b, n, -1, d).sum(-1)
        maps.append(acc.transpose(1, 2) / d)
    return torch.stack(maps, 1).detach()


def explicit_attention_map(mixer: TTTMixer, x: Tensor, feat_size: Tuple[int, int],
                           queries: Sequence[Query], form=None) -> Tensor:
    """The explicit linear-attention map of each query token, (B, Q, heads, N), from the mixer's form
    (``form.explicit_map``: ``q_hat_i . k_hat_j`` times its gates, normaliser and ``d v_hat / d v``; the
    neighbourhood-attention half's softmax weights for T5+ / DiT5).  It equals the implicit map exactly where
    the form's q_hat, k_hat, gates and normaliser do not depend on v (see docs/attention_maps/README.md)."""
    fs = (int(feat_size[0]), int(feat_size[1]))
    idx = [query_index(q, fs) for q in queries]
    with torch.no_grad():
        form = form if form is not None else linear_attention(mixer, x, fs)
        return torch.stack([form.explicit_map(i) for i in idx], 1)


def find_mixers(model: torch.nn.Module) -> List[Tuple[str, TTTMixer]]:
    """The model's token mixers in forward (module) order, as (qualified name, module)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TTTMixer)]


def capture_mixer_inputs(model: torch.nn.Module, fn, mixers: Sequence[TTTMixer]
                         ) -> List[Optional[Tuple[Tensor, Tuple[int, int]]]]:
    """Run ``fn()`` (a forward of ``model``) and return each mixer's (x, feat_size) of its first call."""
    seen: List[Optional[Tuple[Tensor, Tuple[int, int]]]] = [None] * len(mixers)

    def hook(k):
        def f(mod, args):
            if seen[k] is None:
                seen[k] = (args[0].detach(), (int(args[1][0]), int(args[1][1])))
        return f
    hooks = [m.register_forward_pre_hook(hook(k)) for k, m in enumerate(mixers)]
    try:
        with torch.no_grad():
            fn()
    finally:
        for h in hooks:
            h.remove()
    return seen


def image_attention_maps(model: torch.nn.Module, image: Tensor, query_pixel: Tuple[float, float],
                         layers: Optional[Sequence[int]] = None, kind: str = "implicit", via: str = "mixer",
                         dtype: torch.dtype = torch.float64, reduce: str = "trace") -> List[Dict]:
    """Per chosen mixer layer, the map of the token under ``query_pixel`` (row, col in ``image``'s pixels).

    Args:
        model: an image model (``forward_features(image)``), eval mode.
        image: (1, 3, H, W) preprocessed image.
        layers: mixer indices in forward order (negative from the end); default first, middle and last.
        kind: ``'implicit'`` (dO_i/dV_j) or ``'explicit'`` (the linear-attention map).
        dtype: the maps are taken on a copy of each chosen mixer in this dtype (the model runs in its own).
    Returns a list of dicts: ``layer`` (index), ``name``, ``feat_size``, ``query`` (row, col on the map) and
    ``map`` (heads, H_l, W_l).
    """
    if kind not in ("implicit", "explicit"):
        raise ValueError(f"kind must be 'implicit' or 'explicit', got {kind!r}")
    mixers = find_mixers(model)
    if not mixers:
        raise ValueError(f"{type(model).__name__} has no TTT token mixer")
    n = len(mixers)
    layers = sorted({0, n // 2, n - 1}) if layers is None else list(layers)
    for L in layers:
        if not -n <= L < n:
            raise ValueError(f"layer {L} is out of range: the model has {n} mixers (0..{n - 1}, or negative)")
    h, w = image.shape[-2:]
    y, x = query_pixel
    if not (0 <= y < h and 0 <= x < w):
        raise ValueError(f"query pixel {(y, x)} is outside the {h} x {w} image")
    chosen = [mixers[L % n] for L in layers]
    seen = capture_mixer_inputs(model, lambda: model.forward_features(image), [m for _, m in chosen])
    out = []
    for L, (name, mixer), got in zip(layers, chosen, seen):
        if got is None:
            raise RuntimeError(f"mixer {name} was not called by forward_features")
        xin, fs = got
        mixer, xin = copy.deepcopy(mixer).to(dtype), xin.to(dtype)
        qy, qx = min(int(y * fs[0] / h), fs[0] - 1), min(int(x * fs[1] / w), fs[1] - 1)
        if kind == "implicit":
            a = implicit_attention_map(mixer, xin, fs, [(qy, qx)], via=via, reduce=reduce)
        else:
            a = explicit_attention_map(mixer, xin, fs, [(qy, qx)])
        out.append(dict(layer=L % n, name=name, feat_size=fs, query=(qy, qx), map=a[0, 0].reshape(-1, *fs)))
    return out
