"""ImageNet-style evaluation of a model, one checkpoint or every checkpoint of a folder (``ttt-zoo validate``).

Like timm's ``validate.py``: timm's ``create_dataset`` / ``resolve_data_config`` / ``create_loader`` / ``accuracy``;
weights are read only through :mod:`ttt_zoo.checkpoint` (safetensors, or ``torch.load(weights_only=True)``).
Result rows: ``model, top1, top1_err, top5, top5_err, param_count, img_size, crop_pct, checkpoint``.
"""
from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Set

import torch

from ttt_zoo.checkpoint import (CheckpointError, load_checkpoint_file, unwrap_checkpoint,
                                validate_state_dict)
from ttt_zoo.fileio import atomic_write
from ttt_zoo.torchcompile import compile_model, mark_step
from ttt_zoo import run_folder

__all__ = ["validate", "eval_dataset", "create_eval_model", "eval_loader", "find_checkpoints", "committed_path",
           "load_weights", "write_results", "RESULT_COLUMNS"]

RESULT_COLUMNS = ("model", "top1", "top1_err", "top5", "top5_err", "param_count", "img_size", "crop_pct",
                  "checkpoint")
_WEIGHT_EXTS = (".safetensors", ".pth", ".pt")
_EMA_KEYS = ("state_dict_ema", "model_ema", "ema")


def find_checkpoints(path: str) -> List[str]:
    """``path`` itself if it is a file; for a folder, its weight files (sorted), leaving out ``*_ema.safetensors``
    (read instead of their sibling with ``use_ema``) and a trainer's ``<tag>.state.pt`` when ``<tag>.safetensors``
    (the same weights) is there."""
    if os.path.isfile(path):
        return [path]
    if os.path.basename(path) in _committed_names(os.path.dirname(os.path.abspath(path))):
        return [path]  # committed by a run, not yet put in place: committed_path() does
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--checkpoint {path!r} does not exist: give a weights file (.safetensors, .pth, "
                                f".pt) or a folder of them (e.g. a ttt-zoo train experiment folder).")
    names = sorted(set(os.listdir(path)) | _committed_names(path))
    out = []
    for n in names:
        if not n.endswith(_WEIGHT_EXTS) or n.endswith(run_folder.EMA_WEIGHTS_SUFFIX):
            continue
        if n.endswith(run_folder.STATE_SUFFIX) and n[: -len(run_folder.STATE_SUFFIX)] + ".safetensors" in names:
            continue
        out.append(os.path.join(path, n))
    if not out:
        raise FileNotFoundError(f"No checkpoint files (*.safetensors, *.pth, *.pt) in folder {path!r}.")
    return out


def _committed_names(folder: str) -> Set[str]:
    manifest = run_folder.read_manifest(folder) if os.path.isdir(folder) else None
    return set(manifest["files"]) if manifest else set()


def committed_path(path: str, use_ema: bool) -> str:
    """The file to load for ``path``, checked against its run folder's manifest (:func:`run_folder.committed_file`);
    with ``use_ema``, a trainer's ``<tag>.safetensors`` stands for its committed ``<tag>_ema.safetensors``."""
    folder, name = os.path.split(os.path.abspath(path))
    tag = run_folder.tag_of(name)
    if use_ema and tag and name == run_folder.weights_name(tag) and run_folder.read_manifest(folder) is not None:
        ema = run_folder.committed_weights(folder, tag, ema=True)
        if ema is None:
            raise CheckpointError(f"--use-ema: the run in {folder} has no committed EMA weights (not trained with "
                                  f"--model-ema?). Leave out --use-ema to validate the model's own weights.")
        return ema
    return run_folder.committed_file(path)


def load_weights(model: torch.nn.Module, path: str, use_ema: bool = False) -> None:
    """Load ``path`` (strictly) into ``model``; ``use_ema`` takes the EMA weights: a trainer's
    ``<tag>_ema.safetensors`` beside ``<tag>.safetensors``, or the EMA entry of a ``.pth`` / ``.pt`` checkpoint."""
    if use_ema and path.endswith(".safetensors") and not path.endswith(run_folder.EMA_WEIGHTS_SUFFIX):
        ema_path = run_folder.ema_weights_of(path)
        if not os.path.isfile(ema_path):
            raise CheckpointError(f"--use-ema: no EMA weights {ema_path!r} beside {path!r} (the run was not trained "
                                  f"with --model-ema?). Leave out --use-ema to validate the model's own weights.")
        path = ema_path
    ckpt = load_checkpoint_file(path)
    if use_ema and not path.endswith(".safetensors") and not any(isinstance(ckpt.get(k), dict) and ckpt[k]
                                                                  for k in _EMA_KEYS):
        raise CheckpointError(f"--use-ema: {path!r} holds no EMA weights (none of {list(_EMA_KEYS)}).")
    sd = unwrap_checkpoint(ckpt, prefer_ema=use_ema)
    try:
        validate_state_dict(sd, model, ignore_prefixes=())
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    model.load_state_dict(sd, strict=True)


def _num_classes(dataset) -> int:
    reader = getattr(dataset, "reader", None)
    classes = getattr(reader, "class_to_idx", None)
    if not classes:
        raise ValueError("cannot tell the number of classes of this dataset: give --num-classes")
    return len(classes)


def eval_dataset(data_dir: str, split: str, class_names: Optional[Sequence[str]] = None,
                 num_classes: Optional[int] = None, whose: str = "the checkpoint"):
    """timm's evaluation data set of ``data_dir``'s ``split``. With ``class_names`` (the model's classes in output
    order) the class folders are labelled by name: a subset is fine, a folder of another name is refused. Without
    them, by position (timm's natural order), with a note when the folders do not number ``num_classes``."""
    import sys
    from timm.data import create_dataset
    from timm.data.dataset_factory import _search_split
    from .classification import check_known_classes, class_folders, scan_folder
    root = _search_split(data_dir, split)
    if os.path.abspath(root) == os.path.abspath(data_dir) and scan_folder(root).nested:  # timm fell back to it
        raise ValueError(f"--data-dir {data_dir} has no {split!r} folder, and its subfolders hold folders of images "
                         f"(e.g. train/ and val/ splits); give --split NAME (e.g. val), a folder of class folders")
    found = class_folders(root, strict=False)  # a symlink loop, images outside class folders: refused
    class_map = None
    if class_names:
        check_known_classes(root, found, list(class_names), whose)
        class_map = {n: i for i, n in enumerate(class_names)}
    elif num_classes is not None and len(found) != num_classes:
        print(f"note: {root} has {len(found)} class folders and the model {num_classes} classes; without recorded "
              f"class names (a plain weights file) the folders are matched to the classes by position, so a "
              f"missing class shifts every later label. Validate the run folder (its run.json names the classes) "
              f"or give a folder with every class.", file=sys.stderr)
    return create_dataset("", root=data_dir, split=split, is_training=False, class_map=class_map)


def create_eval_model(name: str, pretrained: bool, num_classes: Optional[int], img_size: Optional[int],
                      model_kwargs: Dict[str, Any]):
    import timm
    kw = dict(model_kwargs)
    if num_classes is not None:
        kw["num_classes"] = num_classes
    if img_size and "img_size" not in kw:
        try:
            return timm.create_model(name, pretrained=pretrained, img_size=img_size, **kw)
        except TypeError as e:  # a model without an img_size argument: the data config sets the size
            if "img_size" not in str(e):
                raise
    return timm.create_model(name, pretrained=pretrained, **kw)


def eval_loader(dataset, model: torch.nn.Module, batch_size: int = 64, img_size: Optional[int] = None,
                crop_pct: Optional[float] = None, workers: int = 2, device: Optional[torch.device] = None):
    """timm's evaluation loader for ``model`` (its data config, overridden by ``img_size`` / ``crop_pct``) and the
    resolved data config."""
    from timm.data import create_loader, resolve_data_config
    cfg = resolve_data_config(dict(img_size=img_size, crop_pct=crop_pct), model=model)
    loader = create_loader(dataset, input_size=cfg["input_size"], batch_size=batch_size, is_training=False,
                           use_prefetcher=False, interpolation=cfg["interpolation"], mean=cfg["mean"],
                           std=cfg["std"], num_workers=workers, crop_pct=cfg["crop_pct"],
                           crop_mode=cfg.get("crop_mode", "center"),
                           pin_memory=device is not None and torch.device(device).type == "cuda")
    return loader, cfg


def validate(model_name: str, data_dir: str, checkpoint: str = "", pretrained: bool = False, use_ema: bool = False,
             batch_size: int = 64, img_size: Optional[int] = None, crop_pct: Optional[float] = None,
             amp: bool = False, num_classes: Optional[int] = None, split: str = "validation", workers: int = 2,
             device: Optional[str] = None, model_kwargs: Optional[Dict[str, Any]] = None,
             torchcompile: Optional[str] = None, torchcompile_mode: Optional[str] = None,
             class_names: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """One result row per checkpoint (see :func:`find_checkpoints`), or one for ``pretrained`` weights;
    ``torchcompile`` / ``torchcompile_mode``: the forward through :func:`ttt_zoo.torchcompile.compile_model`.

    ``class_names``: the model's classes in output order (a run's recorded names): the class folders are matched
    to them by name (see :func:`eval_dataset`). ``num_classes`` defaults to the number of class names, else of
    class folders when a checkpoint is given, else the model's own (pretrained / random weights)."""
    from timm.utils import accuracy
    if not checkpoint and not pretrained:
        raise ValueError("Nothing to validate: give --checkpoint FILE_OR_FOLDER or --pretrained.")
    if not data_dir or not os.path.isdir(data_dir):
        raise FileNotFoundError(f"--data-dir {data_dir!r} is not a folder: give an image folder with a "
                                f"{split!r} (or 'val') subfolder of class folders.")
    paths = find_checkpoints(checkpoint) if checkpoint else [""]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if num_classes is None and class_names:
        num_classes = len(class_names)
    dataset = eval_dataset(data_dir, split, class_names, num_classes)
    if len(dataset) == 0:
        raise ValueError(f"no images under {data_dir!r} (split {split!r}).")
    if num_classes is None and checkpoint:
        num_classes = _num_classes(dataset)

    rows = []
    for path in paths:
        model = create_eval_model(model_name, pretrained and not path, num_classes, img_size, model_kwargs or {})
        if path:
            load_weights(model, committed_path(path, use_ema), use_ema)
        model = model.to(dev).eval()
        run = compile_model(model, torchcompile, torchcompile_mode)
        loader, cfg = eval_loader(dataset, model, batch_size, img_size, crop_pct, workers, dev)
        k = min(5, model.num_classes)
        top1 = topk = 0.0
        count = 0
        from ttt_zoo.finite import FiniteCheck
        from ttt_zoo.progress import Progress
        finite = FiniteCheck(f"the output of {model_name} ({path or 'pretrained weights'})")
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16 if dev.type == "cpu" else torch.float16,
                                             enabled=amp), \
                Progress(len(loader), f"validate {os.path.basename(path) or 'pretrained'}", interval=50) as progress:
            for x, y in loader:
                x, y = x.to(dev), y.to(dev)
                mark_step(torchcompile is not None)
                out = run(x)
                if isinstance(out, (tuple, list)):
                    out = out[0]
                if y.max() >= out.shape[-1]:
                    raise ValueError(f"the data has class index {int(y.max())} but the model has {out.shape[-1]} "
                                     f"outputs: give --num-classes (the data folder has {_num_classes(dataset)} "
                                     f"classes).")
                finite.add(out, lambda i, c=count: dataset.filename(c + i))
                a1, ak = accuracy(out.float(), y, topk=(1, k))
                top1 += a1.item() * x.shape[0]
                topk += ak.item() * x.shape[0]
                count += x.shape[0]
                progress.update(items=x.shape[0], fields=lambda: {"top1": f"{top1 / count:.2f}"})
        finite.check()  # a NaN output is no top-1 (argmax of NaN picks a class)
        top1, topk = top1 / count, topk / count
        rows.append(dict(model=model_name, top1=round(top1, 4), top1_err=round(100 - top1, 4), top5=round(topk, 4),
                         top5_err=round(100 - topk, 4),
                         param_count=round(sum(p.numel() for p in model.parameters()) / 1e6, 4),
                         img_size=cfg["input_size"][-1], crop_pct=cfg["crop_pct"], checkpoint=path or "pretrained"))
    return rows


def _results_format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".csv", ".json"):
        raise ValueError(f"--results-file {path!r}: the extension picks the format, .csv or .json")
    return ext[1:]


def write_results(rows: Sequence[Dict[str, Any]], path: str) -> None:
    """``rows`` as CSV or JSON (by extension), written atomically (its folder is created)."""
    fmt = _results_format(path)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=RESULT_COLUMNS)
        w.writeheader()
        w.writerows(rows)
        text = buf.getvalue()
    else:
        from ttt_zoo.finite import json_dumps
        text = json_dumps(list(rows), "the validate results", indent=2) + "\n"
    atomic_write(path, text)
