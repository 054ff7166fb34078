"""ttt_zoo.train.recipes: every shipped recipe loads, names a paper section, and every key is a real
``ttt-zoo train`` flag (of the recipe's --task) with a value the flag's type accepts."""

import argparse
import os

import pytest

from ttt_zoo.train.recipes import RECIPE_DIR, list_recipes, load_recipe, resolve_config

RECIPES = list_recipes()


def test_recipes_cover_the_papers():
    for name in ("vit3_tiny", "vit3_small", "vit3_base", "hvit3_tiny", "visionttt_tiny", "visionttt_h_tiny",
                 "t5_tiny_ft", "dit3_s_2", "dit5_xl_2_ft"):
        assert name in RECIPES


def _parser_for(cfg):
    from ttt_zoo.train.args import build_parser
    from ttt_zoo.train.task import get_task_class
    try:
        task_cls = get_task_class(cfg.get("task", "classification"))
    except ValueError as e:  # a task module that this checkout does not have yet
        pytest.skip(str(e))
    return build_parser(task_cls)


def _check_value(action: argparse.Action, value):
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        assert isinstance(value, bool), f"{action.dest}: a switch takes true/false, got {value!r}"
        return
    from ttt_zoo.flags import ModelKwargs
    if isinstance(action, ModelKwargs):  # --model-kwargs k=v ... (timm's ParseKwargs, range-checked): a mapping in YAML
        assert isinstance(value, dict) and all(isinstance(k, str) for k in value), f"{action.dest}: {value!r}"
        return
    if action.nargs not in (None, "?"):
        assert isinstance(value, list), f"{action.dest} takes a list, got {value!r}"
        if isinstance(action.nargs, int):
            assert len(value) == action.nargs, action.dest
        items = value
    else:
        assert not isinstance(value, (list, dict)), f"{action.dest} takes one value, got {value!r}"
        items = [value]
    for v in items:
        if action.type is not None:
            converted = action.type(str(v))  # what the command line would have parsed
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                assert converted == v, f"{action.dest}: {v!r} parses as {converted!r}"
        if action.choices is not None:
            assert v in action.choices, f"{action.dest}: {v!r} not in {action.choices}"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_keys_are_train_flags(name):
    cfg = load_recipe(name)
    assert cfg and ("model" in cfg or "linearize_from" in cfg)
    text = open(os.path.join(RECIPE_DIR, name + ".yaml")).read()
    if name.startswith("digits_"):  # the README's digits table, not a paper: it names where its number is
        assert "README table" in text and "experiments/results/digits_models.md" in text
    else:
        assert "paper" in text and ("Table" in text or "Sec." in text)  # where the numbers come from
    parser = _parser_for(cfg)
    actions = {a.dest: a for a in parser._actions}
    for key, value in cfg.items():
        assert key in actions, f"{name}: {key!r} is not a ttt-zoo train flag"
        _check_value(actions[key], value)
    parser.set_defaults(**cfg)
    args = parser.parse_args(["--data-dir", "unused"])
    for key, value in cfg.items():
        assert getattr(args, key) == value


def _total_batch_lr(cfg, processes):
    from ttt_zoo.train.trainer import _resolve_lr
    ns = argparse.Namespace(lr=cfg.get("lr"), batch_size=cfg["batch_size"], grad_accum_steps=1,
                            lr_base=cfg["lr_base"], lr_base_size=cfg["lr_base_size"],
                            lr_base_scale=cfg["lr_base_scale"], opt=cfg["opt"])
    _resolve_lr(ns, processes)
    return cfg["batch_size"] * processes, ns.lr


@pytest.mark.parametrize("name", ["vit3_tiny", "vit3_small", "vit3_base", "hvit3_tiny", "hvit3_small", "hvit3_base"])
def test_vit3_recipes_match_the_paper(name):
    cfg = load_recipe(name)
    # ViT3 paper, Sec. 5.1: total batch 4096, initial lr 4e-3, 300 epochs, 20 warm-up epochs, weight decay 0.05
    assert _total_batch_lr(cfg, 32) == (4096, pytest.approx(4e-3))
    assert (cfg["epochs"], cfg["warmup_epochs"], cfg["weight_decay"], cfg["opt"]) == (300, 20, 0.05, "adamw")
    assert cfg["sched"] == "cosine" and cfg["mixup"] > 0 and cfg["cutmix"] > 0 and cfg["reprob"] > 0


@pytest.mark.parametrize("name", ["t5_tiny_ft", "t5_small_ft"])
def test_t5_recipes_match_the_paper(name):
    cfg = load_recipe(name)
    # T5 paper, Appendix A, Table 8
    expect = dict(opt="adamw", lr_base=2e-5, weight_decay=1e-8, epochs=30, sched="cosine", warmup_epochs=5,
                  warmup_lr=2e-8, min_lr=2e-7, drop_path=0.0, ttt_lr_scale=20.0)
    assert {k: cfg[k] for k in expect} == expect
    assert cfg["linearize_from"].startswith("deit_") and "model" not in cfg


def test_resolve_config(tmp_path):
    assert resolve_config("vit3_tiny") == load_recipe("vit3_tiny")
    assert resolve_config("vit3_tiny.yaml") == load_recipe("vit3_tiny")
    own = tmp_path / "mine.yaml"
    own.write_text("model: vit3_tiny\nbatch_size: 8\n")
    assert resolve_config(str(own)) == {"model": "vit3_tiny", "batch_size": 8}
    with pytest.raises(ValueError, match="neither a YAML file nor a recipe name.*vit3_tiny"):
        resolve_config("no_such_recipe")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        resolve_config(str(bad))
    with pytest.raises(ValueError, match="no recipe named"):
        load_recipe("nope")


def test_train_config_takes_a_recipe_name():
    """`ttt-zoo train -c vit3_tiny` reads the shipped recipe; the command line still wins; a bad name says which exist."""
    from ttt_zoo.train.args import parse_args
    from ttt_zoo.train.recipes import load_recipe
    recipe = load_recipe("vit3_tiny")
    args, _ = parse_args(["-c", "vit3_tiny", "--data-dir", "x", "--epochs", "3"])
    assert args.model == recipe["model"] and args.batch_size == recipe["batch_size"] and args.epochs == 3
    with pytest.raises(SystemExit, match="recipes: .*vit3_tiny"):
        parse_args(["-c", "no_such_recipe"])


# ----- every shipped recipe runs: a few optimizer steps of `ttt-zoo train -c RECIPE` on real images -----
# Only the size is overridden: image size, class count, batch, epochs (one), the model's width (--model-kwargs)
# and, for the fine-tuning recipes, a tiny source checkpoint (--initial-checkpoint, as the recipes say to add).
# The recipe's own optimizer, scheduler, augmentation (rand-m9-mstd0.5-inc1, random erasing), mixup / cutmix,
# label smoothing, clipping, drop path, EMA and AMP stay on.  AMP runs in bfloat16 here: float16 autocast on the
# CPU pays a one-off cost per new depthwise-conv shape (~0.1-1 s each; H-ViT3-T's 2 steps took over a minute);
# float16 + GradScaler is covered by tests/test_train.py's exact-resume test.

#: tiny widths per model family (longest matching prefix of the recipe's model / linearize_from)
TINY_KWARGS = {
    "vit3_": dict(depth=1, embed_dim=16, num_heads=2, patch_size=4),
    "hvit3_": dict(embed_dim=(16, 16, 16, 16), depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1)),
    "visionttt_h_": dict(embed_dim=8, depths=(1, 1, 1, 1), head_dim=(8, 8, 8, 8)),
    "visionttt_": dict(depth=1, embed_dim=16, head_dim=8, patch_size=4),
    "deit_": dict(depth=1, embed_dim=16, num_heads=2, patch_size=4),
    "dit": dict(depth=1, hidden_size=16, num_heads=2),
}
RUN_IMG, RUN_DIT_IMG, RUN_BATCH, RUN_PER_CLASS = 32, 8, 4, 1  # 10 train images: 2 optimizer steps
OVERRIDDEN = ("img_size", "num_classes", "batch_size", "epochs", "model_kwargs")  # model_kwargs: the tiny widths


def _tiny_kwargs(name):
    keys = sorted((k for k in TINY_KWARGS if name.startswith(k)), key=len)
    assert keys, f"no tiny model width for {name!r}: add its family to TINY_KWARGS"
    return TINY_KWARGS[keys[-1]]


def _kw_flags(kw):
    return ["--model-kwargs", *(f"{k}={v!r}".replace(" ", "") for k, v in kw.items())]


@pytest.fixture(scope="module")
def digits32(tmp_path_factory):
    from _train_data import make_tiny_digits
    return make_tiny_digits(str(tmp_path_factory.mktemp("digits32")), train_per_class=RUN_PER_CLASS,
                            val_per_class=1, img_size=RUN_IMG)


def _source_checkpoint(cfg, kw, folder):
    """A tiny randomly initialised softmax source for --linearize-from (seeded), saved as safetensors."""
    import timm
    import torch
    from safetensors.torch import save_file
    torch.manual_seed(0)
    size = dict(input_size=RUN_DIT_IMG, in_chans=3) if cfg.get("task") == "diffusion" else dict(img_size=RUN_IMG)
    src = timm.create_model(cfg["linearize_from"], num_classes=10, **size, **kw)
    path = os.path.join(folder, "source.safetensors")
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_a_few_steps(name, digits32, tmp_path):
    import csv
    import math

    import torch
    import yaml

    from ttt_zoo.train import run_state as ckpt
    from ttt_zoo.train.trainer import main
    cfg = load_recipe(name)
    diffusion = cfg.get("task") == "diffusion"
    kw = _tiny_kwargs(cfg.get("model") or cfg["linearize_from"])
    argv = ["-c", name, "--data-dir", digits32, "--val-split", "val", "--img-size",
            str(RUN_DIT_IMG if diffusion else RUN_IMG), "--num-classes", "10", "-b", str(RUN_BATCH), "--epochs", "1",
            *_kw_flags(kw), "--workers", "0", "--device", "cpu", "--seed", "0", "--log-interval", "100",
            "--output", str(tmp_path), "--experiment", "run"]
    if cfg.get("linearize_from"):
        argv += ["--initial-checkpoint", _source_checkpoint(cfg, kw, str(tmp_path))]
    if cfg.get("amp"):
        argv += ["--amp-dtype", "bfloat16"]
    assert main(argv) == 0
    folder = tmp_path / "run"
    # the run used the recipe as written, except the overridden sizes
    used = yaml.safe_load((folder / "args.yaml").read_text())
    for key, value in cfg.items():
        if key not in OVERRIDDEN:
            assert used[key] == value, key
    assert used["model_kwargs"] == yaml.safe_load(yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v
                                                                   for k, v in kw.items()}))
    rows = list(csv.DictReader(open(folder / "summary.csv")))
    assert len(rows) == 1 and math.isfinite(float(rows[0]["train_loss"]))
    metric = "eval_loss" if diffusion else "eval_top1"
    assert math.isfinite(float(rows[0][metric]))
    if cfg.get("model_ema"):
        assert (folder / "last_ema.safetensors").exists() and math.isfinite(float(rows[0][metric.replace(
            "eval_", "eval_ema_")]))
    state = ckpt.load_state(ckpt.state_path(str(folder), "last"))
    steps = RUN_PER_CLASS * 10 // RUN_BATCH
    assert state["num_updates"] == steps
    opt = state["optimizer"]["state"]
    assert opt and all(int(s["step"]) == steps for s in opt.values() if "step" in s)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


@pytest.mark.slow
def test_zero_bit_posterize_inside_ttt_zoo_train(digits32, tmp_path):
    """`ttt-zoo train` with a policy that posterizes every image at magnitude 10 (0 bits): it trains (before the
    fix Pillow raised on the first batch)."""
    from ttt_zoo.train.trainer import main
    argv = ["-c", "vit3_tiny", "--aa", "rand-m10-n30-p1.0-inc1", "--data-dir", digits32, "--val-split", "",
            "--img-size", str(RUN_IMG), "--num-classes", "10", "-b", str(RUN_BATCH), "--epochs", "1",
            *_kw_flags(TINY_KWARGS["vit3_"]), "--workers", "0", "--device", "cpu", "--output", str(tmp_path),
            "--experiment", "p", "--log-interval", "100"]
    assert main(argv) == 0


def test_digits_recipes_are_the_readme_table():
    # one place for the digits settings: every small model of the demo / README table / experiments/digits_runs.py is a
    # shipped recipe, the README shows it, and the number each recipe quotes is the table's row
    import re
    from ttt_zoo.train.digits import SMALL_MODELS
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    table = open(os.path.join(root, "experiments", "results", "digits_models.md")).read()
    # the command is in a shell block that tests/test_docs.py runs (not only named in the prose), and the prose under
    # the table names that same command as the source of its ViT3 row
    from test_docs import parse_blocks
    command = "ttt-zoo train -c digits_vit3 --data-dir data/digits --output runs --experiment vit3"
    assert command in [c.text for b in parse_blocks("README.md") for c in b.commands], \
        f"README.md runs no `{command}` in a shell block"
    assert f"the ViT3 row is the `{command}` of the block above" in " ".join(readme.split())
    for key, (recipe, desc) in SMALL_MODELS.items():
        assert recipe in RECIPES, key
        quoted = re.search(r"([0-9.]+) top-1", open(os.path.join(RECIPE_DIR, recipe + ".yaml")).read()).group(1)
        assert f"| {desc} | 12 | {quoted} |" in table, (recipe, quoted)
        cfg = load_recipe(recipe)
        assert (cfg["img_size"], cfg["num_classes"], cfg["epochs"], cfg["seed"]) == (32, 10, 12, 0), recipe
