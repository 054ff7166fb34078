"""--task diffusion: the DiT loss against a float64 reference, the diffusers EMA adapter, RNG resume, training."""
import argparse
import math

import pytest
import torch

pytest.importorskip("diffusers")
import timm  # noqa: E402

from ttt_zoo.train.diffusion import DiffusersEMA, DiffusionTask, DiTDiffusion  # noqa: E402
from ttt_zoo.train.distributed import DistInfo  # noqa: E402

TINY = dict(hidden_size=32, depth=1, num_heads=2, patch_size=2)


def _tiny_dit(name="dit3_s_2", input_size=8, in_chans=3, num_classes=4, **kw):
    model = timm.create_model(name, input_size=input_size, in_chans=in_chans, num_classes=num_classes,
                              **dict(TINY, **kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the official init zeroes the output layers: make the outputs non-trivial
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _reference_terms(model, x0, y, t, noise):
    """The DiT / improved-DDPM loss written out in float64 from the paper's formulas (no diffusers)."""
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    alphas = 1 - betas
    ab = torch.cumprod(alphas, 0)
    ab_prev = torch.cat([torch.ones(1, dtype=torch.float64), ab[:-1]])
    r = lambda v: v[t].reshape(-1, 1, 1, 1)  # noqa: E731
    x0, noise = x0.double(), noise.double()
    x_t = r(ab).sqrt() * x0 + (1 - r(ab)).sqrt() * noise
    out = model.double()(x_t, t, y)
    c = x0.shape[1]
    eps, v = out[:, :c], out[:, c:]
    mse = ((eps - noise) ** 2).mean((1, 2, 3))
    post_var = betas * (1 - ab_prev) / (1 - ab)
    post_var_clipped = torch.cat([post_var[1:2], post_var[1:]])
    pred_x0 = (x_t - (1 - r(ab)).sqrt() * eps) / r(ab).sqrt()
    mean_of = lambda x_start: (r(betas) * r(ab_prev).sqrt() * x_start  # noqa: E731
                               + (1 - r(ab_prev)) * r(alphas).sqrt() * x_t) / (1 - r(ab))
    mu, mu_true = mean_of(pred_x0), mean_of(x0)
    frac = (v + 1) / 2
    logvar = frac * r(betas).log() + (1 - frac) * r(post_var_clipped).log()
    lv_true = r(post_var_clipped).log()
    kl = 0.5 * (logvar - lv_true + (lv_true.exp() + (mu_true - mu) ** 2) / logvar.exp() - 1)
    cdf = lambda z: 0.5 * (1 + torch.erf(z / math.sqrt(2)))  # noqa: E731
    sd = (0.5 * logvar).exp()
    hi, lo = cdf((x0 - mu + 1 / 255) / sd), cdf((x0 - mu - 1 / 255) / sd)
    p = torch.where(x0 < -0.999, hi, torch.where(x0 > 0.999, 1 - lo, hi - lo))
    nll = -p.clamp_min(1e-12).log()
    vb = torch.where(t == 0, nll.mean((1, 2, 3)), kl.mean((1, 2, 3))) / math.log(2)
    return mse, vb


def test_dit_loss_matches_float64_reference():
    model = _tiny_dit().eval()
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(6, 3, 8, 8, generator=g) * 2 - 1
    x0[0, 0, 0, :3] = torch.tensor([-1.0, 1.0, 0.0])  # both edge bins of the decoder NLL
    t = torch.tensor([0, 0, 1, 17, 500, 999])
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    noise = torch.randn(x0.shape, generator=g)
    terms = DiTDiffusion(learn_sigma=True).loss(model, x0, y, t, noise)
    mse, vb = _reference_terms(model, x0, y, t, noise)
    torch.testing.assert_close(terms["mse"].double(), mse, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(terms["vb"].double(), vb, rtol=2e-4, atol=1e-5)
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"])
    assert vb[:2].min() > 1 and vb[2:].max() < vb[:2].min()  # the t=0 NLL term is of another size than the KLs


def test_vb_term_trains_only_the_variance():
    diffusion = DiTDiffusion(learn_sigma=True)
    x0 = torch.rand(4, 3, 4, 4) * 2 - 1
    out = torch.randn(4, 6, 4, 4, requires_grad=True)
    terms = diffusion.loss(lambda x, t, y: out, x0, torch.zeros(4, dtype=torch.long), torch.tensor([0, 3, 300, 999]),
                           torch.randn_like(x0))
    (grad,) = torch.autograd.grad(terms["vb"].sum(), out)
    assert grad[:, :3].abs().max() == 0 and grad[:, 3:].abs().min() > 0
    plain = DiTDiffusion(learn_sigma=False).loss(lambda x, t, y: out[:, :3], x0, torch.zeros(4, dtype=torch.long),
                                                 torch.tensor([0, 3, 300, 999]), torch.randn_like(x0))
    assert set(plain) == {"mse", "loss"}


def test_diffusers_ema_adapter_round_trip(tmp_path):
    torch.manual_seed(0)
    model = _tiny_dit()
    ema = DiffusersEMA(model, decay=0.9)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p))
        ema.update(model, step)
        # diffusers' decay: 0 on the first update, then min(decay, (1 + n) / (10 + n)) with n = step - 1
        d = 0.0 if step == 1 else min(0.9, step / (9 + step))
        for n, p in model.named_parameters():
            ref[n] = d * ref[n] + (1 - d) * p.detach() if p.requires_grad else p.detach().clone()
    for n, p in ema.module.named_parameters():
        torch.testing.assert_close(p, ref[n], rtol=1e-5, atol=1e-6)
    torch.save(ema.state_dict(), tmp_path / "ema.pt")
    other = DiffusersEMA(_tiny_dit(), decay=0.5)
    other.load_state_dict(torch.load(tmp_path / "ema.pt", weights_only=True))
    for a, b in zip(ema.module.parameters(), other.module.parameters()):
        assert torch.equal(a, b)
    assert other.ema.decay == 0.9 and other.ema.optimization_step == 5
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight.add_(1.0)
    ema.update(model, 6)
    other.update(model, 6)
    for a, b in zip(ema.module.parameters(), other.module.parameters()):  # the loaded copy keeps tracking
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="does not fit the model"):
        DiffusersEMA(_tiny_dit(depth=2)).load_state_dict(ema.state_dict())


def _args(root, **kw):
    base = dict(model="dit3_s_2", model_kwargs=dict(TINY, class_dropout_prob=0.5), img_size=8, data_dir=root,
                batch_size=16, workers=0, seed=0, diffusion_hflip=0.0, eval_seed=0, model_ema=False, vae=None)
    return argparse.Namespace(**dict(base, **kw))


@pytest.fixture(scope="module")
def digits8(tmp_path_factory):
    pytest.importorskip("sklearn")
    from ttt_zoo.train.digits import make_digits_folder
    return make_digits_folder(str(tmp_path_factory.mktemp("data") / "digits8"), img_size=8)


def test_task_rng_is_a_function_of_the_step_counter(digits8):
    task = DiffusionTask(_args(digits8), DistInfo())
    model = task.build_model()
    assert model.in_chans == 3 and model.num_classes == 10 and model.grid_size == (4, 4)
    batch = next(iter(task.build_loaders()[0]))
    losses = [task.train_step(model, batch)[0].item() for _ in range(3)]
    assert len(set(losses)) == 3 and task.state_dict() == {"step": 3}
    resumed = DiffusionTask(_args(digits8), DistInfo())
    resumed.diffusion = task.diffusion
    resumed.load_state_dict({"step": 2})
    assert resumed.train_step(model, batch)[0].item() == losses[2]  # same t, noise and label dropout
    ev = task.evaluate(model, [batch])
    assert ev == task.evaluate(model, [batch]) and set(ev) == {"loss", "mse", "vb"}
