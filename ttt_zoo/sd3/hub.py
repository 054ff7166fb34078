"""SD3.5-T5 Hub folders: convert a local SD3 / SD3.5 folder (a whole pipeline or its transformer) into SD3.5-T5.

Layout, in diffusers' own conventions (safetensors only):

- a pipeline folder -> the same pipeline folder: every other component copied unchanged, ``transformer/`` replaced
  by ``SD3T5Transformer2DModel`` (``config.json`` with the ``ttt_*`` fields + ``diffusion_pytorch_model.safetensors``),
  ``model_index.json``'s transformer entry set to ``["ttt_zoo.sd3.transformer", "SD3T5Transformer2DModel"]``;
- a transformer folder -> a transformer folder;
- plus a ``README.md`` model card at the top (``card_template.md``: the layout, what is new, the authors' numbers with
  their source).

The output is written beside ``out`` and swapped in only when complete (an existing folder is never lost).
Command line: ``ttt-zoo convert SRC --sd3 --out OUT [--joint-layers ...]`` (see ``ttt-zoo convert --help``).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, Optional

from ttt_zoo.fileio import sha256_file

from .transformer import SOFTMAX_CLASS, TTT_CLASS, SD3LayoutError

__all__ = ["convert_sd3_folder", "render_sd3_card", "TRANSFORMER_ENTRY"]

TRANSFORMER_ENTRY = ["ttt_zoo.sd3.transformer", TTT_CLASS]
_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "card_template.md")
_WEIGHTS = "diffusion_pytorch_model.safetensors"


def _read_json(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SD3LayoutError(f"Cannot read {path}: {e}") from e


def _source_kind(src: str) -> str:
    """'pipeline' or 'transformer'; raises for anything else."""
    if os.path.isfile(os.path.join(src, "model_index.json")):
        index = _read_json(os.path.join(src, "model_index.json"))
        entry = index.get("transformer")
        if not entry or entry[1] not in (SOFTMAX_CLASS,):
            raise SD3LayoutError(f"{src} is a {index.get('_class_name')} pipeline whose transformer is {entry}, "
                                 f"not a softmax {SOFTMAX_CLASS}.")
        return "pipeline"
    if os.path.isfile(os.path.join(src, "config.json")):
        cls = _read_json(os.path.join(src, "config.json")).get("_class_name")
        if cls != SOFTMAX_CLASS:
            raise SD3LayoutError(f"{src} holds a {cls!r}, not a softmax {SOFTMAX_CLASS}"
                                 + (" (it is already SD3.5-T5)" if cls == TTT_CLASS else "") + ".")
        return "transformer"
    raise SD3LayoutError(f"{src} is neither a diffusers pipeline folder (model_index.json) nor an SD3 transformer "
                         f"folder (config.json).")


def render_sd3_card(info: Dict[str, Any]) -> str:
    """README.md for a converted folder (``huggingface_hub.ModelCard`` from ``card_template.md``)."""
    from huggingface_hub import ModelCard, ModelCardData
    data = ModelCardData(license=info.get("license") or "other", library_name="diffusers",
                         base_model=info.get("base_model"), pipeline_tag="text-to-image",
                         tags=["ttt-zoo", "test-time-training", "sd3.5-t5", "text-to-image", "arxiv:2605.02772"])
    if info.get("license_name"):
        data.license_name = info["license_name"]
    return str(ModelCard.from_template(data, template_path=_TEMPLATE, **info))


def convert_sd3_folder(src: str, out: str, hub_id: Optional[str] = None, base_name: Optional[str] = None,
                       overwrite: bool = False, finetuned: Optional[str] = None, license: str = "other",
                       license_name: Optional[str] = "stabilityai-ai-community", **ttt_options) -> Dict[str, Any]:
    """Convert ``src`` (an SD3 pipeline or transformer folder) into an SD3.5-T5 folder ``out``; returns the card info.

    ``ttt_options``: ``ttt_dual_layers``, ``ttt_joint_layers``, ``ttt_key_norm_span``, ``ttt_rms_qk_norm``,
    ``ttt_key_norm_eps`` (defaults: the paper's layout, see ``SD3T5Transformer2DModel``)."""
    from ttt_zoo.hub.cards import REQUIRED_CARD_KEYS, parse_card
    from ttt_zoo.hub.staging import staged_folder
    from .transformer import SD3T5Transformer2DModel

    src = os.path.abspath(src)
    if not os.path.isdir(src):
        raise SD3LayoutError(f"{src} is not a folder; give a local SD3 / SD3.5 diffusers folder.")
    kind = _source_kind(src)
    t_src = os.path.join(src, "transformer") if kind == "pipeline" else src
    weights = [os.path.join(t_src, f) for f in sorted(os.listdir(t_src)) if f.endswith(".safetensors")]
    if not weights:
        raise SD3LayoutError(f"{t_src} has no .safetensors weights (pickled checkpoints are not read).")
    with staged_folder(out, overwrite) as tmp:
        model = SD3T5Transformer2DModel.from_pretrained(t_src, **ttt_options)
        t_out = os.path.join(tmp, "transformer") if kind == "pipeline" else tmp
        if kind == "pipeline":
            for name in sorted(os.listdir(src)):
                if name in ("transformer", "README.md", ".cache") or name.startswith("."):
                    continue
                s = os.path.join(src, name)
                (shutil.copytree if os.path.isdir(s) else shutil.copy2)(s, os.path.join(tmp, name))
            index = _read_json(os.path.join(src, "model_index.json"))
            index["transformer"] = list(TRANSFORMER_ENTRY)
            with open(os.path.join(tmp, "model_index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        model.save_pretrained(t_out, safe_serialization=True)
        cfg = model.config
        new = model.new_parameter_names()
        named = dict(model.named_parameters())
        info = dict(
            repo_name=(hub_id or os.path.basename(os.path.abspath(out))).split("/")[-1],
            hub_id=hub_id or os.path.abspath(out), base_name=base_name or os.path.basename(src.rstrip("/")),
            base_model=base_name, source=src, source_sha256=sha256_file(weights[0]) if len(weights) == 1 else None,
            finetuned=finetuned, pipeline=kind == "pipeline", dual_layers=list(cfg.ttt_dual_layers),
            joint_layers=list(cfg.ttt_joint_layers), key_norm_span=cfg.ttt_key_norm_span,
            rms_qk_norm=cfg.ttt_rms_qk_norm, key_norm_eps=cfg.ttt_key_norm_eps,
            n_ttt=len(cfg.ttt_dual_layers) + len(cfg.ttt_joint_layers), n_new_params=len(new),
            params_str=f"{sum(p.numel() for p in named.values()):,}",
            new_params_str=f"{sum(named[n].numel() for n in new):,}", license=license, license_name=license_name,
            license_note=f"license `{license_name or license}`")
        card = render_sd3_card(info)
        meta, _ = parse_card(card)
        missing = [k for k in REQUIRED_CARD_KEYS if k not in meta]
        if missing:
            raise SD3LayoutError(f"model card lacks {missing}")
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(card)
    return info
