"""Model cards for converted ttt-zoo checkpoints: the authors' reported numbers, citations and the card template.

Every number on a card names its source: the paper / the authors' README (``PAPER_RESULTS``, copied from
``shared/spec/official_models.md`` and the papers; parameters and GFLOPs from ``assets/paper_stats.json``), or "measured by ttt-zoo" (parameters and GMACs computed by
:mod:`ttt_zoo.hub.convert` at conversion time); the card text is ``card_template.md``.  A checkpoint with no
entry here gets a card that says so.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["PAPER_RESULTS", "CITATIONS", "paper_results", "paper_counts", "load_paper_stats", "PAPER_STATS_FILE",
           "arxiv_ids", "render_card", "parse_card", "REQUIRED_CARD_KEYS"]

_VIT3 = "arXiv:2512.01643"
_VIT3_README = "LeapLabTHU/ViTTT README"

#: the papers' parameter and GFLOPs counts of each model: one table for cards, docs/models.md and `ttt-zoo list`
PAPER_STATS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                                "paper_stats.json")


@functools.lru_cache(maxsize=1)
def load_paper_stats() -> Dict[str, Any]:
    """``ttt_zoo/assets/paper_stats.json``: ``sources``, ``families`` (notes) and ``models``."""
    with open(PAPER_STATS_FILE) as f:
        return json.load(f)


def paper_counts(name: str) -> Optional[Dict[str, str]]:
    """``{"params": "6", "gflops": "1.2", "source": "ViT3 (arXiv 2512.01643) Table 7"}`` for ``model`` or
    ``model.tag`` (millions and GFLOPs as the paper prints them), or None when no paper counts that model."""
    table = load_paper_stats()
    row = table["models"].get(name.split(".")[0])
    if row is None:
        return None
    params, gflops, source = row
    return {"params": params, "gflops": gflops, "source": table["sources"][source]}


def _release(name: str, task: str, metrics: List[Tuple[str, str]], source: str) -> Dict[str, Any]:
    """A :data:`PAPER_RESULTS` entry whose parameters and GFLOPs are the paper's, from :func:`paper_counts`."""
    counts = paper_counts(name)
    return dict(task=task, params=f"{counts['params']}M", flops=f"{counts['gflops']}G", metrics=metrics,
                source=source)


# model name -> what the authors report for the released checkpoint of that model.
# Keys may carry a tag ('vit3_tiny.in1k'); lookups try 'model.tag' first, then 'model'.
_IN1K = "ImageNet-1k classification, 224x224"
_TOP1 = "ImageNet-1k val top-1 (%)"
PAPER_RESULTS: Dict[str, Dict[str, Any]] = {}
for _size, _top1 in (("tiny", "76.5"), ("small", "81.6"), ("base", "82.6")):
    PAPER_RESULTS[f"vit3_{_size}"] = _release(f"vit3_{_size}", _IN1K, [(_TOP1, _top1)],
                                              f"Table 7 of {_VIT3}; same numbers in the {_VIT3_README}")
for _size, _mesa, _plain in (("tiny", "84.0", "83.5"), ("small", "84.9", "84.4"), ("base", "85.5", "84.9")):
    PAPER_RESULTS[f"hvit3_{_size}"] = _release(
        f"hvit3_{_size}", _IN1K, [(f"{_TOP1}, trained with MESA + EMA", _mesa), (f"{_TOP1}, without MESA", _plain)],
        f"Table 5 of {_VIT3}; the released checkpoint is the MESA run ({_VIT3_README})")
# DiT3: the released checkpoints were retrained after the paper's weights were lost (dittt/README.md)
for _patch, _released, _paper in (("2", "39.44", "39.31"), ("4", "65.25", "65.25"), ("8", "120.82", "120.41")):
    PAPER_RESULTS[f"dit3_b_{_patch}"] = _release(
        f"dit3_b_{_patch}", "class-conditional ImageNet 256x256 generation",
        [("FID-50K, released checkpoint", _released), ("FID-50K, paper", _paper)],
        f"LeapLabTHU/ViTTT dittt/README.md (released, retrained weights); Table 10 of {_VIT3}")
# dense-prediction backbones (from the authors' mmdet / mmseg checkpoints); metrics of the whole detector
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


_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "card_template.md")
_TAGS = {"classifier": ["image-classification", "timm"], "diffusion": ["class-conditional-image-generation"],
         "backbone": ["image-feature-extraction", "object-detection", "image-segmentation"]}
_MAX_LISTED = 100  # class names listed on a card (all of them are in config.json's label_names)
_PIPELINES = {"classifier": "image-classification", "diffusion": "unconditional-image-generation",
              "backbone": "image-feature-extraction"}


def render_card(info: Dict[str, Any]) -> str:
    """README.md for the dict :func:`ttt_zoo.hub.convert_checkpoint` assembles (``huggingface_hub.ModelCard`` from
    ``card_template.md``).

    Keys: name, architecture, hub_id, library ('timm' or 'ttt-zoo'), kind ('classifier' | 'diffusion' | 'backbone'),
    license, datasets, paper_ids, paper_name, origin_url, description, input_size, mean, std, crop_pct,
    interpolation, num_classes, params, macs (float GMACs or None), macs_input (shape), source_file, source_sha256,
    source_url, released_url (the registered tag's url; None for a custom tag), registered_tag, other_arch,
    model_args, paper (the authors' results: only for their release, see ``convert._authors_release``), github,
    class_names (a run's classes in output order, or None).
    """
    from huggingface_hub import ModelCard, ModelCardData
    kind, library, ids = info.get("kind", "classifier"), info.get("library", "timm"), arxiv_ids(info.get("paper_ids"))
    tags = ["ttt-zoo", "test-time-training"] + _TAGS[kind]
    tags += (["timm"] if library == "timm" and "timm" not in tags else []) + [f"arxiv:{i}" for i in ids]
    data = ModelCardData(license=info.get("license") or "other", library_name=library, tags=tags,
                         datasets=list(info.get("datasets") or []) or None, pipeline_tag=_PIPELINES[kind])
    params = info.get("params")
    names = list(info.get("class_names") or [])
    class_list = ", ".join(f"`{n}`" if "`" not in n else f"`` {n} ``" for n in names[:_MAX_LISTED])
    class_list += f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    card = ModelCard.from_template(
        data, template_path=_TEMPLATE, **dict(info, kind=kind, library=library, arxiv=ids,
        repo_name=info["hub_id"].split("/")[-1], architecture=info["architecture"], class_list=class_list,
        description=info.get("description") or f"A {info['architecture']} model from ttt-zoo.",
        params_str=f"{params:,}" if isinstance(params, int) else "n/a",
        macs_shape="x".join(str(s) for s in info.get("macs_input") or []),
        input_size=tuple(info.get("input_size") or (3, 224, 224)), mean=tuple(info.get("mean") or ()),
        std=tuple(info.get("std") or ()), github=info.get("github", "ttt-zoo/ttt-zoo"),
        citations=[_citation(i, info.get("paper_name")) for i in ids] or [_TTT_ZOO_CITATION]))
    return str(card)


def parse_card(text: str) -> Tuple[Dict[str, Any], str]:
    """Split a card into (front-matter dict, markdown body) with ``huggingface_hub.ModelCard``; ValueError if
    malformed."""
    from huggingface_hub import ModelCard
    if not text.startswith("---\n"):
        raise ValueError("README.md has no YAML front matter: it must start with a '---' line.")
    if "\n---\n" not in text[3:]:
        raise ValueError("README.md front matter is not closed by a '---' line.")
    try:
        card = ModelCard(text, ignore_metadata_errors=False)
    except Exception as e:  # noqa: BLE001 - yaml / huggingface_hub errors
        raise ValueError(f"README.md front matter is not valid YAML metadata: {e}") from e
    return card.data.to_dict(), card.text
