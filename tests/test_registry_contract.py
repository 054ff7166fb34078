"""The registry-wide contract (issue 30, item 1): every model timm lists for the zoo's modules keeps every promise
that applies to its kind, so a new model cannot skip one.

Per model (cheap): builds and runs at its ``pretrained_cfg`` input size and at a non-square size its strides allow
(small widths: the spatial sizes are the default config's), its ``pretrained_cfg`` is complete, ``ttt-zoo list``
has its row and a fresh measurement of the full default config (meta device) equals it, unknown keyword arguments
(top level and ``mixer_kwargs``) raise TypeError naming the key and the accepted ones, and every mixer's
linear-attention form rebuilds it to 1e-10 in float64 (or the mixer declares it has none, in one line).

Per code path (expensive): models that differ only in size share a code path (same class, same name apart from
the size word); its smallest member, at small widths, runs timm's API, the attention map in every mode the CLI
offers, ONNX export, the Hub round trip and ``pretrained=True`` with other ``in_chans`` / ``num_classes``.  A model
whose code path is new gets its own run.  ``experiments/registry_contract_table.py`` prints the models x promises
table from this file's results.

Every import of the zoo's parts happens inside a test, so an older tree fails cells, not the collection.
"""
import json
import os
import re

import pytest
import timm
import torch

import ttt_zoo

MODULES = getattr(ttt_zoo.models, "MODEL_MODULES", ("dit", "dit3", "dit5", "hvit3", "t5", "visionttt", "vit3"))
NAMES = sorted({n for module in MODULES for n in timm.list_models(module=module)})
SIZE_WORDS = ("tiny", "small", "base", "large", "huge", "s", "b", "l", "xl")
TOL = 1e-10


def is_diffusion(name):
    return name.startswith("dit")


def small_kwargs(name):
    """Small widths, one block per stage: the same code and the same spatial sizes as the default config."""
    if is_diffusion(name):
        return dict(hidden_size=32, depth=1, num_heads=2)
    if name.startswith("hvit3"):
        return dict(embed_dim=(16, 16, 32, 32), depths=(1, 1, 1, 1), num_heads=(2, 2, 2, 2))
    if name.startswith("visionttt_h"):
        return dict(embed_dim=16, depths=(1, 1, 1, 1), head_dim=(8, 8, 8, 8))
    if name.startswith("visionttt"):
        return dict(embed_dim=32, depth=1, head_dim=16)
    return dict(embed_dim=32, depth=1, num_heads=2)  # vit3, t5, t5_plus (a new family fails here until added)


def onnx_kwargs(name):
    """``small_kwargs`` with two stages for the hierarchical families (stem, blocks, a merge, blocks, head: every
    code path, as ``ttt_zoo.bench.compile`` keeps them): the exporter traces each stage, so four took twice as long
    (hvit3: 85 vs 42 s)."""
    if name.startswith("hvit3"):
        return dict(embed_dim=(16, 32), depths=(1, 1), num_heads=(2, 2))
    if name.startswith("visionttt_h"):
        return dict(embed_dim=16, depths=(1, 1), head_dim=(8, 8))
    return small_kwargs(name)


def code_path(name, cls):
    """Models that differ only in size share this key: their class and the name with its size word replaced
    (vit3_tiny_v1 and vit3_base_v1 -> ViT3:vit3_*_v1; dit5_s_8 -> DiT:dit5_*_8)."""
    return cls + ":" + "_".join("*" if w in SIZE_WORDS else w for w in name.split("_"))


def _groups():
    """{code path: (its smallest member, its members)}, from one meta-device build of every model."""
    groups = {}
    for name in NAMES:
        with torch.device("meta"):
            model = timm.create_model(name)
        size = sum(p.numel() for p in model.parameters())
        groups.setdefault(code_path(name, type(model).__name__), []).append((size, name))
    return {key: (min(members)[1], [n for _, n in members]) for key, members in groups.items()}


GROUPS = _groups()
REPRESENTATIVE = {m: rep for rep, members in GROUPS.values() for m in members}
REPS = sorted(rep for rep, _ in GROUPS.values())
CLASSIFIER_REPS = [n for n in REPS if not is_diffusion(n)]


def representative(promise, name):
    """The model whose run covers ``name``'s cell of a per-code-path promise."""
    return REPRESENTATIVE[name]


NOT_APPLICABLE = {"timm_api": "diffusion", "attention_map": "diffusion (the CLI takes image models)",
                  "onnx": "diffusion (classifiers only)", "pretrained_in_chans": "diffusion (classifiers only)"}


def build_small(name, **extra):
    torch.manual_seed(0)
    return timm.create_model(name, **small_kwargs(name), **extra).eval()


def example_inputs(model, name, hw):
    torch.manual_seed(1)
    c = model.pretrained_cfg["input_size"][0]
    x = torch.randn(1, c, *hw)
    return (x, torch.tensor([3]), torch.tensor([1])) if is_diffusion(name) else (x,)


def stride(model, name):
    return model.patch_size if is_diffusion(name) else __import__("ttt_zoo.export").export.input_multiple(model)


def small_image_size(model, name):
    """A non-square (H, W) just above the model's smallest input, in multiples of its stride."""
    s = stride(model, name)
    h = max(2 * s, -(-getattr(model, "min_size", 1) // s) * s)
    return h, h + s


def rel_err(a, b):
    return float((torch.as_tensor(a) - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ per model, cheap
@pytest.mark.parametrize("name", NAMES)
def test_runs_at_default_input(name):
    model = build_small(name)
    hw = tuple(model.pretrained_cfg["input_size"][1:])
    with torch.no_grad():
        out = model(*example_inputs(model, name, hw))
    want = (1, model.pretrained_cfg["input_size"][0] * (1 + getattr(model, "learn_sigma", False)), *hw) \
        if is_diffusion(name) else (1, model.num_classes)
    assert tuple(out.shape) == want and torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
def test_runs_non_square(name):
    model = build_small(name)
    s = stride(model, name)
    hw = (6 * s, 9 * s)  # 6 x 9 tokens (2 x 3 at the 32-stride stage of the hierarchical models: 3 x 4.5 -> 7 x 10)
    if s >= 32:
        hw = (2 * s, 3 * s)
    with torch.no_grad():
        out = model(*example_inputs(model, name, hw))
    assert torch.isfinite(out).all()
    if is_diffusion(name):
        assert tuple(out.shape[2:]) == hw


REQUIRED_CFG = ("architecture", "input_size", "mean", "std", "crop_pct", "num_classes", "first_conv", "license",
                "origin_url", "paper_name")
REQUIRED_CLASSIFIER_CFG = ("interpolation", "classifier", "pool_size")


@pytest.mark.parametrize("name", NAMES)
def test_pretrained_cfg_complete(name):
    with torch.device("meta"):
        model = timm.create_model(name)
    cfg = model.pretrained_cfg
    keys = REQUIRED_CFG + (() if is_diffusion(name) else REQUIRED_CLASSIFIER_CFG)
    missing = [k for k in keys if cfg.get(k) in (None, "", ())]
    assert not missing, f"{name}: pretrained_cfg lacks {missing}"
    assert cfg["architecture"] == name
    c = cfg["input_size"][0]
    assert len(cfg["mean"]) == len(cfg["std"]) == c
    convs = (cfg["first_conv"],) if isinstance(cfg["first_conv"], str) else tuple(cfg["first_conv"])
    for conv in convs:  # what timm adapts for another in_chans
        module = model.get_submodule(conv)
        assert isinstance(module, torch.nn.Conv2d) and module.in_channels == c, (conv, module)
    if not is_diffusion(name):
        assert model.get_submodule(cfg["classifier"]) is model.get_classifier()
        assert cfg["num_classes"] == model.num_classes


@pytest.mark.parametrize("name", NAMES)
def test_list_measures_it(name):
    """``ttt-zoo list`` has its row (the generated table) and a fresh measurement of the full default config, at
    the default input size, equals it (parameter count, input, GFLOPs)."""
    from ttt_zoo.cli import list as list_cmd
    table = list_cmd.load_stats_table()
    assert name in table, f"{name}: no row in {list_cmd.STATS_FILE} (python tools/gen_model_stats.py)"
    row = table[name]
    assert "could not be measured" not in json.dumps(row)
    fresh = list_cmd.model_stats(name, list_cmd.DEFAULT_IMG_SIZE)
    assert row["params"] == fresh["params"] and row["input"] == fresh["input"]
    assert row["gflops"] == pytest.approx(fresh["gflops"], rel=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_kwargs_raise(name):
    def build(**kw):
        with torch.device("meta"):
            return timm.create_model(name, **kw)
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['depthh'\]; accepted: \[.*'depth") as e:
        build(depthh=2)
    assert "mixer_kwargs" in str(e.value)  # the accepted ones are listed
    with pytest.raises(TypeError, match=r"mixer_kwargs\): unknown keyword argument\(s\) \['inner_stepss'\]; "
                                        r"accepted: \[.*'num_heads'") as e:
        build(mixer_kwargs={"inner_stepss": 4})
    assert ("'inner_steps'" in str(e.value)) == (not name.startswith("dit_"))  # softmax DiT has no inner steps


def _mixer_calls(model, run):
    from ttt_zoo.layers import TTTMixer
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0], tuple(args[1]), out)))
             for m in model.modules() if isinstance(m, TTTMixer)]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    assert seen, "no TTT mixer ran"
    return seen


LA_ERRORS = {}  # model -> worst relative error, or the declared reason (for the table)


@pytest.mark.parametrize("name", NAMES)
def test_linear_attention_form(name):
    """Each mixer's own form rebuilds its output to 1e-10 in float64, or the mixer declares it has none and
    ``ttt_zoo.linear_attention`` raises one line saying so."""
    from ttt_zoo.layers import TTTMixer
    model = build_small(name).double()
    with torch.no_grad():  # off the near-zero init, so that every term of a form matters
        for m in model.modules():
            if isinstance(m, TTTMixer):
                for p in m.parameters():
                    p.add_(0.1 * torch.randn_like(p))
    s = stride(model, name)
    args = [a.double() if a.is_floating_point() else a for a in example_inputs(model, name, (8 * s, 8 * s))]
    seen = _mixer_calls(model, lambda: model(*args) if is_diffusion(name) else model.forward_features(*args))
    worst, declared = 0.0, set()
    for mod, x, fs, out in seen:
        try:
            form = ttt_zoo.linear_attention(mod, x, fs)
        except NotImplementedError as e:
            msg = str(e)
            assert "\n" not in msg and f"{type(mod).__name__} has no exact linear-attention form" in msg, msg
            declared.add(msg)
            continue
        with torch.no_grad():
            worst = max(worst, float((form.output() - out).abs().max() / out.abs().max().clamp_min(1.0)))
    assert worst <= TOL, f"{name}: {worst:.2e}"
    LA_ERRORS[name] = "; ".join(sorted(declared)) if declared else worst


# ------------------------------------------------------------------- per code path, on its smallest member
@pytest.mark.parametrize("name", CLASSIFIER_REPS)
def test_timm_api(name):
    model = build_small(name)
    hw = small_image_size(model, name)
    x = torch.randn(2, 3, *hw)
    with torch.no_grad():
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        assert pre.shape == (2, model.num_features)
        torch.testing.assert_close(model.forward_head(feats), model(x))
        model.reset_classifier(5)
        assert model(x).shape == (2, 5) and model.get_classifier().out_features == 5
        model.reset_classifier(0)
        assert model(x).shape == (2, model.num_features)
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, feats)
        assert len(inter) == len(model.feature_info)
        every = tuple(range(len(model.feature_info)))  # one per block / stage (plain models default to the last 3)
        fm = timm.create_model(name, features_only=True, out_indices=every, **small_kwargs(name)).eval()
        outs = fm(x)
    assert [o.shape[1] for o in outs] == fm.feature_info.channels()
    assert [hw[0] // o.shape[2] for o in outs] == fm.feature_info.reduction()


@pytest.mark.parametrize("name", CLASSIFIER_REPS)
def test_attention_map_modes(name):
    """Every mode ``ttt-zoo attention-map`` offers (--map implicit with --via mixer/form and --reduce trace/probe;
    --map explicit) on the first and last mixer."""
    from ttt_zoo.analysis import image_attention_maps
    model = build_small(name)
    h, w = small_image_size(model, name)
    img = torch.randn(1, 3, h, w)
    modes = [("implicit", via, reduce) for via in ("mixer", "form") for reduce in ("trace", "probe")]
    for kind, via, reduce in modes + [("explicit", "mixer", "trace")]:
        maps = image_attention_maps(model, img, (h // 2, w // 3), [0, -1], kind, via, reduce=reduce)
        assert len(maps) == 2, (kind, via, reduce)
        for m in maps:
            assert m["map"].shape[1:] == tuple(m["feat_size"]) and torch.isfinite(m["map"]).all(), (kind, via)


@pytest.mark.parametrize("name", CLASSIFIER_REPS)
def test_onnx_export(name, tmp_path):
    """ONNX (torch's dynamo exporter): onnxruntime against PyTorch within 1e-4 at the traced size and at another,
    non-square size and batch; every code path, variants included: the family's export passed while the V1/V3/V6
    op's graphs ran at the traced size only (it int()ed the map size) and visionttt_*_la's at none (its chunk count
    -(-n // c) became ONNX's truncating Div: 0 chunks)."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from ttt_zoo.export import export_onnx
    torch.manual_seed(0)
    model = timm.create_model(name, **onnx_kwargs(name)).eval()
    path = str(tmp_path / f"{name}.onnx")
    h, w = small_image_size(model, name)
    mult, _ = export_onnx(model, path, (h, h))
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for b, hw in ((1, (h, h)), (3, (h + mult, w + mult))):
        x = torch.randn(b, 3, *hw)
        with torch.no_grad():
            ref = model(x)
        out = sess.run(None, {"image": x.numpy()})[0]
        assert out.shape == tuple(ref.shape) and rel_err(out, ref) < 1e-4, (b, hw, rel_err(out, ref))


@pytest.mark.parametrize("name", REPS)
def test_hub_round_trip(name, tmp_path):
    """A checkpoint written as a hub folder by our converter loads back through timm's ``local-dir:`` and our
    ``load_folder`` with the same outputs."""
    from ttt_zoo import hub
    model = build_small(name)
    with torch.no_grad():  # every tensor unlike a fresh init
        for v in model.state_dict().values():
            if v.is_floating_point():
                v.add_(torch.rand_like(v), alpha=0.01)
    src = str(tmp_path / "src.pth")
    torch.save({"model": model.state_dict()}, src)
    folder = str(tmp_path / "hub")
    hub.convert_checkpoint(src, name, folder, model_args=small_kwargs(name), flops=False)
    args = example_inputs(model, name, tuple(model.pretrained_cfg["input_size"][1:]))
    with torch.no_grad():
        ref = model(*args)
        for loaded in (timm.create_model(f"local-dir:{folder}", pretrained=True), hub.load_folder(folder)):
            torch.testing.assert_close(loaded.eval()(*args), ref, rtol=0, atol=0)


@pytest.fixture(scope="module")
def saved_sources(tmp_path_factory):
    from test_pretrained_in_chans import write_source
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = write_source(name, small_kwargs(name), tmp_path_factory.mktemp(name))
        return cache[name]
    return get


@pytest.mark.parametrize("in_chans,num_classes", [(1, 5), (4, 0), (3, 1000)])  # the last keeps the head
@pytest.mark.parametrize("name", CLASSIFIER_REPS)
def test_pretrained_in_chans(name, in_chans, num_classes, saved_sources):
    """``pretrained=True`` from locally written weights with another ``in_chans`` and ``num_classes``, as timm's
    ``test_model_load_pretrained`` does."""
    from test_pretrained_in_chans import check_pretrained_load
    path, src = saved_sources(name)
    check_pretrained_load(name, small_kwargs(name), path, src, in_chans, num_classes)


PROMISES = {  # column -> test function (the table's order)
    "default_input": "test_runs_at_default_input", "non_square": "test_runs_non_square",
    "pretrained_cfg": "test_pretrained_cfg_complete", "list": "test_list_measures_it",
    "unknown_kwargs": "test_unknown_kwargs_raise", "linear_attention": "test_linear_attention_form",
    "timm_api": "test_timm_api", "attention_map": "test_attention_map_modes", "onnx": "test_onnx_export",
    "hub": "test_hub_round_trip", "pretrained_in_chans": "test_pretrained_in_chans",
}
PER_CODE_PATH = ("timm_api", "attention_map", "onnx", "hub", "pretrained_in_chans")


def test_every_registered_model_is_in_the_contract():
    assert set(NAMES) == set(ttt_zoo.list_zoo_models(include_diffusion=True))
    assert set(REPRESENTATIVE) == set(NAMES) and all(re.fullmatch(r"[a-z0-9_]+", n) for n in NAMES)
