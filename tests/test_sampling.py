"""DiT sampling on diffusers' schedulers: exactness on an oracle denoiser, shapes, seeds, guidance, VAE, PNG."""
import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")
from diffusers import AutoencoderKL  # noqa: E402
from PIL import Image  # noqa: E402

from ttt_zoo.models import DiT  # noqa: E402
from ttt_zoo.sampling import make_scheduler, sample, save_image_grid  # noqa: E402


class OracleDenoiser(nn.Module):
    """The exact eps predictor for data that is a single point x0: eps = (x_t - sqrt(ab_t) x0) / sqrt(1 - ab_t)."""

    def __init__(self, x0):
        super().__init__()
        self.register_buffer("x0", x0)
        self.dummy = nn.Parameter(torch.zeros((), dtype=x0.dtype))
        self.in_chans, self.patch_size, self.grid_size = x0.shape[0], 1, tuple(x0.shape[1:])
        self.learn_sigma = False
        self.alphas_cumprod = make_scheduler("ddpm", learn_sigma=False).alphas_cumprod.to(x0.dtype)
        self.seen = []

    def forward(self, x, t, y):
        self.seen.append(int(t[0]))
        ab = self.alphas_cumprod[t].reshape(-1, 1, 1, 1)
        return (x - ab.sqrt() * self.x0) / (1 - ab).sqrt()


@pytest.mark.parametrize("name", ["ddpm", "ddim"])
def test_oracle_denoiser_recovers_the_data_point(name):
    x0 = torch.randn(4, 3, 5, dtype=torch.float64)
    oracle = OracleDenoiser(x0)
    out = sample(oracle, [0, 1], num_steps=25, scheduler=name, cfg_scale=1.0, seed=3)
    assert out.shape == (2, 4, 3, 5)
    torch.testing.assert_close(out, x0.expand(2, -1, -1, -1), rtol=1e-6, atol=1e-6)
    assert len(oracle.seen) == 25 and oracle.seen[0] > 900 and oracle.seen[-1] == 0  # respaced 1000-step chain


def _tiny(mixer, cpe):
    model = DiT(input_size=8, patch_size=2, in_chans=4, hidden_size=32, depth=1, num_heads=2, num_classes=5,
                mixer=mixer, cpe=cpe)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _tiny_vae():
    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
                         latent_channels=4, norm_num_groups=4, sample_size=16).eval()


@pytest.mark.parametrize("mixer,cpe,scheduler", [("vit3", True, "ddpm"), ("dit5_mixed", False, "ddim")])
def test_sample_tiny_models_with_vae_to_png(tmp_path, mixer, cpe, scheduler):
    model, vae = _tiny(mixer, cpe), _tiny_vae()
    kw = dict(num_steps=4, scheduler=scheduler, cfg_scale=4.0, vae=vae, latent_size=(10, 12))
    a = sample(model, [1, 4, 0], seed=7, **kw)
    b = sample(model, [1, 4, 0], seed=7, **kw)
    c = sample(model, [1, 4, 0], seed=8, **kw)
    assert a.shape == (3, 3, 20, 24)  # VAE with one 2x upsampling
    assert 0 <= a.min() and a.max() <= 1
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    path = save_image_grid(a, str(tmp_path / "grid.png"), nrow=2)
    img = Image.open(path)
    assert img.format == "PNG" and img.size == (2 * 24 + 3 * 2, 2 * 20 + 3 * 2)


def test_guidance_changes_samples_and_latents_without_vae(tmp_path):
    model = _tiny("softmax", False)
    guided = sample(model, [2, 3], num_steps=3, scheduler="ddim", cfg_scale=4.0, seed=0)
    plain = sample(model, [2, 3], num_steps=3, scheduler="ddim", cfg_scale=1.0, seed=0)
    assert guided.shape == plain.shape == (2, 4, 8, 8)
    assert not torch.allclose(guided, plain)
    save_image_grid(guided, str(tmp_path / "latents.png"))  # raw latents: per-image min-max, first 3 channels
    assert Image.open(tmp_path / "latents.png").size == (2 * 8 + 3 * 2, 8 + 2 * 2)


def test_sampling_errors():
    model = _tiny("softmax", False)
    with pytest.raises(ValueError, match="Unknown scheduler"):
        sample(model, [1], scheduler="euler")
    with pytest.raises(ValueError, match="only meaningful for DDIM"):
        sample(model, [1], scheduler="ddpm", eta=0.5, num_steps=2)
    bad_vae = AutoencoderKL(block_out_channels=(8,), latent_channels=3, norm_num_groups=4)
    with pytest.raises(ValueError, match="3 latent channels"):
        sample(model, [1], vae=bad_vae, num_steps=2)


def _official_respacing(num_steps, num_timesteps=1000):
    """improved-diffusion's space_timesteps(num_timesteps, str(num_steps)) for one section, written out."""
    stride = (num_timesteps - 1) / (num_steps - 1)
    return sorted({round(i * stride) for i in range(num_steps)}, reverse=True)


@pytest.mark.parametrize("steps", [250, 50, 7])
def test_ddpm_timesteps_are_the_official_respacing(steps):
    sched = make_scheduler("ddpm", learn_sigma=True)
    sched.set_timesteps(steps)
    assert sched.timesteps.tolist() == _official_respacing(steps)


@pytest.mark.parametrize("k", [0, 100])
def test_learned_range_ddpm_step_matches_the_respaced_official_posterior(k):
    """One diffusers DDPM step with the learned-range variance == the respaced improved-DDPM p_sample (float64)."""
    sched = make_scheduler("ddpm", learn_sigma=True)
    sched.set_timesteps(250)
    t, prev = int(sched.timesteps[k]), int(sched.timesteps[k + 1])
    ab = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0)
    a_t, a_p = ab[t], ab[prev]
    beta = 1 - a_t / a_p  # the respaced process's beta
    g = torch.Generator().manual_seed(0)
    x_t, eps, v = (torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64) for _ in range(3))
    v = v.tanh()
    x0 = (x_t - (1 - a_t).sqrt() * eps) / a_t.sqrt()
    mean = (beta * a_p.sqrt() * x0 + (1 - a_p) * (1 - beta).sqrt() * x_t) / (1 - a_t)
    logvar = (v + 1) / 2 * beta.log() + (1 - v) / 2 * (beta * (1 - a_p) / (1 - a_t)).log()
    z = torch.randn(x_t.shape, generator=torch.Generator().manual_seed(9)).double()  # what diffusers draws
    ref = mean + (0.5 * logvar).exp() * z
    out = sched.step(torch.cat([eps, v], 1).float(), t, x_t.float(), generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(out.prev_sample.double(), ref, rtol=1e-4, atol=1e-4)


def test_sample_cli_errors(tmp_path, capsys):
    from ttt_zoo.cli import main
    assert main(["sample", "--out", str(tmp_path / "x.png")]) == 2
    assert "give --model" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "is a folder, not a weights file" in capsys.readouterr().err  # neither args.yaml nor checkpoint.json
    assert main(["sample", "--model", "dit_s_2", "--model-kwargs", "hidden_size=32", "depth=1", "num_heads=2",
                 "num_classes=5", "--labels", "7", "--out", str(tmp_path / "x.png")]) == 2
    assert "outside the model's 5 classes" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_sample_cli_builds_the_official_checkpoint_with_its_ema_weights(tmp_path):
    """An official train.py file {'model', 'ema', 'opt', 'args'}: the CLI infers latent size, channels and classes
    from the weights and loads the EMA ones (the model's output equals the official fixture's)."""
    import argparse
    from fixtures import load_fixture
    from ttt_zoo.cli.sample import _build
    t, state, _, tol = load_fixture("dit3_model_tiny")
    path = tmp_path / "0400000.pt"
    torch.save({"model": {k: torch.zeros_like(v) for k, v in state.items()}, "ema": state,
                "args": argparse.Namespace(model="DiTTT-B/2")}, path)
    args = argparse.Namespace(model="dit3_s_2", model_kwargs=dict(hidden_size=64, depth=2, num_heads=2),
                              checkpoint=str(path), vae=None, image_size=None)
    model, vae, _ = _build(args)
    assert vae is None and model.in_chans == 4 and model.grid_size == (8, 8) and model.num_classes == 10
    with torch.no_grad():
        out = model.eval()(t["input.x"], t["input.t"], t["input.y"])
    torch.testing.assert_close(out, t["output"], **tol)


def test_grid_upscale_is_nearest_neighbour_and_sized(tmp_path):
    from ttt_zoo.sampling import image_grid
    images = torch.rand(3, 3, 5, 7)
    grid = image_grid(images, nrow=2, padding=2, upscale=4)
    assert grid.shape == (2 * 20 + 3 * 2, 2 * 28 + 3 * 2, 3)
    first = grid[2:22, 2:30].permute(2, 0, 1).float()
    expected = (images[0] * 255).round().repeat_interleave(4, 1).repeat_interleave(4, 2)
    assert torch.equal(first, expected)
    assert image_grid(images[:1], padding=2).shape == (5 + 4, 7 + 4, 3)  # one image: framed like the others
    with pytest.raises(ValueError, match="upscale must be a positive integer"):
        image_grid(images, upscale=0)
    path = save_image_grid(images, str(tmp_path / "big.png"), upscale=3)
    assert Image.open(path).size == (2 * 21 + 3 * 2, 2 * 15 + 3 * 2)


def test_grid_upscale_shows_samples_at_the_model_image_size():
    from ttt_zoo.sampling import MIN_CELL_PX, grid_upscale
    assert MIN_CELL_PX == 128
    assert grid_upscale((256, 256)) == 1  # decoded by the VAE: already the image size
    assert grid_upscale((32, 32), (256, 256)) == 8  # a 256-px model's latents without the VAE: as the image
    assert grid_upscale((16, 16)) == 8  # the digits DiT3's 16-px samples: 128 px, not a speck
    assert grid_upscale((20, 24)) == 7  # the short side reaches 128 (140 x 168)
    assert grid_upscale((16, 16), min_side=1) == 1


def _grid_cells(path, side, padding=2):
    """(columns, rows) of a grid of square cells ``side`` px with make_grid's padding; fails on any other size."""
    w, h = Image.open(path).size
    cols, rem_w = divmod(w - padding, side + padding)
    rows, rem_h = divmod(h - padding, side + padding)
    assert rem_w == rem_h == 0, (w, h, side)
    return cols, rows


def test_sample_cli_grid_is_at_the_model_image_size_and_nrow_arranges_it(tmp_path, capsys):
    """A 256-px latent model (32-px latents) sampled without a VAE: each cell is 256 px (was 32), 5 samples
    ``--nrow 2`` are 2 columns x 3 rows, ``--nrow 5`` one row; the tiny model with its VAE decodes to 32 px and is
    shown at 128; ``--upscale 1`` keeps the sampled size."""
    from ttt_zoo.cli import main
    base = ["sample", "--model", "dit_s_2", "--model-kwargs", "hidden_size=32", "depth=1", "num_heads=2",
            "num_classes=5", "input_size=32", "--labels", "0", "1", "2", "3", "4", "--steps", "1", "--device", "cpu"]
    assert main(base + ["--nrow", "2", "--out", str(tmp_path / "a.png")]) == 0
    assert "(518 x 776 px, 2 per row, each 256 x 256 px, enlarged 8x)" in capsys.readouterr().out
    assert _grid_cells(tmp_path / "a.png", 256) == (2, 3)
    assert main(base + ["--nrow", "5", "--out", str(tmp_path / "b.png")]) == 0
    assert _grid_cells(tmp_path / "b.png", 256) == (5, 1)
    assert main(base + ["--upscale", "1", "--out", str(tmp_path / "c.png")]) == 0
    assert _grid_cells(tmp_path / "c.png", 32) == (3, 2)  # default nrow: about square
    assert main(["sample", "--model", "dit3_s_2", "--tiny", "--steps", "1", "--labels", "1", "2", "--device", "cpu",
                 "--out", str(tmp_path / "d.png")]) == 0
    assert _grid_cells(tmp_path / "d.png", 128) == (2, 1)  # 16-px latents, a 2x VAE: 32-px images at 128 px
