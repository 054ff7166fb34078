"""Image classification on timm's components: ``create_dataset`` / ``create_transform``, ``Mixup``, timm losses.

``--linearize-from MODEL`` builds that softmax ViT / DeiT (``--pretrained`` or ``--initial-checkpoint``), turns it
into T5 with :func:`ttt_zoo.linearize`, and trains the result; the new TTT parameters get ``lr_scale`` = the
paper's multiplier (``--ttt-lr-scale``, default 20x) on top of timm's decay / layer-decay groups.
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from .distributed import all_reduce_sum
from .task import Task
from ttt_zoo.flags import Range

__all__ = ["ClassificationTask", "ImageFolderTask", "build_classifier", "scan_folder", "class_folders",
           "check_known_classes", "folder_classes"]

_logger = logging.getLogger("ttt_zoo.train")


def _read_weights(path: str) -> Dict[str, torch.Tensor]:
    from ttt_zoo.checkpoint import load_checkpoint_file, unwrap_checkpoint
    return unwrap_checkpoint(load_checkpoint_file(path))


def _load_weights(model: nn.Module, path: str, sd: Optional[Dict[str, torch.Tensor]] = None) -> None:
    sd = _read_weights(path) if sd is None else sd
    own = model.state_dict()
    bad = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in sd.items()
           if k in own and hasattr(v, "shape") and tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        raise ValueError(f"--initial-checkpoint {path}: does not fit {type(model).__name__}: {len(bad)} shape "
                         f"mismatch(es), e.g. {bad[0]} (checkpoint vs model); give the --model / --num-classes / "
                         f"--model-kwargs / --img-size the weights were trained with")
    from ttt_zoo.checkpoint import check_dtypes
    check_dtypes(sd, model, f"--initial-checkpoint {path}")  # NaN was refused on reading
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"--initial-checkpoint {path}: does not fit {type(model).__name__}: missing "
                         f"{list(missing)[:6]}, unexpected {list(unexpected)[:6]}. Check --model / --num-classes / "
                         f"--model-kwargs.")


def build_classifier(args: argparse.Namespace, num_classes: Optional[int]) -> Tuple[nn.Module, List[str]]:
    """``(model, new_param_names)`` from --model or --linearize-from (+ --pretrained / --initial-checkpoint)."""
    import timm
    import ttt_zoo  # noqa: F401 - registers the ttt-zoo models with timm
    kw = dict(args.model_kwargs or {})
    if args.drop:
        kw.setdefault("drop_rate", args.drop)
    if args.drop_path is not None:
        kw.setdefault("drop_path_rate", args.drop_path)
    if args.linearize_from:
        if args.model:
            raise ValueError("Give either --model (train it) or --linearize-from (linearize it into T5, then train), "
                             "not both.")
        if not (args.pretrained or args.initial_checkpoint):
            raise ValueError("--linearize-from needs the softmax model's weights: add --pretrained or "
                             "--initial-checkpoint PATH.")
        sd = _read_weights(args.initial_checkpoint) if args.initial_checkpoint else None
        if sd is not None and "head.weight" in sd and "num_classes" not in kw:
            kw["num_classes"] = sd["head.weight"].shape[0]  # the source's own head; replaced below if needed
        if args.img_size and "img_size" not in kw:  # the source at the training size (its pos_embed must match)
            kw["img_size"] = args.img_size
        src = timm.create_model(args.linearize_from, pretrained=args.pretrained, **kw)
        if sd is not None:
            _load_weights(src, args.initial_checkpoint, sd)
        from ttt_zoo.linearize import linearize
        model, new = linearize(src, **({"img_size": args.img_size} if args.img_size else {}))
        if num_classes is not None and num_classes != model.num_classes:
            model.reset_classifier(num_classes)
        return model, list(new)
    if not args.model:
        raise ValueError("No model: give --model NAME (or --linearize-from NAME).")
    from ttt_zoo.registry import resolve_model_name
    resolve_model_name(args.model, flag="--model")
    try:
        return _create(args, kw, num_classes)
    except TypeError as e:  # a misspelled or mistyped --model-kwargs entry, e.g. depth=four
        raise ValueError(f"--model {args.model} --model-kwargs {dict(args.model_kwargs or {})}: {e}; check the "
                         f"argument names and values (e.g. depth=4)") from e


def _create(args: argparse.Namespace, kw: Dict[str, Any], num_classes: Optional[int]) -> Tuple[nn.Module, List[str]]:
    import timm
    if num_classes is not None:
        kw["num_classes"] = num_classes
    if args.img_size and "img_size" not in kw:
        try:
            model = timm.create_model(args.model, pretrained=args.pretrained, img_size=args.img_size, **kw)
        except TypeError as e:  # a model without an img_size argument (e.g. ResNet): data config sets the size
            if "img_size" not in str(e):
                raise
            model = timm.create_model(args.model, pretrained=args.pretrained, **kw)
    else:
        model = timm.create_model(args.model, pretrained=args.pretrained, **kw)
    if args.initial_checkpoint:
        _load_weights(model, args.initial_checkpoint)
    return model, []


def _has_split(root: str, split: str) -> bool:
    """Whether timm's folder lookup finds ``split`` itself (it falls back to the whole root otherwise)."""
    from timm.data.dataset_factory import _search_split
    return os.path.abspath(_search_split(root, split)) != os.path.abspath(root)


# ----- class folders -----

class FolderScan:
    """What an image-folder split holds, at the class level: ``classes`` (the folders holding images, in timm's
    label order: natural sort), ``empty`` (folders without images), ``stray`` (files that are not images),
    ``loose`` (images outside a class folder) and ``nested`` (folders with images inside a class folder: timm
    makes each a class of its own, named by its leaf)."""

    def __init__(self, root: str):
        self.root = root
        self.classes: List[str] = []
        self.empty: List[str] = []
        self.stray: List[str] = []
        self.loose: List[str] = []
        self.nested: List[str] = []

    def problems(self, strict: bool) -> List[str]:
        """The entries that shift or break the mapping (``strict``: also empty folders and stray files)."""
        out = [f"{n} (an image outside a class folder)" for n in self.loose]
        out += [f"{n}/ (a folder of images inside a class folder: timm makes it a class of its own)"
                for n in self.nested]
        if strict:
            out += [f"{n}/ (no image files)" for n in self.empty]
            out += [f"{n} (not a folder)" for n in self.stray]
        return out


def _walk_images(path: str, rel: str, stack: List[str], found: List[str], exts) -> None:
    """Append to ``found`` the paths (relative) of the images below ``path``, following folder links as timm's
    reader does; a link to a folder that contains it is refused (timm would walk it until the path is too long)."""
    with os.scandir(path) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        sub = os.path.join(rel, e.name) if rel else e.name
        if e.is_dir():  # (follows links)
            real = os.path.realpath(e.path)
            if real in stack:
                raise ValueError(f"{e.path} is a symlink to {real}, a folder that contains it: a loop that timm's "
                                 f"folder reader would follow without end; remove the link")
            _walk_images(e.path, sub, stack + [real], found, exts)
        elif os.path.splitext(e.name)[1].lower() in exts and e.is_file():
            found.append(sub)


def scan_folder(root: str) -> FolderScan:
    """:class:`FolderScan` of the split folder ``root`` (e.g. data/train); a symlink loop is refused."""
    from timm.data.readers.img_extensions import get_img_extensions
    from timm.utils.misc import natural_key
    exts = get_img_extensions(as_set=True)
    scan = FolderScan(root)
    found: List[str] = []
    _walk_images(root, "", [os.path.realpath(root)], found, exts)
    by_top: Dict[str, List[str]] = {}
    for rel in found:
        top, _, rest = rel.partition(os.sep)
        if not rest:
            scan.loose.append(top)
        elif os.sep in rest:
            scan.nested.append(os.path.dirname(rel))
        else:
            by_top.setdefault(top, []).append(rest)
    scan.nested = sorted(set(scan.nested), key=natural_key)
    for e in sorted(os.scandir(root), key=lambda e: natural_key(e.name)):
        if e.is_dir():
            (scan.classes if e.name in by_top else scan.empty).append(e.name)
        elif e.name not in scan.loose:
            scan.stray.append(e.name)
    return scan


def _refuse(where: str, problems: List[str], fix: str) -> None:
    if problems:
        shown = ", ".join(problems[:6]) + (f" and {len(problems) - 6} more" if len(problems) > 6 else "")
        what = "1 entry that is not a class folder" if len(problems) == 1 else \
            f"{len(problems)} entries that are not class folders"
        raise ValueError(f"{where} holds {what} of images: {shown}; {fix}")


def class_folders(root: str, strict: bool = True) -> List[str]:
    """The class names of the split folder ``root`` in timm's label order, refusing what would shift or break that
    order (see :meth:`FolderScan.problems`; ``strict`` for training data, whose folders number the classes)."""
    scan = scan_folder(root)
    _refuse(root, scan.problems(strict), "each class is a folder of images, and timm numbers the classes by these "
                                         "folders: remove those entries (or move the images into a class folder)")
    return scan.classes


def check_known_classes(root: str, names: List[str], known: List[str], whose: str) -> None:
    """Refuse class folders of ``root`` that are not among ``known`` (the classes of ``whose``), naming them."""
    unknown = [n for n in names if n not in set(known)]
    if unknown:
        shown = ", ".join(unknown[:6]) + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else "")
        raise ValueError(f"{root}: class folder(s) {shown} are not classes of {whose} ({len(known)} classes: "
                         f"{', '.join(known[:6])}{', ...' if len(known) > 6 else ''}); remove or rename them "
                         f"(a subset of the classes is fine)")


def _num_classes(ds) -> Optional[int]:
    reader = getattr(ds, "reader", None)
    for obj in (reader, ds):
        c2i = getattr(obj, "class_to_idx", None)
        if c2i:
            return len(c2i)
    classes = getattr(ds, "classes", None)
    return len(classes) if classes else None


def _dataset_class_names(ds) -> Optional[List[str]]:
    """The class names of a timm data set that has them (``class_to_idx`` of names), in label order."""
    for obj in (getattr(ds, "reader", None), ds):
        c2i = getattr(obj, "class_to_idx", None)
        if c2i and all(isinstance(k, str) for k in c2i):
            return [n for n, _ in sorted(c2i.items(), key=lambda kv: kv[1])]
    return None


def folder_classes(data_dir: str, train_split: str, eval_split: Optional[str] = None) -> List[str]:
    """The classes of the image folder ``data_dir`` by name, in timm's label order: the class folders of its
    ``train_split`` (checked by :func:`class_folders`: empty folders and stray files refused); those of an
    ``eval_split`` must be among them (a subset is fine)."""
    from timm.data.dataset_factory import _search_split
    root = _search_split(data_dir, train_split)
    if not _has_split(data_dir, train_split) and scan_folder(root).nested:
        raise ValueError(f"--data-dir {data_dir} has no {train_split!r} folder, and its subfolders hold folders of "
                         f"images (splits?); give --train-split NAME, a folder of class folders")
    names = class_folders(root)
    if eval_split:
        if not _has_split(data_dir, eval_split):
            raise ValueError(f"--data-dir {data_dir} has no {eval_split!r} (or 'val') folder to evaluate on; give "
                             f"--val-split NAME of a folder of class folders, or --val-split '' (no evaluation)")
        eval_root = _search_split(data_dir, eval_split)
        check_known_classes(eval_root, class_folders(eval_root, strict=False), names, f"the training split {root}")
    return names


class ImageFolderTask(Task):
    """What the classification and diffusion tasks share: the data-set and ``--linearize-from`` flags, the data
    check, an image folder's classes taken by name (:attr:`class_names`, recorded in run.json), the number of
    classes and the loaders.  Subclasses set the flag texts and define ``_datasets()``."""

    def __init__(self, args, dist):
        super().__init__(args, dist)
        self.new_param_names: List[str] = []
        self.class_names: Optional[List[str]] = None  # the training classes in label order (set with the data)
        self._train_ds = self._eval_ds = None

    def _datasets(self):
        """Must: ``(train_dataset, eval_dataset_or_None)``, built once."""
        raise NotImplementedError

    def _require_data(self) -> None:
        if not self.args.data_dir and not self.args.dataset:
            raise ValueError("No data: give --data-dir DIR (an image folder with train/ and val/ class folders) "
                             "or --dataset NAME.")

    def _class_map(self, eval_split: Optional[str]) -> Optional[Dict[str, int]]:
        """timm's ``class_map`` of an image folder's classes by name (sets :attr:`class_names`; see
        :func:`folder_classes`); None with --dataset (timm's own labels)."""
        a = self.args
        if a.dataset:
            return None
        self.class_names = folder_classes(a.data_dir, a.train_split, eval_split)
        return {n: i for i, n in enumerate(self.class_names)}

    def _checked_num_classes(self) -> Optional[int]:
        """--num-classes, else the training data's number of classes; fewer than the data has is refused."""
        a = self.args
        found = _num_classes(self._datasets()[0]) if (a.data_dir or a.dataset) else None
        if a.num_classes is None:
            return found
        if found is not None and a.num_classes < found:
            raise ValueError(f"--num-classes {a.num_classes}, but --data-dir {a.data_dir} has {found} classes; "
                             f"give --num-classes {found} or leave it out")
        return a.num_classes

    def _loaders(self, train_ds, eval_ds, eval_ids: Optional[Sequence[int]] = None
                 ) -> Tuple[DataLoader, Optional[DataLoader]]:
        """The train loader (one permutation per epoch from (--seed, epoch), split over ranks: the same samples for
        any world size) and, with ``eval_ds``, this rank's disjoint share of ``eval_ids`` (default: all)."""
        a, d = self.args, self.dist
        sampler = DistributedSampler(train_ds, num_replicas=d.world_size, rank=d.rank, shuffle=True, seed=a.seed)
        common = dict(num_workers=a.workers, pin_memory=a.pin_mem and d.device.type == "cuda")
        train = DataLoader(train_ds, batch_size=a.batch_size, sampler=sampler, drop_last=True, **common)
        if len(train) == 0:
            raise ValueError(f"The training set has {len(train_ds)} images, fewer than --batch-size "
                             f"{a.batch_size} x {d.world_size} processes: lower -b.")
        if eval_ds is None:
            return train, None
        ids = range(len(eval_ds)) if eval_ids is None else eval_ids
        part = Subset(eval_ds, list(ids)[d.rank::d.world_size])  # disjoint, no padding duplicates
        return train, DataLoader(part, batch_size=a.validation_batch_size or a.batch_size, shuffle=False, **common)


class ClassificationTask(ImageFolderTask):
    name = "classification"
    eval_metric = "top1"
    eval_mode = "max"


    def __init__(self, args, dist):
        super().__init__(args, dist)
        self.mixup_fn = None
        self.data_config: Dict[str, Any] = {}

    # ----- data -----
    def _datasets(self):
        """The train and eval data sets (transforms set later); with ``--val-split FRACTION`` both read the
        training split and :meth:`build_loaders` takes disjoint seeded subsets."""
        if self._train_ds is None:
            from timm.data import create_dataset
            a = self.args
            self._require_data()
            if not a.dataset and not os.path.isdir(a.data_dir):
                raise ValueError(f"--data-dir {a.data_dir!r} is not a folder; give an image folder with train/ and "
                                 f"val/ class folders (e.g. `ttt-zoo data digits`)")
            eval_on = not getattr(a, "no_eval", False) and bool(a.val_split)
            if eval_on and self.val_fraction is None and not a.dataset and not _has_split(a.data_dir, a.val_split):
                raise ValueError(f"--data-dir {a.data_dir} has no {a.val_split!r} (or 'val') folder, so a best "
                                 f"checkpoint would be picked on the training images; give --val-split 0.1 (a "
                                 f"seeded fraction of the training images held out) or --no-eval")
            # labelled by name: the eval split's classes may be a subset (not with a held-out fraction)
            class_map = self._class_map(a.val_split if eval_on and self.val_fraction is None else None)
            self._train_ds = create_dataset(a.dataset, root=a.data_dir, split=a.train_split, is_training=True,
                                            batch_size=a.batch_size, seed=a.seed, class_map=class_map)
            if a.dataset:
                self.class_names = _dataset_class_names(self._train_ds)
            n = _num_classes(self._train_ds)
            if n is not None and n < 2:
                raise ValueError(f"--data-dir {a.data_dir}: the training data has {n} class; classification needs "
                                 f"at least 2 class folders (top-1 of one class is always 100)")
            if eval_on:
                split = a.train_split if self.val_fraction is not None else a.val_split
                self._eval_ds = create_dataset(a.dataset, root=a.data_dir, split=split, is_training=False,
                                               batch_size=a.validation_batch_size or a.batch_size,
                                               class_map=class_map)
        return self._train_ds, self._eval_ds

    @property
    def val_fraction(self) -> Optional[float]:
        """``--val-split 0.1``: that fraction of the training images is held out for evaluation."""
        try:
            f = float(self.args.val_split)
        except (TypeError, ValueError):
            return None
        if not 0.0 < f < 1.0:
            raise ValueError(f"--val-split {self.args.val_split}: a fraction must be between 0 and 1 (e.g. 0.1); "
                             f"or give a split folder name such as val")
        return f

    def _holdout(self, n: int) -> Tuple[List[int], List[int]]:
        """(train, eval) indices: a permutation seeded by --seed, its first round(fraction * n) held out."""
        g = torch.Generator().manual_seed(int(self.args.seed))
        perm = torch.randperm(n, generator=g).tolist()
        k = min(max(1, round(self.val_fraction * n)), n - 1)
        return sorted(perm[k:]), sorted(perm[:k])

    def build_model(self) -> nn.Module:
        a = self.args
        model, self.new_param_names = build_classifier(a, self._checked_num_classes())
        self._model_for_config = model
        if self.new_param_names:
            _logger.info(f"linearized {a.linearize_from} into {type(model).__name__}: "
                         f"{len(self.new_param_names)} new TTT tensors")
        return model

    def param_groups(self, model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
        from ttt_zoo.linearize import param_groups
        return param_groups(model, self.new_param_names, multiplier=self.args.ttt_lr_scale if self.new_param_names
                            else 1.0, weight_decay=weight_decay, layer_decay=self.args.layer_decay)

    def build_loaders(self) -> Tuple[Iterable, Optional[Iterable]]:
        from timm.data import Mixup, create_transform, resolve_data_config
        from .augment import create_train_transform
        a = self.args
        train_ds, eval_ds = self._datasets()
        base_train = train_ds
        self.data_config = cfg = resolve_data_config(vars(a), model=self._model_for_config)
        # timm's transform with posterize's 0 bits = a black image (Pillow 13 refuses 0; see .augment)
        train_ds.transform = create_train_transform(
            cfg["input_size"], no_aug=a.no_aug, scale=a.scale, ratio=a.ratio, hflip=a.hflip,
            vflip=a.vflip, color_jitter=a.color_jitter, auto_augment=a.aa, interpolation=a.train_interpolation,
            mean=cfg["mean"], std=cfg["std"], re_prob=a.reprob, re_mode=a.remode, re_count=a.recount)
        held = None
        if eval_ds is not None and self.val_fraction is not None:  # disjoint subsets of the one training split
            keep, held = self._holdout(len(base_train))
            train_ds = Subset(base_train, keep)
            _logger.info(f"--val-split {a.val_split}: {len(held)} of {len(base_train)} training images held out "
                         f"for evaluation (seed {a.seed})")
        mix = a.mixup > 0 or a.cutmix > 0 or a.cutmix_minmax is not None
        num_classes = self._model_for_config.num_classes
        if mix:
            self.mixup_fn = Mixup(mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, cutmix_minmax=a.cutmix_minmax,
                                  prob=a.mixup_prob, switch_prob=a.mixup_switch_prob, mode=a.mixup_mode,
                                  label_smoothing=a.smoothing, num_classes=num_classes)
        from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
        if mix:
            self.loss_fn = SoftTargetCrossEntropy()
        elif a.smoothing:
            self.loss_fn = LabelSmoothingCrossEntropy(smoothing=a.smoothing)
        else:
            self.loss_fn = nn.CrossEntropyLoss()
        if eval_ds is not None:
            eval_ds.transform = create_transform(cfg["input_size"], is_training=False,
                                                 interpolation=cfg["interpolation"], mean=cfg["mean"],
                                                 std=cfg["std"], crop_pct=cfg["crop_pct"])
        return self._loaders(train_ds, eval_ds, held)

    # ----- steps -----
    def train_step(self, model: nn.Module, batch: Any) -> Tuple[torch.Tensor, Dict[str, float]]:
        dev = self.dist.device
        x, y = batch[0].to(dev, non_blocking=True), batch[1].to(dev, non_blocking=True)
        if self.mixup_fn is not None:
            x, y = self.mixup_fn(x, y)
        return self.loss_fn(model(x), y), {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Iterable) -> Dict[str, float]:
        from timm.utils import accuracy
        dev = self.dist.device
        loss_sum = c1 = c5 = n = 0.0
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            out = model(x).float()
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
            acc1, acc5 = accuracy(out, y, topk=(1, min(5, out.shape[-1])))  # percentages of this batch
            c1 += round(acc1.item() * len(y) / 100.0)
            c5 += round(acc5.item() * len(y) / 100.0)
            n += len(y)
        loss_sum, c1, c5, n = all_reduce_sum([loss_sum, c1, c5, n], dev)
        if n == 0:
            raise ValueError("The evaluation set is empty.")
        return {"loss": loss_sum / n, "top1": 100.0 * c1 / n, "top5": 100.0 * c5 / n}
