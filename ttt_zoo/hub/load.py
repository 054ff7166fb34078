"""Loading and validating Hub folders (``PATH``, ``local-dir:PATH``, ``hf-hub:ORG/NAME``): ``config.json`` through
the one reader (:mod:`ttt_zoo.hub_format`), the weights' sha256, the card, and the outputs against the source."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
from torch import nn

from ttt_zoo import hub_format as fmt
from ttt_zoo.checkpoint import CheckpointError, check_safetensors, damaged_weights, hub_unavailable_error
from ttt_zoo.errors import HubFolderError
from ttt_zoo.fileio import sha256_file

from .build import build_from_checkpoint, example_inputs, flat_outputs, hub_architectures, zoo_architectures
from .cards import REQUIRED_CARD_KEYS, arxiv_ids, parse_card

__all__ = ["PICKLE_SUFFIXES", "resolve_folder", "read_config", "rebuild_args", "load_folder", "validate_folder"]

PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".pkl", ".pickle", ".ckpt", ".tar")


def resolve_folder(path_or_id: str, cache_dir: Optional[str] = None) -> str:
    """The local folder of ``PATH``, ``local-dir:PATH`` or ``hf-hub:ORG/NAME[@REV]`` (downloaded or cached)."""
    if path_or_id.startswith("hf-hub:"):
        from huggingface_hub import snapshot_download
        repo, _, rev = path_or_id[len("hf-hub:"):].partition("@")
        try:
            return snapshot_download(repo, revision=rev or None, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 - offline / not found / network: one clear message
            raise hub_unavailable_error(repo, "the model folder", e) from e
    if path_or_id.startswith("local-dir:"):
        path_or_id = path_or_id[len("local-dir:"):]
    return path_or_id


def read_config(folder: str) -> Dict[str, Any]:
    """``config.json`` of a folder, every key checked (:func:`ttt_zoo.hub_format.read_config`), the architecture
    one of the zoo's."""
    return fmt.read_config(folder, zoo_architectures())


def rebuild_args(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Constructor arguments of a config.json's model: ``model_args`` plus the loader arguments that timm's
    loaders take from ``num_classes`` and ``pretrained_cfg`` (what ``timm.create_model('local-dir:...')`` passes)."""
    if fmt.architecture(cfg) in hub_architectures():
        return fmt.model_args(cfg)
    return dict(fmt.loader_args(cfg), **fmt.model_args(cfg))


def load_folder(path_or_id: str, cache_dir: Optional[str] = None, **kwargs) -> nn.Module:
    """Build the model of a hub folder (``PATH``, ``local-dir:PATH`` or ``hf-hub:ORG/NAME``) with its weights.

    timm models go through ``timm.create_model('local-dir:...', pretrained=True)``; non-timm architectures are
    built from ``model_args`` and loaded strictly.  Folder problems (a malformed config.json key, weights whose
    sha256 differs from the recorded one) raise clear errors first."""
    folder = resolve_folder(path_or_id, cache_dir)
    cfg = read_config(folder)
    weights = os.path.join(folder, fmt.WEIGHTS_NAME)
    if not os.path.isfile(weights):
        raise CheckpointError(f"Weights file {weights} does not exist. Run `ttt-zoo convert` to create it.")
    check_safetensors(weights)  # header only: timm reads the file once, through ttt_zoo.checkpoint
    fmt.check_weights(folder, cfg)
    arch = fmt.architecture(cfg)
    try:
        if arch in hub_architectures():
            model, _ = build_from_checkpoint(arch, weights, dict(fmt.model_args(cfg), **kwargs))
            return model
        import timm
        return timm.create_model(f"local-dir:{folder}", pretrained=True, **kwargs).eval()
    except (CheckpointError, RuntimeError, TypeError) as e:  # another family, a head the weights lack, ...
        damaged = damaged_weights(e, weights)  # NaN, floats stored as integers: the file, whatever config.json says
        if damaged:
            raise damaged from None
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        why = lines[-1] if isinstance(e, RuntimeError) and not isinstance(e, CheckpointError) else lines[0]
        keys = dict(architecture=arch, num_classes=fmt.num_classes(cfg), model_args=fmt.model_args(cfg))
        shown = ", ".join(f"'{k}' {v!r}" for k, v in keys.items())
        raise HubFolderError(f"{os.path.join(folder, fmt.CONFIG_NAME)} ({shown}) does not fit {fmt.WEIGHTS_NAME}: "
                             f"{why} Re-run `ttt-zoo convert`, or correct those keys.") from e


def _check_card(folder: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    path = os.path.join(folder, fmt.CARD_NAME)
    if not os.path.isfile(path):
        raise HubFolderError(f"{folder} has no {fmt.CARD_NAME} model card. Re-run `ttt-zoo convert`.")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        meta, body = parse_card(text)
    except ValueError as e:
        raise HubFolderError(f"{path}: {e}") from e
    missing = [k for k in REQUIRED_CARD_KEYS if not meta.get(k)]
    if missing:
        raise HubFolderError(f"{path}: front matter lacks {', '.join(missing)}.")
    want_lib = "ttt-zoo" if fmt.architecture(cfg) in hub_architectures() else "timm"
    if meta["library_name"] != want_lib:
        raise HubFolderError(f"{path}: library_name is {meta['library_name']!r}, expected {want_lib!r}.")
    for i in arxiv_ids(fmt.paper_ids(cfg)):
        if f"arxiv:{i}" not in meta["tags"]:
            raise HubFolderError(f"{path}: tags lack 'arxiv:{i}' (the paper in config.json).")
    if "measured by ttt-zoo" not in body:
        raise HubFolderError(f"{path}: the card does not say which numbers ttt-zoo measured.")
    return meta


def validate_folder(folder: str, source: Optional[str] = None, rtol: float = 1e-5, atol: float = 1e-5,
                    check_source: bool = True) -> Dict[str, Any]:
    """Check a hub folder before upload: files (no pickles), config.json, the weights' sha256, card metadata, that
    the weights load through timm's ``local-dir:`` path, and that outputs match the ``source`` checkpoint."""
    if not os.path.isdir(folder):
        raise HubFolderError(f"{folder} is not a folder.")
    files = sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs)
    pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise HubFolderError(f"{folder} holds pickle files {pickles}; hub folders carry only {fmt.WEIGHTS_NAME}. "
                             f"Remove them.")
    cfg = read_config(folder)
    n_tensors = check_safetensors(os.path.join(folder, fmt.WEIGHTS_NAME))
    card = _check_card(folder, cfg)
    model = load_folder(folder)
    from ttt_zoo.finite import FiniteCheck  # a folder whose outputs are NaN is no model (issue 36, item 5)
    finite = FiniteCheck(f"the output of {folder}", "example inputs", "convert finite weights")
    with torch.no_grad():
        example = example_inputs(model, batch=2, input_size=fmt.input_size(cfg) if fmt.kind(cfg) != "diffusion"
                                 else None)
        for out in flat_outputs(model(*example)):
            finite.add(out, lambda i: f"example input {i}")
    finite.check()
    report = dict(folder=folder, files=files, architecture=fmt.architecture(cfg), card=card,
                  tensors=n_tensors, source_checked=False)
    if not check_source:
        return report
    if source is None:
        raise HubFolderError("Pass --source CKPT (the checkpoint the folder was converted from) so the folder's "
                             "outputs can be compared with it, or --no-source-check to skip that comparison.")
    sha = sha256_file(source)
    recorded_file, recorded = fmt.source(cfg)
    if recorded and recorded != sha:
        raise HubFolderError(f"{source} (sha256 {sha[:16]}...) is not the checkpoint {folder} was converted from "
                             f"({recorded_file}, sha256 {recorded[:16]}...).")
    ref, _ = build_from_checkpoint(fmt.model_name(cfg), source, rebuild_args(cfg))
    inputs = example_inputs(model, batch=2, input_size=fmt.input_size(cfg) if fmt.kind(cfg) != "diffusion" else None)
    with torch.no_grad():
        got, want = flat_outputs(model(*inputs)), flat_outputs(ref(*inputs))
    if len(got) != len(want):
        raise HubFolderError(f"{folder} gives {len(got)} outputs, the source checkpoint {len(want)}.")
    diff = 0.0
    for g, w in zip(got, want):
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise HubFolderError(f"Outputs of {folder} differ from those of {source}: {e}") from e
        diff = max(diff, (g - w).abs().max().item())
    report.update(source_checked=True, max_abs_diff=diff, source_sha256=sha)
    return report
