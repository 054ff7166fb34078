"""``ttt-zoo convert``: a checkpoint (official or ours) to a hub folder, written beside the target and swapped in."""
from __future__ import annotations

import fnmatch
import inspect
import os
import sys
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from ttt_zoo._version import __version__
from ttt_zoo import hub_format as fmt
from ttt_zoo.checkpoint import CheckpointError, damaged_weights
from ttt_zoo.errors import HubFolderError
from ttt_zoo.fileio import atomic_path, sha256_file

from .build import (_HUB_ARCHS, GITHUB_REPO, _split, build_from_checkpoint, hub_repo_id, measure, registered_cfg,
                    registered_pretrained, zoo_architectures)
from .cards import PAPER_RESULTS, paper_results, render_card
from .staging import staged_folder

# ----- conversion -----

def _kind(arch: str, model: nn.Module) -> str:
    """'backbone' (non-timm architectures), 'diffusion' (forward(x, t, y)) or 'classifier'."""
    if arch in _HUB_ARCHS:
        return _HUB_ARCHS[arch].kind
    if list(inspect.signature(model.forward).parameters)[:3] == ["x", "t", "y"]:
        return "diffusion"
    return "classifier"


def _description(arch: str) -> str:
    if arch in _HUB_ARCHS:
        return _HUB_ARCHS[arch].description
    import timm
    module = sys.modules[timm.models.model_entrypoint(arch).__module__]
    doc = (module.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split())


def _label_info(num_classes: int, name: str, class_names: Optional[List[str]] = None) -> Dict[str, Any]:
    """timm's ``label_names``: a run's recorded ``class_names`` (one per classifier row; rows without a class,
    from a --num-classes above the class folders, get timm's '<unmapped:INDEX>'), ImageNet-1k synsets and
    descriptions for 1000-class ImageNet checkpoints; else nothing."""
    if class_names:
        if len(class_names) > num_classes:
            raise HubFolderError(f"the run records {len(class_names)} class names but the model has {num_classes} "
                                 f"classes; convert it with the run's own num_classes (leave out --model-kwargs "
                                 f"num_classes=...)")
        names = list(class_names) + [f"<unmapped:{i}>" for i in range(len(class_names), num_classes)]
        return dict(label_names=names)  # a list: transformers reads a list only (id2label)
    tag = _split(name)[1]
    if num_classes != 1000 or ("in1k" not in tag and "in22k_ft_in1k" not in tag and "imagenet" not in tag):
        return {}
    from timm.data import ImageNetInfo
    info = ImageNetInfo()
    names = list(info.label_names())
    return dict(label_names=names, label_descriptions={n: info.label_name_to_description(n) for n in names})


def _datasets(name: str, kind: str) -> List[str]:
    tag = _split(name)[1]
    if kind == "backbone":
        return ["detection-datasets/coco"] if "coco" in tag else ["scene_parse_150"] if "ade" in tag else []
    if "in1k" in tag or "imagenet" in tag:
        return ["imagenet-1k"]
    return []


#: constructor arguments that keep the released architecture (anything else makes a different network)
_SAME_ARCH_ARGS = fmt.LOADER_ARGS + ("img_size",)


def _authors_release(name: str, source_url: Optional[str], custom_args: Dict[str, Any]) -> bool:
    """Whether the authors' published results may be stated: the registered tag, converted from its released file
    (``source_url`` is the cfg's url: downloaded by the converter, taken from the ``pretrained=True`` cache, or
    stated with --source-url), built exactly as released.  Random weights, fine-tunes and custom tags are not."""
    arch, tag = _split(name)
    if arch in _HUB_ARCHS:  # no registered url: the tag must name a release and the source be stated
        return bool(source_url) and not custom_args and name in PAPER_RESULTS
    cfg = registered_cfg(name) if tag else None
    if not cfg or not cfg.get("url") or source_url != cfg["url"]:
        return False
    return all(k == "num_classes" and v == cfg.get("num_classes") for k, v in custom_args.items())


def _save_weights(model: nn.Module, path: str) -> None:
    """model.safetensors with the ``{'format': 'pt'}`` metadata that transformers and huggingface_hub check
    (timm's ``save_for_hf`` writes none)."""
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path, metadata={"format": "pt"})


def convert_checkpoint(checkpoint: str, name: str, out_dir: str, model_args: Optional[Dict[str, Any]] = None,
                       hub_id: Optional[str] = None, flops: bool = True, overwrite: bool = False,
                       source_url: Optional[str] = None, class_names: Optional[List[str]] = None) -> Dict[str, Any]:
    """Convert one checkpoint into a hub folder; returns the info the card was rendered from.

    The files are written into a temporary folder beside ``out_dir`` that replaces it only once complete, so an
    existing folder is never lost.  ``source_url``: where ``checkpoint`` was downloaded from, if known (the card
    only claims a release it knows).  ``class_names``: the classes a run recorded, in output order (config.json's
    ``label_names``, listed on the card)."""
    with staged_folder(out_dir, overwrite) as tmp:
        return _write_folder(checkpoint, name, tmp, model_args, hub_id, flops, source_url, class_names)


def _write_folder(checkpoint: str, name: str, out_dir: str, model_args: Optional[Dict[str, Any]],
                  hub_id: Optional[str], flops: bool, source_url: Optional[str],
                  class_names: Optional[List[str]] = None) -> Dict[str, Any]:
    """Write model.safetensors, config.json and README.md for ``checkpoint`` into the empty folder ``out_dir``.

    The layout is that of the ``timm/`` organisation's repositories (timm's ``save_config_for_hf``); a tag timm does
    not know (e.g. 'vit3_tiny.digits') names a user's own weights."""
    try:
        model, used_args = build_from_checkpoint(name, checkpoint, model_args)
    except CheckpointError as e:  # damaged weights: name the file, not "another model" as the wrapper says
        damaged = damaged_weights(e, checkpoint)
        if damaged is None:
            raise
        raise damaged from None
    if "." not in name and (getattr(model, "pretrained_cfg", None) or {}).get("tag"):
        name = f"{name}.{model.pretrained_cfg['tag']}"  # 'vit3_tiny' -> its default tag 'vit3_tiny.in1k'
    arch, tag = _split(name)
    hub_id = hub_id or hub_repo_id(name)
    kind = _kind(arch, model)
    if arch in _HUB_ARCHS:
        pc = dict(_HUB_ARCHS[arch].pretrained_cfg, architecture=arch, tag=tag or None)
        num_classes = 0
    else:
        pc = dict(model.pretrained_cfg)
        num_classes = getattr(model, "num_classes", 0)
    input_size = tuple(pc.get("input_size", (3, 224, 224)))
    if "img_size" in used_args:
        s = used_args["img_size"]
        input_size = (input_size[0],) + ((s, s) if isinstance(s, int) else tuple(s))
    if "in_chans" in used_args:
        input_size = (used_args["in_chans"],) + input_size[1:]
    numbers = measure(model, input_size if kind != "diffusion" else None) if flops else dict(
        params=sum(p.numel() for p in model.parameters()), macs=None, macs_input=list(input_size))

    source_sha256 = sha256_file(checkpoint)
    provenance = dict(version=__version__, hub_id=hub_id, kind=kind, source_file=os.path.basename(checkpoint),
                      source_sha256=source_sha256, params=numbers["params"], gmacs=numbers["macs"],
                      gmacs_input=numbers["macs_input"], source_url=source_url)
    labels = _label_info(num_classes, name, class_names if kind == "classifier" else None)
    _save_weights(model, os.path.join(out_dir, fmt.WEIGHTS_NAME))
    provenance = fmt.with_weights_sha256(provenance, out_dir)
    if arch in _HUB_ARCHS:  # not a timm model: timm's config layout does not fit
        config = fmt.plain_config(arch, used_args, pc, provenance)
    else:
        data_cfg = {"input_size": input_size} if input_size != tuple(pc.get("input_size", ())) else None
        config = fmt.timm_config(model, used_args, labels, provenance, data_cfg)
    fmt.write_config(out_dir, config, zoo_architectures())
    custom_args = {k: v for k, v in used_args.items() if k != "num_classes" or v != 1000}
    other_arch = sorted(k for k in custom_args if k not in _SAME_ARCH_ARGS)
    authors_release = _authors_release(name, source_url, custom_args)
    registered_tag = arch not in _HUB_ARCHS and registered_cfg(name) is not None

    info = dict(name=name, architecture=arch, hub_id=hub_id, library="ttt-zoo" if arch in _HUB_ARCHS else "timm",
                kind=kind, license=pc.get("license"), datasets=[] if other_arch else _datasets(name, kind),
                paper_ids=pc.get("paper_ids"), released_url=pc.get("url") if registered_tag else None,
                other_arch=other_arch, registered_tag=registered_tag,
                paper_name=pc.get("paper_name"), origin_url=pc.get("origin_url"), description=_description(arch),
                input_size=input_size, mean=pc.get("mean"), std=pc.get("std"), crop_pct=pc.get("crop_pct"),
                interpolation=pc.get("interpolation"), num_classes=num_classes, params=numbers["params"],
                macs=numbers["macs"], macs_input=numbers["macs_input"], source_file=os.path.basename(checkpoint),
                source_sha256=source_sha256, source_url=source_url, model_args=custom_args,
                class_names=list(class_names) if labels and class_names else None,
                paper=paper_results(name) if authors_release else None, github=GITHUB_REPO)
    with open(os.path.join(out_dir, fmt.CARD_NAME), "w", encoding="utf-8") as f:
        f.write(render_card(info))
    return info


def _find_source(name: str, checkpoint_dir: str) -> Optional[str]:
    for ext in (".pth", ".pth.tar", ".pt", ".safetensors", ".bin"):
        p = os.path.join(checkpoint_dir, name + ext)
        if os.path.isfile(p):
            return p
    return None


def default_checkpoint_dir() -> str:
    """Where ``pretrained=True`` caches the authors' checkpoints (``<torch hub>/checkpoints/ttt_zoo``)."""
    return os.path.join(torch.hub.get_dir(), "checkpoints", "ttt_zoo")


def convert_all(out_root: str, checkpoint_dir: Optional[str] = None, pattern: str = "*", download: bool = False,
                skip_missing: bool = False, flops: bool = True, overwrite: bool = False,
                log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Convert every registered pretrained tag matching ``pattern``; sources are ``<dir>/<model>.<tag>.pth``."""
    from timm.models import get_pretrained_cfg
    checkpoint_dir = checkpoint_dir or default_checkpoint_dir()
    names = [n for n in registered_pretrained() if fnmatch.fnmatch(n, pattern)]
    if not names:
        raise HubFolderError(f"No registered pretrained tag matches {pattern!r}; see `ttt-zoo list`.")
    missing = []
    for n in names:
        if _find_source(n, checkpoint_dir) is None:
            url = get_pretrained_cfg(n).url
            if download and url:
                os.makedirs(checkpoint_dir, exist_ok=True)
                with atomic_path(os.path.join(checkpoint_dir, n + ".pth")) as tmp:
                    torch.hub.download_url_to_file(url, tmp, progress=True)
            else:
                missing.append(n)
    if missing and not skip_missing:
        raise HubFolderError(
            f"No source checkpoint in {checkpoint_dir} for {', '.join(missing)} (expected <model>.<tag>.pth). "
            f"Pass --download to fetch the authors' files, or --skip-missing.")
    done = {}
    for n in names:
        if n in missing:
            log(f"skip {n}: no checkpoint in {checkpoint_dir}")
            continue
        src = _find_source(n, checkpoint_dir)
        out = os.path.join(out_root, n)
        # files in the pretrained=True cache (or fetched by --download) came from the cfg's url
        url = get_pretrained_cfg(n).url if (download or checkpoint_dir == default_checkpoint_dir()) else None
        info = convert_checkpoint(src, n, out, flops=flops, overwrite=overwrite, source_url=url)
        done[n] = out
        log(f"converted {src} -> {out} ({info['params']:,} params)")
    return dict(converted=done, missing=missing)

