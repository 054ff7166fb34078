"""Model cards for converted ttt-zoo checkpoints: the authors' reported numbers, citations and the card template.

Every number on a card names its source: the paper / the authors' README (``PAPER_RESULTS``, copied from
``shared/spec/official_models.md`` and the papers), or "measured by ttt-zoo" (parameters and GMACs computed by
:mod:`ttt_zoo.hub` at conversion time).  A checkpoint with no entry here gets a card that says so.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["PAPER_RESULTS", "CITATIONS", "paper_results", "render_card", "parse_card", "REQUIRED_CARD_KEYS"]

_VIT3 = "arXiv:2512.01643"
_VIT3_README = "LeapLabTHU/ViTTT README"

# model name -> what the authors report for the released checkpoint of that model.
# Keys may carry a tag ('vit3_tiny.in1k'); lookups try 'model.tag' first, then 'model'.
PAPER_RESULTS: Dict[str, Dict[str, Any]] = {
    "vit3_tiny": dict(task="ImageNet-1k classification, 224x224", params="6M", flops="1.2G",
                      metrics=[("ImageNet-1k val top-1 (%)", "76.5")],
                      source=f"Table 7 of {_VIT3}; same numbers in the {_VIT3_README}"),
    "vit3_small": dict(task="ImageNet-1k classification, 224x224", params="24M", flops="4.8G",
                       metrics=[("ImageNet-1k val top-1 (%)", "81.6")],
                       source=f"Table 7 of {_VIT3}; same numbers in the {_VIT3_README}"),
    "vit3_base": dict(task="ImageNet-1k classification, 224x224", params="90M", flops="18.0G",
                      metrics=[("ImageNet-1k val top-1 (%)", "82.6")],
                      source=f"Table 7 of {_VIT3}; same numbers in the {_VIT3_README}"),
    "hvit3_tiny": dict(task="ImageNet-1k classification, 224x224", params="29M", flops="4.9G",
                       metrics=[("ImageNet-1k val top-1 (%), trained with MESA + EMA", "84.0"),
                                ("ImageNet-1k val top-1 (%), without MESA", "83.5")],
                       source=f"Table 5 of {_VIT3}; the released checkpoint is the MESA run ({_VIT3_README})"),
    "hvit3_small": dict(task="ImageNet-1k classification, 224x224", params="54M", flops="8.8G",
                        metrics=[("ImageNet-1k val top-1 (%), trained with MESA + EMA", "84.9"),
                                 ("ImageNet-1k val top-1 (%), without MESA", "84.4")],
                        source=f"Table 5 of {_VIT3}; the released checkpoint is the MESA run ({_VIT3_README})"),
    "hvit3_base": dict(task="ImageNet-1k classification, 224x224", params="94M", flops="16.7G",
                       metrics=[("ImageNet-1k val top-1 (%), trained with MESA + EMA", "85.5"),
                                ("ImageNet-1k val top-1 (%), without MESA", "84.9")],
                       source=f"Table 5 of {_VIT3}; the released checkpoint is the MESA run ({_VIT3_README})"),
    # DiT3: the released checkpoints were retrained after the paper's weights were lost (dittt/README.md)
    "dit3_b_2": dict(task="class-conditional ImageNet 256x256 generation", params="134M", flops="23.35G",
                     metrics=[("FID-50K, released checkpoint", "39.44"), ("FID-50K, paper", "39.31")],
                     source=f"LeapLabTHU/ViTTT dittt/README.md (released, retrained weights); Table 10 of {_VIT3}"),
    "dit3_b_4": dict(task="class-conditional ImageNet 256x256 generation", params="134M", flops="5.88G",
                     metrics=[("FID-50K, released checkpoint", "65.25"), ("FID-50K, paper", "65.25")],
                     source=f"LeapLabTHU/ViTTT dittt/README.md (released, retrained weights); Table 10 of {_VIT3}"),
    "dit3_b_8": dict(task="class-conditional ImageNet 256x256 generation", params="135M", flops="1.51G",
                     metrics=[("FID-50K, released checkpoint", "120.82"), ("FID-50K, paper", "120.41")],
                     source=f"LeapLabTHU/ViTTT dittt/README.md (released, retrained weights); Table 10 of {_VIT3}"),
    # dense-prediction backbones (from the authors' mmdet / mmseg checkpoints); metrics of the whole detector
}
_DENSE = {  # size: (Mask R-CNN 1x box/mask AP, 3x box/mask AP, UperNet mIoU), README and Tables 8-9 of the paper
    "tiny": ("47.3 / 42.8", "48.9 / 44.0", "48.0"),
    "small": ("49.1 / 44.1", "50.5 / 45.0", "50.2"),
    "base": ("50.0 / 44.6", "51.0 / 45.3", "51.7"),
}
for _size, (_ap1, _ap3, _miou) in _DENSE.items():
    for _tag, _metric, _value, _task in (
            ("coco_mask_rcnn_1x", "COCO val box / mask AP, Mask R-CNN + FPN 1x", _ap1, "COCO detection"),
            ("coco_mask_rcnn_3x", "COCO val box / mask AP, Mask R-CNN + FPN 3x", _ap3, "COCO detection"),
            ("ade20k_upernet", "ADE20K val mIoU, UperNet 160k", _miou, "ADE20K segmentation")):
        PAPER_RESULTS[f"hvit3_backbone_{_size}.{_tag}"] = dict(
            task=_task, params=None, flops=None, metrics=[(_metric, _value)],
            source=f"{_VIT3_README}; Tables 8 and 9 of {_VIT3}")

CITATIONS: Dict[str, str] = {
    "2512.01643": """@inproceedings{han2026vit3,
  title     = {ViT$^3$: Unlocking Test-Time Training in Vision},
  author    = {Han, Dongchen and Li, Yining and Li, Tianyu and Cao, Zixuan and Wang, Ziming and Song, Jun and
               Cheng, Yu and Zheng, Bo and Huang, Gao},
  booktitle = {Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)},
  year      = {2026},
  eprint    = {2512.01643},
  archivePrefix = {arXiv}
}""",
}

_TTT_ZOO_CITATION = """@misc{ttt_zoo,
  title  = {ttt-zoo: Test-Time-Training vision backbones for timm},
  note   = {Software; weights converted from the authors' releases},
  year   = {2026}
}"""

#: front-matter keys every card must carry
REQUIRED_CARD_KEYS = ("license", "library_name", "tags")


def paper_results(name: str) -> Optional[Dict[str, Any]]:
    """The authors' reported numbers for ``model`` or ``model.tag``, or None."""
    if name in PAPER_RESULTS:
        return PAPER_RESULTS[name]
    return PAPER_RESULTS.get(name.split(".")[0])


def arxiv_ids(paper_ids: Any) -> List[str]:
    """'arXiv:2512.01643' / ('arXiv:a', 'arXiv:b') -> ['2512.01643', ...]"""
    if not paper_ids:
        return []
    ids = [paper_ids] if isinstance(paper_ids, str) else list(paper_ids)
    out = []
    for p in ids:
        for part in str(p).split(","):
            part = part.strip()
            if part.lower().startswith("arxiv:"):
                out.append(part.split(":", 1)[1].strip())
    return out


def _citation(arxiv: str, paper_name: Optional[str]) -> str:
    if arxiv in CITATIONS:
        return CITATIONS[arxiv]
    title = paper_name or f"arXiv:{arxiv}"
    return (f"@misc{{arxiv_{arxiv.replace('.', '_')},\n  title = {{{title}}},\n  note = {{authors: see "
            f"https://arxiv.org/abs/{arxiv}}},\n  eprint = {{{arxiv}}},\n  archivePrefix = {{arXiv}}\n}}")


def _yaml_list(key: str, values: List[str]) -> List[str]:
    if not values:
        return []
    return [f"{key}:"] + [f"- {json.dumps(v)}" for v in values]


def _fmt_int(n: Optional[int]) -> str:
    return f"{n:,}" if isinstance(n, int) else "n/a"


def render_card(info: Dict[str, Any]) -> str:
    """Render README.md from the dict :func:`ttt_zoo.hub.convert_checkpoint` assembles.

    Keys: name, architecture, hub_id, library ('timm' or 'ttt-zoo'), kind ('classifier' | 'diffusion' | 'backbone'),
    license, datasets, paper_ids, paper_name, origin_url, description, input_size, mean, std, crop_pct,
    interpolation, num_classes, params, macs (float GMACs or None), macs_input (shape), source_file, source_sha256,
    source_url, model_args, github.
    """
    name, arch, hub_id = info["name"], info["architecture"], info["hub_id"]
    library = info.get("library", "timm")
    kind = info.get("kind", "classifier")
    ids = arxiv_ids(info.get("paper_ids"))
    tags = ["ttt-zoo", "test-time-training"]
    tags += {"classifier": ["image-classification", "timm"], "diffusion": ["class-conditional-image-generation"],
             "backbone": ["image-feature-extraction", "object-detection", "image-segmentation"]}[kind]
    if library == "timm" and "timm" not in tags:
        tags.append("timm")
    tags += [f"arxiv:{i}" for i in ids]
    pipeline = {"classifier": "image-classification", "diffusion": "unconditional-image-generation",
                "backbone": "image-feature-extraction"}[kind]
    fm = ["---", f"license: {info.get('license') or 'other'}", f"library_name: {library}"]
    fm += _yaml_list("tags", tags)
    fm += _yaml_list("datasets", list(info.get("datasets") or []))
    fm += [f"pipeline_tag: {pipeline}", "---"]

    out = fm + ["", f"# Model card for {hub_id.split('/')[-1]}", ""]
    out += [info.get("description") or f"A {arch} model from ttt-zoo.", ""]
    src = info.get("source_file")
    if src:
        line = f"Weights converted by `ttt-zoo convert` from `{src}` (sha256 `{info.get('source_sha256', '')}`)"
        if info.get("source_url"):
            line += f", downloaded from the authors' release <{info['source_url']}>"
        elif info.get("released_url"):
            line += (f", a local file that the converter did not download itself: it is not verified to be the "
                     f"authors' release of this model (<{info['released_url']}>)")
        out += [line + ". Tensors are copied unchanged after the model file's `checkpoint_filter_fn` (which takes "
                       "the EMA weights where a checkpoint has them and drops unused buffers); nothing is re-trained.",
                ""]
    if info.get("other_arch"):
        out += [f"**These weights do not belong to the released `{name.split('.')[0]}`:** they were converted with "
                f"non-default architecture arguments ({', '.join(info['other_arch'])}), so no paper results and no "
                f"training dataset are claimed for them.", ""]

    out += ["## Model details", ""]
    out += [f"- **Architecture:** `{arch}` (ttt-zoo, registered with timm; pretrained cfg `{name}`)"
            if library == "timm"
            else f"- **Architecture:** `{arch}` (ttt-zoo; not a timm classifier, load it with `ttt_zoo.hub`)"]
    if info.get("model_args"):
        out += [f"- **Constructor arguments:** `{json.dumps(info['model_args'], sort_keys=True)}`"]
    out += [f"- **Parameters (measured by ttt-zoo):** {_fmt_int(info.get('params'))}"]
    if info.get("macs") is not None:
        shape = "x".join(str(s) for s in info.get("macs_input") or [])
        out += [f"- **GMACs (measured by ttt-zoo) at input {shape}:** {info['macs']:.4g}"]
    if kind == "classifier":
        c, h, w = info.get("input_size", (3, 224, 224))
        out += [f"- **Classes:** {info.get('num_classes')}",
                f"- **Preprocessing (pretrained_cfg):** {h}x{w}, mean {tuple(info.get('mean', ()))}, "
                f"std {tuple(info.get('std', ()))}, crop_pct {info.get('crop_pct')}, {info.get('interpolation')}"]
    if info.get("paper_name") or ids:
        links = ", ".join(f"[arXiv:{i}](https://arxiv.org/abs/{i})" for i in ids)
        out += [f"- **Paper:** {info.get('paper_name') or ''} {links}".rstrip()]
    if info.get("origin_url"):
        out += [f"- **Original code:** <{info['origin_url']}>"]
    if info.get("datasets"):
        out += [f"- **Dataset:** {', '.join(info['datasets'])}"]
    out += [""]

    out += ["## Numbers and where they come from", ""]
    out += ["| quantity | value | source |", "| --- | --- | --- |"]
    if info.get("params") is not None:
        out += [f"| parameters | {_fmt_int(info['params'])} | measured by ttt-zoo (sum of `numel()` over "
                f"`model.parameters()`) |"]
    if info.get("macs") is not None:
        shape = "x".join(str(s) for s in info.get("macs_input") or [])
        out += [f"| GMACs, input {shape} | {info['macs']:.4g} | measured by ttt-zoo: `torch.utils.flop_counter` "
                f"FLOPs / 2 (counts matmuls and convolutions, like fvcore's \"GFLOPs\") |"]
    pr = info.get("paper")
    if pr:
        if pr.get("params"):
            out += [f"| parameters | {pr['params']} | reported by the authors ({pr['source']}) |"]
        if pr.get("flops"):
            out += [f"| GFLOPs | {pr['flops']} | reported by the authors ({pr['source']}) |"]
        for metric, value in pr.get("metrics", []):
            out += [f"| {metric} | {value} | reported by the authors ({pr['source']}); not re-evaluated by ttt-zoo |"]
    out += [""]
    if not pr:
        out += ["No results reported by the authors apply to this checkpoint, so this card lists none.", ""]

    out += ["## Usage", ""]
    gh = info.get("github", "ttt-zoo/ttt-zoo")
    if library == "timm":
        out += ["With timm (`pip install ttt-zoo`; importing `ttt_zoo` registers the models):", "", "```python",
                "import timm, torch", "import ttt_zoo  # registers the TTT models with timm", "",
                f"model = timm.create_model('hf-hub:{hub_id}', pretrained=True).eval()"]
        if kind == "classifier":
            out += ["cfg = timm.data.resolve_data_config({}, model=model)",
                    "transform = timm.data.create_transform(**cfg)", "",
                    "from PIL import Image", "img = Image.open('image.jpg').convert('RGB')",
                    "with torch.no_grad():", "    probs = model(transform(img).unsqueeze(0)).softmax(-1)",
                    "top5_prob, top5_idx = probs.topk(5)", "",
                    "# feature maps at every stage / block:",
                    f"features = timm.create_model('hf-hub:{hub_id}', pretrained=True, features_only=True)"]
        out += ["```", ""]
        if not info.get("model_args"):
            out += [f"`timm.create_model('{name}', pretrained=True)` finds this repo through the model's "
                    f"`hf_hub_id` and falls back to the authors' URL if the repo is unreachable.", ""]
        out += ["With torch.hub:", "", "```python", "import torch",
                f"model = torch.hub.load('{gh}', 'create_model', 'hf-hub:{hub_id}', pretrained=True)", "```", ""]
    else:
        out += ["```python", "from ttt_zoo.hub import load_folder",
                f"backbone = load_folder('hf-hub:{hub_id}')  # or a local folder path",
                "feats = backbone(images)  # list of (B, C_i, H/s, W/s) maps, strides 4/8/16/32", "```", ""]
        out += ["With torch.hub:", "", "```python", "import torch",
                f"backbone = torch.hub.load('{gh}', 'load_folder', 'hf-hub:{hub_id}')", "```", ""]

    out += ["## Citation", "", "```bibtex"]
    cites = [_citation(i, info.get("paper_name")) for i in ids] or [_TTT_ZOO_CITATION]
    out += ["\n\n".join(cites), "```", ""]
    return "\n".join(out)


def parse_card(text: str) -> Tuple[Dict[str, Any], str]:
    """Split a card into (front-matter dict, markdown body); raise ValueError with the reason if malformed."""
    import yaml
    if not text.startswith("---\n"):
        raise ValueError("README.md has no YAML front matter: it must start with a '---' line.")
    end = text.find("\n---\n", 4)
    if end < 0:
        raise ValueError("README.md front matter is not closed by a '---' line.")
    try:
        meta = yaml.safe_load(text[4:end])
    except yaml.YAMLError as e:
        raise ValueError(f"README.md front matter is not valid YAML: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError("README.md front matter must be a YAML mapping (key: value lines).")
    return meta, text[end + 5:]
