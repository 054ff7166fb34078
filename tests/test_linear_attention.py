"""The exact linear-attention form of every mixer (ttt_zoo.analysis.linear_attention) reproduces the mixer's whole
output in float64 to 1e-10 (relative to the output's scale): random mixers with large weights (every term of the
forms matters), the official fixtures through the models' checkpoint filters, and the bundled photo through the
models' stems.  Negative controls break one ingredient of a form each and must miss by far more than 1e-10."""
import dataclasses
import importlib.util
import json
import os

import pytest
import timm
import torch

from fixtures import load_fixture
import ttt_zoo
from ttt_zoo.analysis import linear_attention
from ttt_zoo.kernels import token_tau, ttt_linear_naive
from ttt_zoo.layers import DiT5MixedAttention, T5TTT, TTTLinearMixer, TTTMixer, ViT3TTT

TOL = 1e-10
FS = (6, 7)  # non-square; N = 42 = 5 full mini-batches of 8 + a partial one of 2 for Vision-TTT

MIXERS = {
    "vit3": lambda: ViT3TTT(32, 4),
    "vit3_no_norm": lambda: ViT3TTT(32, 4, normalize_grad=False),
    "vit3_rope": lambda: ViT3TTT(32, 4, rope=True),
    "vit3_rope_no_norm": lambda: ViT3TTT(32, 4, rope=True, normalize_grad=False),
    "t5": lambda: T5TTT(32, 4),
    "t5_plus": lambda: T5TTT(32, 4, na_kernel=3),
    "dit5": lambda: DiT5MixedAttention(32, 4, kernel_size=3),
    "visionttt": lambda: TTTLinearMixer(32, head_dim=8, mini_batch=8),
    "visionttt_plain_sep_convq": lambda: TTTLinearMixer(32, head_dim=8, mini_batch=8, inner_ln_residual=False,
                                                         w0_mode="separate", qk_mode="conv_q"),
    "visionttt_frozen_norope": lambda: TTTLinearMixer(32, head_dim=8, mini_batch=5, w0_mode="frozen",
                                                      inner_rope=False),
}


def _random(name, std=0.3, seed=0):
    torch.manual_seed(seed)
    m = MIXERS[name]()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, std)
    return m.double().eval()


def _x(seed=1, b=2):
    torch.manual_seed(seed)
    return torch.randn(b, FS[0] * FS[1], 32, dtype=torch.float64)


def _err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


@pytest.mark.parametrize("name", list(MIXERS))
def test_form_reproduces_mixer(name):
    m, x = _random(name), _x()
    with torch.no_grad():
        ref = m(x, FS)
        out = linear_attention(m, x, FS).output()
    assert _err(out, ref) <= TOL, f"{name}: {_err(out, ref):.2e}"


@pytest.mark.parametrize("name", ["visionttt", "visionttt_plain_sep_convq"])
def test_visionttt_each_scan_direction(name):
    """Each direction's sum form (z_bar through the inner LN residual) against the plain per-mini-batch scan run
    on that direction's order, and the per-token state reads the same z_bar."""
    m, x = _random(name), _x()
    with torch.no_grad():
        form = linear_attention(m, x, FS)
        v = ttt_zoo.analysis.mixer_inputs(m, x, FS)["v"]
        v = v.reshape(2, -1, m.num_heads, m.head_dim).transpose(1, 2)
        for s, k in zip(form.scans, (0, 1)):
            d = m.head_dim
            q, kk = s.q[..., :d], s.k[..., :d]  # rotated, in this direction's order
            w = slice(k, k + 1) if m.w0.shape[0] == 2 else slice(0, 1)
            ref, _ = ttt_linear_naive(q, kk, v.flip(2) if k else v, s.lr, token_tau(m.tau_offset), m.w0[w], m.b0[w],
                                      m.ttt_norm_weight, m.ttt_norm_bias, m.mini_batch, m.inner_ln_residual)
            assert _err(form._direction(s), ref) <= TOL
            i = 29  # a token in the 4th mini-batch: the state it reads gives its z_bar
            z_i = torch.einsum("bhd,bhde->bhe", s.q[:, :, i], s.token_state(i))
            assert _err(z_i, s.output()[:, :, i]) <= TOL


# ------------------------------------------------------------------------ official fixtures and the photo
def _hooked_outputs(model, run):
    """Every mixer's (input, feat_size, output) during ``run()``."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0], tuple(args[1]), out)))
             for m in model.modules() if isinstance(m, TTTMixer)]
    with torch.no_grad():
        run()
    for h in hooks:
        h.remove()
    assert seen
    return seen


def _check_model(model, run, min_mixers=1):
    seen = _hooked_outputs(model, run)
    assert len(seen) >= min_mixers
    worst = 0.0
    for mod, x, fs, out in seen:
        with torch.no_grad():
            worst = max(worst, _err(linear_attention(mod, x, fs).output(), out))
    assert worst <= TOL, f"worst mixer {worst:.2e}"
    return worst


def test_fixture_vit3_blocks():
    from ttt_zoo.layers import ViT3TTT as M
    for case, shape in (("vit3_ttt_block_square", (6, 6)), ("vit3_ttt_block_nonsquare", (4, 6))):
        t, state, meta, _ = load_fixture(case)
        kw = json.loads(meta["constructor_kwargs"])
        m = M(kw["dim"], kw["num_heads"], qkv_bias=kw["qkv_bias"]).double().eval()
        m.load_state_dict(state, strict=True)
        with torch.no_grad():
            out = linear_attention(m, t["input.x"].double(), shape).output()
        assert _err(out, t["output"].double()) <= 1e-6  # the fixture itself is float32-accurate
        _check_model(m, lambda: m(t["input.x"].double(), shape))


def _classifier_fixture(name, build, filter_fn, wrap=lambda s: {"model": s}):
    t, state, meta, _ = load_fixture(name)
    kw = json.loads(meta["constructor_kwargs"])
    model = build(kw).double().eval()
    model.load_state_dict(filter_fn(wrap(state), model), strict=True)
    return t, model


def test_fixture_vit3_hvit3_t5_models():
    from ttt_zoo.models import HViT3, T5, ViT3
    from ttt_zoo.models.hvit3 import checkpoint_filter_fn as hvit3_filter
    from ttt_zoo.models.t5 import checkpoint_filter_fn as t5_filter
    from ttt_zoo.models.vit3 import checkpoint_filter_fn as vit3_filter
    plain = lambda cls: (lambda kw: cls(img_size=kw["img_size"], patch_size=kw["patch_size"],  # noqa: E731
                                        embed_dim=kw["embed_dim"], depth=kw["depth"], num_heads=kw["num_heads"],
                                        num_classes=kw["num_classes"], mlp_ratio=kw["mlp_ratio"],
                                        **({"qkv_bias": kw["qkv_bias"]} if cls is T5 else {})))
    cases = [("vit3_model_tiny", plain(ViT3), vit3_filter),
             ("hvit3_model_tiny", lambda kw: HViT3(embed_dim=kw["dim"], depths=kw["depths"], num_heads=kw["num_heads"],
                                                   num_classes=kw["num_classes"]), hvit3_filter),  # RoPE mixers
             ("t5_model_tiny", plain(T5), t5_filter)]
    for name, build, filt in cases:
        t, model = _classifier_fixture(name, build, filt)
        _check_model(model, lambda: model(t["input.x"].double()), min_mixers=2)


def test_fixture_dit3_dit5():
    from ttt_zoo.models.dit import DiT, checkpoint_filter_fn
    for name, mixer, cpe in (("dit3_model_tiny", "vit3", True), ("dit5_model_tiny", "dit5_mixed", False)):
        t, state, meta, _ = load_fixture(name)
        if name == "dit5_model_tiny":  # as tests/test_dit5.py builds it
            model = DiT(input_size=16, patch_size=2, in_chans=4, hidden_size=64, depth=2, num_heads=2,
                        num_classes=10, mixer="dit5_mixed")
        else:
            kw = json.loads(meta["constructor_kwargs"])
            model = DiT(input_size=kw["input_size"], patch_size=kw["patch_size"], in_chans=kw["in_channels"],
                        hidden_size=kw["hidden_size"], depth=kw["depth"], num_heads=kw["num_heads"],
                        mlp_ratio=kw["mlp_ratio"], class_dropout_prob=kw["class_dropout_prob"],
                        num_classes=kw["num_classes"], learn_sigma=kw["learn_sigma"], mixer=mixer, cpe=cpe)
        model = model.double().eval()
        model.load_state_dict(checkpoint_filter_fn({"model": state}, model), strict=True)
        _check_model(model, lambda: model(t["input.x"].double(), t["input.t"], t["input.y"]), min_mixers=2)


def _photo():
    spec = importlib.util.spec_from_file_location(
        "numerics_table", os.path.join(os.path.dirname(__file__), "..", "experiments", "numerics_table.py"))
    nt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nt)
    return nt.photo(224, 224)[:1].double()


@pytest.mark.parametrize("name", ["vit3_tiny", "hvit3_tiny", "t5_tiny", "t5_plus_tiny", "visionttt_tiny"])
def test_photo_through_stem(name):
    """Random-init models (seed 0) on the bundled photo: every mixer of the first blocks, realistic inputs."""
    torch.manual_seed(0)
    kw = {"depths": (1, 1, 1, 1)} if name == "hvit3_tiny" else {"depth": 2}
    model = timm.create_model(name, **kw).double().eval()
    _check_model(model, lambda: model.forward_features(_photo()), min_mixers=2)


# ---------------------------------------------------------------------------------------- negative controls
def _miss(name, breaker, x_seed=1):
    m, x = _random(name), _x(x_seed)
    with torch.no_grad():
        ref = m(x, FS)
        form = breaker(m, linear_attention(m, x, FS))
        return _err(form.output(), ref)


def _no_rope(m):
    plain = ViT3TTT(32, 4).double().eval()
    plain.load_state_dict(m.state_dict())
    return linear_attention(plain, _x(), FS)


def _swap_w1_w2(m, form):
    with torch.no_grad():
        m.w1.data, m.w2.data = m.w2.data.clone(), m.w1.data.clone()
        return linear_attention(m, _x(), FS)


def _no_norm(m, form):
    m.normalize_grad = False
    return linear_attention(m, _x(), FS)


NEGATIVE = {
    "vit3: drop the normaliser": ("vit3", _no_norm),
    "vit3: conv normaliser dropped": ("vit3", lambda m, f: dataclasses.replace(
        f, conv=dataclasses.replace(f.conv, v_hat=f.conv.v_hat / f.conv.v_coef / (3 * f.conv.q.shape[2])))),
    "vit3: swap w1 and w2": ("vit3_no_norm", _swap_w1_w2),
    "vit3: static gate (W2 not stepped)": ("vit3_no_norm", lambda m, f: dataclasses.replace(
        f, swiglu=dataclasses.replace(f.swiglu, gate=torch.nn.functional.silu(f.swiglu.q @ m.w2)))),
    "vit3 rope: q, k not rotated": ("vit3_rope", lambda m, f: dataclasses.replace(
        f, swiglu=dataclasses.replace(f.swiglu, q=_no_rope(m).swiglu.q, k=_no_rope(m).swiglu.k))),
    "t5: values without s/N": ("t5", lambda m, f: dataclasses.replace(
        f, ttt=dataclasses.replace(f.ttt, v_hat=f.ttt.v_hat * f.ttt.q.shape[2]))),
    "t5: S0 = 0": ("t5", lambda m, f: dataclasses.replace(
        f, ttt=dataclasses.replace(f.ttt, s0=torch.zeros_like(f.ttt.s0)))),
    "dit5: no delta-rule residual": ("dit5", lambda m, f: dataclasses.replace(
        f, ttt=dataclasses.replace(f.ttt, v_hat=f.ttt.v_hat + f.ttt.v_coef * (f.ttt.k @ f.ttt.s0)))),
    "visionttt: directions swapped": ("visionttt", lambda m, f: dataclasses.replace(f, scans=f.scans[::-1])),
    "visionttt: exclusive mask": ("visionttt", lambda m, f: dataclasses.replace(f, scans=tuple(
        _ExclusiveMask(**{fl.name: getattr(s, fl.name) for fl in dataclasses.fields(s)}) for s in f.scans))),
}


class _ExclusiveMask(ttt_zoo.analysis.ScanForm):
    def mask(self):
        return super().mask() * (1 - torch.eye(self.q.shape[2], dtype=self.q.dtype))


@pytest.mark.parametrize("case", list(NEGATIVE))
def test_negative_controls_fail(case):
    name, breaker = NEGATIVE[case]
    err = _miss(name, breaker)
    assert err > 1e-4, f"{case}: the broken form still matches ({err:.2e}); the test could not fail"


def test_unsupported_mixer_and_bad_input_errors():
    from ttt_zoo.layers import SoftmaxAttention
    with pytest.raises(NotImplementedError, match="SoftmaxAttention has no exact linear-attention form"):
        linear_attention(SoftmaxAttention(32, 4), torch.randn(1, 42, 32), FS)
    with pytest.raises(ValueError, match="N = H \\* W = 42"):
        linear_attention(ViT3TTT(32, 4), torch.randn(1, 40, 32), FS)


# every registered model, every mixer in it: a column of tests/test_registry_contract.py


# ------------------------------------------ every variant option: the form, the mixer and an autograd inner loop
VARIANTS = {
    "vit3": lambda: ViT3TTT(16, 2),
    "vit3_v1": lambda: ViT3TTT(16, 2, inner_update="last"),
    "vit3_v3": lambda: ViT3TTT(16, 2, inner_model="linear", inner_update="last"),
    "vit3_v6": lambda: ViT3TTT(16, 2, inner_model="linear", inner_update="last", normalize_grad=False),
    "vit3_ascent_qk_rope": lambda: ViT3TTT(16, 2, gradient_ascent=True, share_qk=True, rope=True),
    "vit3_steps3": lambda: ViT3TTT(16, 2, inner_steps=3),
    "vit3_v1_steps2": lambda: ViT3TTT(16, 2, inner_update="last", inner_steps=2),
    "t5": lambda: T5TTT(16, 2),
    "t5_plus_v1": lambda: T5TTT(16, 2, na_kernel=3, inner_update="last"),
    "t5_v3": lambda: T5TTT(16, 2, inner_model="linear"),
    "t5_ascent_qk": lambda: T5TTT(16, 2, gradient_ascent=True, share_qk=True, na_kernel=3),
    "t5_steps2": lambda: T5TTT(16, 2, inner_steps=2),
    "dit5": lambda: DiT5MixedAttention(16, 2, kernel_size=3),
    "dit5_v1_steps2": lambda: DiT5MixedAttention(16, 2, kernel_size=3, inner_update="last", inner_steps=2),
    "dit5_v3": lambda: DiT5MixedAttention(16, 2, kernel_size=3, inner_model="linear"),
    "dit5_ascent_qk_dil2": lambda: DiT5MixedAttention(16, 2, kernel_size=3, dilation=2, gradient_ascent=True,
                                                      share_qk=True),
    "dit5_steps2": lambda: DiT5MixedAttention(16, 2, kernel_size=3, inner_steps=2),
    "visionttt": lambda: TTTLinearMixer(16, head_dim=8, mini_batch=5),
    "visionttt_plain_ascent_sep": lambda: TTTLinearMixer(16, head_dim=8, mini_batch=5, inner_ln_residual=False,
                                                         gradient_ascent=True, w0_mode="separate"),
    "visionttt_la": lambda: TTTLinearMixer(16, head_dim=8, mini_batch=5, inner_loss="dot"),
    "visionttt_la_ascent_steps2_convq": lambda: TTTLinearMixer(16, head_dim=8, mini_batch=5, inner_loss="dot",
                                                               gradient_ascent=True, inner_steps=2, qk_mode="conv_q"),
    "visionttt_la_frozen_norope_ppd": lambda: TTTLinearMixer(16, head_dim=8, mini_batch=5, inner_loss="dot",
                                                             w0_mode="frozen", inner_rope=False,
                                                             proj_per_direction=True),
}
VFS = (8, 7)  # 56 tokens: 11 full mini-batches of 5 and a partial one


def _grad_steps(loss, ws, steps, update, normalize=None):
    """``steps`` plain gradient steps of ``loss(*ws)`` by autograd on the ``update``-selected weights."""
    ws = list(ws)
    for _ in range(steps):
        with torch.enable_grad():
            ws = [w.detach().requires_grad_() for w in ws]
            gs = torch.autograd.grad(loss(*ws), [w for w, u in zip(ws, update) if u])
        it = iter(gs)
        ws = [w.detach() - (normalize(next(it)) if normalize else next(it)) if u else w.detach()
              for w, u in zip(ws, update)]
    return ws


def _autograd_vit3(m, x, fs):
    """The ViT3 mixer with both inner learners stepped by autograd of -(scale/N) sum <f(k), v> (per sample)."""
    t = m.linear_attention_inputs(x, fs)
    b, n, c = x.shape
    h, d = m.num_heads, m.head_dim
    q, k, v = (z[..., :c].reshape(b, n, h, d).transpose(1, 2) for z in (t["q"], t["k"], t["v"]))
    sg = -1.0 if m.gradient_ascent else 1.0
    norm = (lambda g, dims: g / (g.norm(dim=dims, keepdim=True) + 1)) if m.normalize_grad else (lambda g, dims: g)
    f = (lambda z, w1, w2: (z @ w1) * torch.nn.functional.silu(z @ w2)) if m.w2 is not None else \
        (lambda z, w1, w2: z @ w1)
    ws = [m.w1.expand(b, -1, -1, -1), (m.w2 if m.w2 is not None else m.w1).expand(b, -1, -1, -1)]
    upd = [True, m.w2 is not None and m.inner_update == "all"]
    w1, w2 = _grad_steps(lambda a, c2: -m.scale / n * (f(k, a, c2) * v).sum(), ws, m.inner_steps, upd,
                         lambda g: sg * norm(g, -2))
    o1 = f(q, w1, w2).transpose(1, 2).reshape(b, n, c)
    qc, kc, vc = (z[..., c:].transpose(1, 2).reshape(b * d, 1, *fs) for z in (t["q"], t["k"], t["v"]))
    conv = lambda z, w: torch.nn.functional.conv2d(z.reshape(1, b * d, *fs), w.reshape(b * d, 1, 3, 3),  # noqa
                                                   padding=1, groups=b * d).reshape(b * d, 1, *fs)
    w3, = _grad_steps(lambda w: -m.scale / n * (conv(kc, w) * vc).sum(), [m.w3.repeat(b, 1, 1, 1)],
                      m.inner_steps, [True], lambda g: sg * norm(g.reshape(b * d, 9), -1).reshape(g.shape))
    o2 = conv(qc, w3).reshape(b, d, n).transpose(1, 2)
    return m.proj(torch.cat([o1, o2], -1))


def _autograd_inner(m, dot):
    """A T5 / DiT5 ``_inner`` replacement: the inner loss's steps by autograd (per sample), read with q, averaged
    with the neighbourhood attention ``na`` where the mixer passes one (T5+, DiT5)."""
    def inner(q, k, v, na=None):
        b, n = k.shape[0], k.shape[2]
        s = (-m.scale if m.gradient_ascent else m.scale) / n
        if m.linear:
            names, hidden = [], lambda z: z
        elif dot:
            names, hidden = ["w1", "w2"], lambda z, w1, w2: torch.nn.functional.silu(z @ w1) * (z @ w2)
        else:
            names, hidden = ["w1"], lambda z, w1: torch.nn.functional.silu(z @ w1)
        last = "w3" if dot else "w2"
        ws = [getattr(m, a).expand(b, -1, -1, -1) for a in names + [last]]

        def loss(*a):
            f = hidden(k, *a[:-1]) @ a[-1]
            return -s * (f * v).sum() if dot else 0.5 * s * (f - v).pow(2).sum()
        ws = _grad_steps(loss, ws, m.inner_steps, [m.inner_update == "all"] * len(names) + [True])
        out = hidden(q, *ws[:-1]) @ ws[-1]
        return out if na is None else 0.5 * (out + na)
    return inner


def _autograd_scan(m):
    """A Vision-TTT ``_scan`` replacement: each direction's mini-batch steps with per-token inner gradients by
    autograd at the mini-batch's incoming state; token i reads W - sum_{j<=i} tau_i lr_j G_j."""
    def scan(q, k, v, lr, return_grad_norm=False):
        lr = lr * ((-1.0 if m.gradient_ascent else 1.0) * m.inner_steps)
        tau = token_tau(m.tau_offset)
        outs = []
        for dirn, flip in enumerate((False, True)):
            qd, kd, vd, ld = (z.flip(2) for z in (q, k, v, lr)) if flip else (q, k, v, lr)
            if m.inner_rope:
                from ttt_zoo.layers.la_forms import rope_half
                qd, kd = rope_half(qd, m.mini_batch, m.rope_theta), rope_half(kd, m.mini_batch, m.rope_theta)
            w = m.w0[min(dirn, m.w0.shape[0] - 1)].expand(q.shape[0], -1, -1, -1)
            bb = m.b0[min(dirn, m.b0.shape[0] - 1)].expand(q.shape[0], -1, -1, -1)
            ln = (lambda z: torch.nn.functional.layer_norm(z, z.shape[-1:], eps=1e-6) * m.ttt_norm_weight[:, None]
                  + m.ttt_norm_bias[:, None])

            def f(z, W, B):  # z (B, h, r, d) with per-token W (B, h, r, d, d), B (B, h, r, 1, d)
                y = (z.unsqueeze(-2) @ W + B).squeeze(-2)
                return z + ln(y) if (m.inner_ln_residual and not m.dot_loss) else y
            out = []
            for st in range(0, q.shape[2], m.mini_batch):
                sl = slice(st, min(st + m.mini_batch, q.shape[2]))
                kc, vc, qc, lc = kd[:, :, sl], vd[:, :, sl], qd[:, :, sl], ld[:, :, sl]
                r = kc.shape[2]
                with torch.enable_grad():  # one copy of the state per token: per-token gradients
                    W = w.unsqueeze(2).expand(-1, -1, r, -1, -1).detach().requires_grad_()
                    B = bb.unsqueeze(2).expand(-1, -1, r, -1, -1).detach().requires_grad_()
                    fk = f(kc, W, B)
                    loss = -(fk * vc).sum() if m.dot_loss else 0.5 * (fk - vc).pow(2).sum()
                    gw, gb = torch.autograd.grad(loss, [W, B])
                eta = torch.tril(tau[:r, None] * lc[:, :, None, :])  # (B, h, i, j)
                Wi = w.unsqueeze(2) - torch.einsum("bhij,bhjde->bhide", eta, gw)
                Bi = bb.unsqueeze(2) - torch.einsum("bhij,bhjde->bhide", eta, gb)
                out.append(f(qc, Wi, Bi))
                w, bb = Wi[:, :, -1], Bi[:, :, -1]
            z = torch.cat(out, 2)
            outs.append(z.flip(2) if flip else z)
        return outs[0] + outs[1], None
    return scan


def perturbed_variant(name: str):
    """The variant's mixer in float64, eval, with seeded N(0, 0.3) parameters (off their near-zero init, so every
    term of the form matters)."""
    torch.manual_seed(0)
    m = VARIANTS[name]()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m.double().eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_forms(name):
    """Each variant option's own form equals the mixer and an independent autograd inner loop, float64."""
    m = perturbed_variant(name)
    torch.manual_seed(1)
    x = torch.randn(2, VFS[0] * VFS[1], 16, dtype=torch.float64)
    with torch.no_grad():
        ref = m(x, VFS)
        form = linear_attention(m, x, VFS).output()
        assert _err(form, ref) <= TOL, f"form vs mixer {_err(form, ref):.2e}"
        if isinstance(m, ViT3TTT):
            auto = _autograd_vit3(m, x, VFS)
        else:
            if isinstance(m, TTTLinearMixer):
                m._scan = _autograd_scan(m)
            else:
                m._inner = _autograd_inner(m, dot=isinstance(m, T5TTT))
            auto = m(x, VFS)
    assert _err(auto, ref) <= TOL, f"autograd inner loop vs mixer {_err(auto, ref):.2e}"
    assert _err(form, auto) <= TOL


def test_every_registered_mixer_has_a_checked_form_or_says_it_has_none():
    """``list_mixers()`` is the registry: a mixer class registered later is either among ``MIXERS`` (its form is
    checked against it above) or says in one line that it has no exact form, so it cannot slip past."""
    from ttt_zoo.layers.mixer import _MIXERS, create_mixer, list_mixers
    checked = {type(build()) for build in MIXERS.values()}
    shipped = [name for name in list_mixers() if _MIXERS[name].__module__.startswith("ttt_zoo.")]  # not tests' toys
    unchecked = [name for name in shipped if _MIXERS[name] not in checked]
    for name in unchecked:
        with pytest.raises(NotImplementedError, match="has no exact linear-attention form") as err:
            linear_attention(create_mixer(name, 32), _x(), FS)
        assert "\n" not in str(err.value), name
    assert unchecked == ["softmax"], unchecked  # the one registered mixer without a form today
