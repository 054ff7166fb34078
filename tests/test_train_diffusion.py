"""--task diffusion: the DiT loss against a float64 reference, the diffusers EMA adapter, RNG resume, training."""
import csv
import math
import os
import re

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


def _args(root, *extra):
    from ttt_zoo.train.args import parse_args
    args, task_cls = parse_args(["--task", "diffusion", "--model", "dit3_s_2", "--model-kwargs", "hidden_size=32",
                                 "depth=1", "num_heads=2", "class_dropout_prob=0.5", "--img-size", "8", "--data-dir",
                                 root, "-b", "16", "-j", "0", "--hflip", "0", *extra])
    assert task_cls is DiffusionTask
    return args


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


# ----- through `ttt-zoo train --task diffusion` -----

@pytest.fixture(scope="module")
def tiny_digits(tmp_path_factory):
    pytest.importorskip("sklearn")
    from _train_data import make_tiny_digits
    return make_tiny_digits(str(tmp_path_factory.mktemp("data") / "tiny"), train_per_class=4, val_per_class=2,
                            img_size=8)


def _train(data, out, experiment, model, *extra, patch_size=2):
    from ttt_zoo.train.trainer import main
    argv = ["--task", "diffusion", "--model", model, "--model-kwargs", "hidden_size=32", "depth=1", "num_heads=2",
            f"patch_size={patch_size}", "--img-size", "8", "--data-dir", data, "-b", "8", "-j", "0", "--hflip", "0",
            "--opt", "adamw", "--lr", "3e-3", "--weight-decay", "0", "--warmup-epochs", "0", "--seed", "3", "--log-interval", "100",
            "--output", str(out), "--experiment", experiment, "--device", "cpu", *extra]
    assert main(argv) == 0
    return os.path.join(str(out), experiment)


def _summary(folder):
    with open(os.path.join(folder, "summary.csv")) as f:
        return list(csv.DictReader(f))


def test_train_loss_falls_then_sample_the_folder(tiny_digits, tmp_path):
    folder = _train(tiny_digits, tmp_path, "run", "dit3_s_2", "--epochs", "8", "--model-ema",
                    "--model-ema-decay", "0.9")
    rows = _summary(folder)
    train = [float(r["train_loss"]) for r in rows]
    ev = [float(r["eval_loss"]) for r in rows]
    assert len(rows) == 8 and train[-1] < 0.5 * train[0] and ev[-1] < 0.6 * ev[0], (train, ev)
    assert {"eval_mse", "eval_vb", "eval_ema_loss"} <= set(rows[0])
    assert os.path.isfile(os.path.join(folder, "best_ema.safetensors"))
    from ttt_zoo import run_folder
    assert run_folder.read_record(folder)["class_names"] == [str(c) for c in range(10)]  # taken by name
    from ttt_zoo.cli import main
    out = tmp_path / "grid.png"
    assert main(["sample", "--checkpoint", folder, "--steps", "5", "--labels", "0", "1", "7", "--nrow", "3",
                 "--cfg", "2", "--out", str(out), "--device", "cpu"]) == 0
    from PIL import Image
    img = Image.open(out)
    # 3 pixel-space 8x8 samples, each enlarged 16x to sample's 128-px cell floor (nearest), padding 2
    assert img.format == "PNG" and img.size == (3 * 128 + 4 * 2, 128 + 2 * 2)


def test_exact_resume_dit5_with_ema(tiny_digits, tmp_path):
    from safetensors.torch import load_file
    common = ("--epochs", "2", "--model-ema", "--model-ema-decay", "0.9")
    full = _train(tiny_digits, tmp_path, "full", "dit5_s_2", *common, patch_size=1)  # 8x8 tokens >= the 5x5 window
    part = _train(tiny_digits, tmp_path, "part", "dit5_s_2", *common, "--stop-after", "1", patch_size=1)
    _train(tiny_digits, tmp_path, "part", "dit5_s_2", *common, "--resume", part, patch_size=1)
    for name in ("last.safetensors", "last_ema.safetensors"):
        a, b = load_file(os.path.join(full, name)), load_file(os.path.join(part, name))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-6, msg=f"{name}:{k}")
    state = torch.load(os.path.join(part, "last.state.pt"), weights_only=True)
    # 2 epochs x 5 batches
    assert state["task"] == {"step": 10} and state["ema"]["optimization_step"] == 10
    assert [r["eval_loss"] for r in _summary(full)] == [r["eval_loss"] for r in _summary(part)]


def test_linearize_from_dit_gives_new_params_lr_scale(tiny_digits, tmp_path):
    from safetensors.torch import save_file
    from ttt_zoo.linearize import LR_SCALES
    from ttt_zoo.train.args import parse_args
    from ttt_zoo.train.trainer import Trainer
    src = _tiny_dit("dit_s_2", num_classes=10)
    save_file(src.state_dict(), str(tmp_path / "dit.safetensors"))
    args, cls = parse_args(["--task", "diffusion", "--linearize-from", "dit_s_2", "--initial-checkpoint",
                            str(tmp_path / "dit.safetensors"), "--model-kwargs", "hidden_size=32", "depth=1",
                            "num_heads=2", "--img-size", "8", "--data-dir", tiny_digits, "-b", "8", "-j", "0",
                            "--opt", "adamw", "--lr", "1e-3", "--output", str(tmp_path), "--experiment", "lin",
                            "--device", "cpu"])
    trainer = Trainer(args, cls)
    trainer.setup()
    model, new = trainer.model, set(trainer.task.new_param_names)
    assert model.mixer == "dit5_mixed" and new
    names = {id(p): n for n, p in model.named_parameters()}
    for g in trainer.optimizer.param_groups:
        scale = LR_SCALES["dit"] if names[id(g["params"][0])] in new else 1.0
        assert g["lr_scale"] == scale and all((names[id(p)] in new) == (scale != 1.0) for p in g["params"])
    for k, v in src.state_dict().items():  # every source tensor inherited
        assert torch.equal(model.state_dict()[k], v)
    with pytest.raises(ValueError, match="needs the softmax DiT's weights"):
        args.initial_checkpoint = ""
        DiffusionTask(args, trainer.dist).build_model()


def test_vae_latents_train_and_sample(tiny_digits, tmp_path):
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        block_out_channels=(8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                        scaling_factor=0.5)
    vae.save_pretrained(str(tmp_path / "vae"))
    folder = _train(tiny_digits, tmp_path, "latent", "dit_s_2", "--epochs", "1", "--vae", str(tmp_path / "vae"),
                    patch_size=1)
    from safetensors.torch import load_file
    w = load_file(os.path.join(folder, "last.safetensors"))
    assert tuple(w["x_embedder.proj.weight"].shape[1:]) == (4, 1, 1) and w["pos_embed"].shape[1] == 16  # 4x4 latents
    # the task's latents are the VAE's posterior samples times its scaling factor
    task = DiffusionTask(_args(tiny_digits, "--vae", str(tmp_path / "vae")), DistInfo())
    x = torch.rand(2, 3, 8, 8) * 2 - 1
    z = task._encode(x, torch.Generator().manual_seed(5))
    ref = vae.encode(x).latent_dist.sample(generator=torch.Generator().manual_seed(5)) * 0.5
    torch.testing.assert_close(z, ref)
    from ttt_zoo.cli import main
    out = tmp_path / "grid.png"
    assert main(["sample", "--checkpoint", folder, "--steps", "3", "--labels", "1", "2", "--out", str(out),
                 "--device", "cpu"]) == 0  # the VAE comes from the run's args.yaml
    from PIL import Image
    assert Image.open(out).size == (2 * 128 + 3 * 2, 128 + 2 * 2)  # two 8x8 decoded samples in 128-px cells


def test_initial_checkpoint_for_latents_into_a_pixel_model_says_how(digits8, tmp_path):
    from safetensors.torch import save_file
    save_file(_tiny_dit("dit_s_2", in_chans=4, num_classes=10).state_dict(), str(tmp_path / "latent.safetensors"))
    task = DiffusionTask(_args(digits8, "--initial-checkpoint", str(tmp_path / "latent.safetensors")), DistInfo())
    with pytest.raises(ValueError, match=r"x_embedder.proj.weight.*built for 3 input channels.*--vae DIR"):
        task.build_model()


# ----- classes by name, as in classification -----

def _class_folder(root, split, names, per_class=2, size=8):
    from PIL import Image
    for i, name in enumerate(names):
        os.makedirs(os.path.join(root, split, name), exist_ok=True)
        for j in range(per_class):
            Image.new("RGB", (size, size), (30 * i, 10 * j, 0)).save(os.path.join(root, split, name, f"{j}.png"))


def test_classes_are_taken_by_name(tmp_path):
    # val/ holds only cat and fox: counted by position they would be labels 0 and 1; by name they are 0 and 2
    root = str(tmp_path / "animals")
    _class_folder(root, "train", ["cat", "dog", "fox"], per_class=8)
    _class_folder(root, "val", ["cat", "fox"])
    task = DiffusionTask(_args(root), DistInfo())
    assert task.build_model().num_classes == 3 and task.class_names == ["cat", "dog", "fox"]
    eval_loader = task.build_loaders()[1]
    labels = sorted(int(y) for _, ys in eval_loader for y in ys)
    assert labels == [0, 0, 2, 2]


@pytest.mark.parametrize("spoil,message", [
    (lambda root: os.makedirs(os.path.join(root, "train", "empty")), "empty/ (no image files)"),
    (lambda root: open(os.path.join(root, "train", "notes.txt"), "w").close(), "notes.txt (not a folder)"),
    (lambda root: _class_folder(root, "val", ["wolf"]), "class folder(s) wolf are not classes of"),
])
def test_folders_that_would_shift_the_labels_are_refused(tmp_path, spoil, message):
    root = str(tmp_path / "animals")
    _class_folder(root, "train", ["cat", "dog"])
    _class_folder(root, "val", ["cat"])
    spoil(root)
    with pytest.raises(ValueError, match=re.escape(message)):
        DiffusionTask(_args(root), DistInfo()).build_model()


def test_num_classes_below_the_data_is_refused(digits8):
    with pytest.raises(ValueError, match="--num-classes 4, but --data-dir .* has 10 classes"):
        DiffusionTask(_args(digits8, "--num-classes", "4"), DistInfo()).build_model()
