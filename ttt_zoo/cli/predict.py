"""``ttt-zoo predict``: top-k classes of images (a file, a folder or a glob), with the flags and result columns of
timm's ``inference.py``.

    ttt-zoo predict photo.jpg --checkpoint output/train/run1 --topk 3        # a `ttt-zoo train` folder
    ttt-zoo predict 'photos/*.jpg' --model vit3_tiny --pretrained --label-type detail --results-file top5.json
    ttt-zoo predict photos/ --checkpoint hub/vit3_tiny.digits --topk 2 --results-file preds.csv --include-index
    ttt-zoo predict photos/ --model vit3_tiny --checkpoint w.safetensors --model-kwargs depth=4 --img-size 32

Columns (timm's): ``filename``, ``index`` (with ``--include-index``, or when the classes have no names), ``label``
and ``prob`` (``logit`` with ``--output-type logit``): one value each with ``--topk 1``, a list of k with more.  JSON
(timm's layout) maps each file name to its columns; a csv cell holds one value, so a csv with ``--topk`` above 1 has
timm's ``--results-separate-col`` columns ``index_0``, ``label_0``, ``prob_0``, ...  Without ``--results-file`` /
``--results-dir`` the JSON goes to stdout only (timm's script also writes ``<model>-<img_size>.csv``).

Class names, first found: ``--class-map`` (timm's class map file: one name per line), the model's ``label_names``
(a Hub folder's config.json), the class names a `ttt-zoo train` run recorded (``run.json``; a run from before them:
its training data's class folders as they are now, said so), timm's ``ImageNetInfo`` for 1000 / 11k / 21k / 22k
classes.  Without --checkpoint the model's pretrained weights are used
(as in timm's script).
"""
import argparse
import collections
import glob
import json
import os
import sys
import re

__all__ = ["add_parser", "run", "find_images"]

#: --results-format -> file extension (timm's inference.py; 'json-record' and 'json-records' are JSON lines)
_FMT_EXT = {"csv": ".csv", "json": ".json", "json-split": ".json", "json-record": ".json", "json-records": ".json"}
_LABEL_TYPES = ("index", "none", "name", "description", "detail", "detailed")
# the flags a `ttt-zoo train` folder's recorded arguments supply (ttt_zoo.run_folder.RUN_DEFAULTS)
_RUN_FLAGS = ("model", "img_size", "num_classes", "crop_pct")


# ----- images -----

def find_images(sources):
    """The image files of each source (a file, a folder searched recursively as timm's folder reader does, or a
    glob), in timm's natural order per source."""
    from timm.data.readers.img_extensions import get_img_extensions
    from timm.data.readers.reader_image_folder import find_images_and_targets
    from timm.utils.misc import natural_key
    from ttt_zoo.train.classification import scan_folder
    from ._common import UsageError
    exts = get_img_extensions(as_set=True)
    files = []
    for src in sources:
        if any(c in src for c in "*?["):
            found = sorted((p for p in glob.glob(src, recursive=True)
                            if os.path.isfile(p) and os.path.splitext(p)[1].lower() in exts), key=natural_key)
        elif os.path.isdir(src):
            scan_folder(src)  # a symlink loop is refused (timm's walk would follow it without end)
            found = [path for path, _ in find_images_and_targets(src)[0]]
        elif os.path.isfile(src):
            found = [src]
        else:
            raise UsageError(f"{src} does not exist; give an image file, a folder of images or a glob such as "
                             f"'photos/*.jpg'")
        if not found:
            raise UsageError(f"no image matched {src}; give an image file, a folder or a glob of "
                             f"{'/'.join(sorted(e[1:] for e in exts))} files")
        files += found
    return files


class _Images:
    """(image tensor, '') or (zeros, why it cannot be read) per file: an unreadable file is reported, never
    skipped silently (timm's ImageDataset skips it, which would shift the rows).  Images are opened upright and
    8-bit (:func:`ttt_zoo.images.open_rgb`: EXIF orientation, 16-bit and palette PNGs)."""

    def __init__(self, paths, transform, input_size):
        self.paths, self.transform, self.input_size = paths, transform, tuple(input_size)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        import torch
        from PIL import Image, UnidentifiedImageError
        from ttt_zoo.images import open_rgb
        try:
            img = open_rgb(self.paths[i])
        except UnidentifiedImageError:
            return torch.zeros(self.input_size), "not an image format PIL can read"
        except (OSError, ValueError, Image.DecompressionBombError) as e:  # truncated, too large, ...
            return torch.zeros(self.input_size), str(e)
        return self.transform(img), ""


# ----- model and class names -----

def _head_rows(path, model):
    """Rows of the checkpoint's classifier (the pretrained cfg's 'classifier'), or None."""
    from ttt_zoo.checkpoint import load_checkpoint_file, unwrap_checkpoint
    head = (getattr(model, "pretrained_cfg", None) or {}).get("classifier")
    if not isinstance(head, str):
        return None
    w = unwrap_checkpoint(load_checkpoint_file(path), prefer_ema=False).get(f"{head}.weight")
    return int(w.shape[0]) if w is not None and w.dim() == 2 else None


def _run_class_names(resolved):
    """(class names in output order, where they came from) of a `ttt-zoo train` run: the names its run.json
    recorded; a run from before records none: its training split's class folders as they are now (timm's order),
    said so; (None, None) without either."""
    from timm.data.dataset_factory import _search_split
    from timm.utils.misc import natural_key
    from ttt_zoo.train.classification import scan_folder
    if resolved.class_names:
        return resolved.class_names, f"the run's recorded classes ({resolved.folder})"
    run = resolved.run
    data_dir = run.get("data_dir")
    if run.get("dataset") or not data_dir or not os.path.isdir(data_dir):
        return None, None
    root = _search_split(data_dir, run.get("train_split") or "train")
    scan = scan_folder(root)  # every class folder (an empty one would have stopped that run's training)
    names = sorted(scan.classes + scan.empty, key=natural_key)
    return (names, f"the class folders of {root} as they are now (the run recorded no class names)") if names \
        else (None, None)


def _build_model(args):
    """(model with its weights in eval mode, (a run's class names, their source) or (None, None))."""
    import timm
    import ttt_zoo  # noqa: F401 - registers the zoo's models
    from ttt_zoo import hub_format
    from ttt_zoo.hub import CONFIG_NAME, load_folder, read_config
    from ttt_zoo.run_folder import ARGS, apply_run_defaults, resolve_checkpoint, run_model_kwargs
    from ttt_zoo.train.validate import create_eval_model, load_weights
    from ._common import UsageError, model_kwargs
    kwargs, ck = model_kwargs(args), args.checkpoint
    resolved = resolve_checkpoint(ck, other_folders=True)  # a run folder or a file (checked); a Hub folder: below
    if ck and os.path.isdir(ck) and resolved.weights is None:
        if not os.path.isfile(os.path.join(ck, CONFIG_NAME)):
            raise UsageError(f"--checkpoint {ck} is a folder without {ARGS} or {CONFIG_NAME}: neither a `ttt-zoo "
                             f"train` run folder nor a Hub folder; give a weights file, a run folder or a Hub folder")
        arch = hub_format.architecture(read_config(ck))
        if args.model and args.model != arch:
            raise UsageError(f"--model {args.model} differs from the Hub folder's {arch}; leave out --model")
        args.model = arch
        return load_folder(ck, **kwargs), (None, None)  # its names: the model's label_names (config.json)
    same_model = resolved.same_model(args.model)  # another model: only the weights are shared
    kwargs = run_model_kwargs(resolved, args.model, kwargs, with_img_size=False)
    apply_run_defaults(args, resolved, _RUN_FLAGS)
    if not args.model:
        raise UsageError("no model given; give --model NAME, or --checkpoint with a `ttt-zoo train` folder or a Hub "
                         "folder")
    from ttt_zoo.registry import resolve_model_name
    resolve_model_name(args.model, "image", "--model")  # hf-hub: / local-dir: names go to timm as they are
    weights = resolved.weights
    model = create_eval_model(args.model, not weights, args.num_classes, args.img_size, kwargs)
    if weights:
        rows = _head_rows(weights, model) if args.num_classes is None else None
        if rows and rows != model.num_classes:  # e.g. a 10-class fine-tune of a 1000-class model
            model = create_eval_model(args.model, False, rows, args.img_size, kwargs)
        load_weights(model, weights)
    return model.eval(), _run_class_names(resolved) if resolved.folder and same_model else (None, None)


def _dataset_info(args, model, run_names, run_source=None):
    """timm's DatasetInfo of the model's classes and where it came from, or (None, None)."""
    from timm.data import CustomDatasetInfo, ImageNetInfo, infer_imagenet_subset
    from timm.data.readers.class_map import load_class_map
    from ._common import UsageError
    if args.class_map:
        if not os.path.isfile(args.class_map):
            raise UsageError(f"--class-map {args.class_map} does not exist; give a text file with one class name "
                             f"per line")
        return CustomDatasetInfo({i: name for name, i in load_class_map(args.class_map).items()}), args.class_map
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if cfg.get("label_names"):
        return CustomDatasetInfo(cfg["label_names"], cfg.get("label_descriptions")), "the model's label_names"
    if run_names and len(run_names) <= model.num_classes:  # (fewer: --num-classes above the class folders)
        return CustomDatasetInfo(list(run_names)), run_source or "the run's classes"
    subset = infer_imagenet_subset({"num_classes": model.num_classes})
    if subset:
        return ImageNetInfo(subset), f"timm's ImageNetInfo({subset!r})"
    return None, None


# ----- results -----

def _result_paths(args, input_size):
    """{format: path} of the results files (none without --results-file / --results-dir)."""
    from ._common import UsageError
    if not args.results_file and not args.results_dir:
        return {}
    stem, ext = os.path.splitext(args.results_file or "")
    if ext and ext.lower() not in _FMT_EXT.values():
        raise UsageError(f"--results-file {args.results_file}: the extension picks the format, .csv or .json; "
                         f"rename it or leave the extension out and give --results-format")
    formats = args.results_format or ([ext[1:].lower()] if ext else ["csv"])
    for fmt in formats:
        if fmt == "parquet":
            raise UsageError("--results-format parquet needs pandas and pyarrow, which ttt-zoo does not use; give "
                             "csv or json")
        if fmt not in _FMT_EXT:
            raise UsageError(f"--results-format {fmt} is not one of {', '.join(_FMT_EXT)}; give csv or json, or a "
                             f"--results-file ending in .csv or .json")
    if not args.results_file:  # timm's default name
        stem = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', args.model)}-{input_size[-1]}"
    if args.results_dir:
        stem = os.path.join(args.results_dir, stem)
    paths = {fmt: stem + _FMT_EXT[fmt] for fmt in formats}
    if len(set(paths.values())) < len(paths):
        raise UsageError(f"--results-format {' '.join(formats)} would write two formats to one .json file; give one "
                         f"JSON format")
    return paths


def _columns(row):
    """A csv row: each list of k values becomes k columns NAME_0 .. NAME_{k-1} (timm's --results-separate-col)."""
    out = {}
    for key, value in row.items():
        if isinstance(value, list):
            out.update({f"{key}_{i}": v for i, v in enumerate(value)})
        else:
            out[key] = value
    return out


def _render(rows, fmt, filename_col):
    """The text of a results file in timm's layout for ``fmt`` (pandas' orient='index' / 'split' / 'records')."""
    if fmt == "csv":
        import csv
        import io
        flat = [_columns(r) for r in rows]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(flat[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(flat)
        return buf.getvalue()
    from ttt_zoo.finite import json_dumps
    if fmt == "json":
        return json_dumps({r[filename_col]: {k: v for k, v in r.items() if k != filename_col} for r in rows},
                          "the predictions", indent=4) + "\n"
    if fmt == "json-split":
        return json_dumps(dict(columns=list(rows[0]), data=[list(r.values()) for r in rows]), "the predictions",
                          indent=4) + "\n"
    return "".join(json_dumps(r, "the predictions") + "\n" for r in rows)  # json-record(s): one object per line


# ----- the command -----

def _predict(model, loader, paths, args, dev, k):
    """(top-k indices, top-k probabilities or logits) of every image, as lists, and {path: why} of the images that
    cannot be read (every one is named; without --skip-bad they are an error). Outputs that are not finite are an
    error, naming the first image."""
    import torch
    from ttt_zoo.finite import FiniteCheck
    from ttt_zoo.progress import Progress
    from ttt_zoo.torchcompile import mark_step
    from ._common import UsageError
    indices, outputs, unreadable = [], [], {}
    finite = FiniteCheck()
    amp_dtype = torch.bfloat16 if dev.type == "cpu" else torch.float16
    with torch.inference_mode(), torch.autocast(dev.type, dtype=amp_dtype, enabled=args.amp), \
            Progress(len(loader), "predict", interval=50) as progress:  # (stderr: stdout may hold the results)
        for x, errors in loader:
            start = len(indices)
            unreadable.update({paths[start + j]: e for j, e in enumerate(errors) if e})
            mark_step(args.torchcompile is not None)
            out = model(x.to(dev))
            if isinstance(out, (tuple, list)):
                out = out[0]
            out = out.float()
            ok = [j for j, e in enumerate(errors) if not e]
            finite.add(out[ok], lambda i, s=start, ok=ok: paths[s + ok[i]])
            if args.output_type == "prob":
                out = out.softmax(-1)
            val, idx = out.topk(k, dim=-1)
            indices += idx.cpu().tolist()
            outputs += val.cpu().tolist()
            progress.update(items=len(errors))
    if unreadable and not args.skip_bad:
        raise UsageError(f"cannot read {len(unreadable)} of {len(paths)} image(s): "
                         + ", ".join(f"{p} ({why})" for p, why in unreadable.items())
                         + "; fix or remove them, or add --skip-bad to write the results of the others")
    finite.check()
    return indices, outputs, unreadable


def _short_float(value):
    import numpy as np
    return float(str(np.float32(value)))  # the shortest text that gives the same float32


def _printable_name(name: str) -> str:
    """A file name as UTF-8 text: bytes that are not UTF-8 (read by Python as surrogates) written as ``\\xNN``."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        escaped = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        print(f"note: {escaped}: the file name is not UTF-8; its results name it with \\xNN escapes",
              file=sys.stderr)
        return escaped


def run(args) -> int:
    import sys

    import torch
    from timm.data import DatasetInfoLabelMapper, create_transform, resolve_data_config
    from ttt_zoo.fileio import atomic_write
    from ttt_zoo.torchcompile import check_torchcompile, compile_model
    from ._common import UsageError, check_out
    check_torchcompile(args.torchcompile, args.torchcompile_mode)
    sources = list(args.data) + ([args.data_dir] if args.data_dir else [])
    if not sources:
        raise UsageError("no images given; give an image file, a folder or a glob, e.g. `ttt-zoo predict "
                         "'photos/*.jpg' --checkpoint RUN_FOLDER`")
    paths = find_images(sources)
    names = paths if args.fullname else [os.path.basename(p) for p in paths]
    twice = sorted(n for n, count in collections.Counter(names).items() if count > 1)
    if twice:
        raise UsageError(f"{len(twice)} file name(s) occur in more than one folder (e.g. {twice[0]}); add --fullname "
                         f"to name the results by path")
    if args.results_file:  # checked before the model is built (a --results-dir name needs the model's size)
        for path in _result_paths(args, (0,)).values():
            check_out(path, args.force, "--results-file")
    model, (run_names, run_source) = _build_model(args)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(dev)
    compiled = compile_model(model, args.torchcompile, args.torchcompile_mode)
    cfg = resolve_data_config(dict(img_size=args.img_size, input_size=args.input_size, crop_pct=args.crop_pct,
                                   crop_mode=args.crop_mode, interpolation=args.interpolation, mean=args.mean,
                                   std=args.std), model=model, use_test_size=True)
    out_paths = _result_paths(args, cfg["input_size"])
    for path in out_paths.values():
        check_out(path, args.force, "--results-dir" if not args.results_file else "--results-file")

    info, source = (None, None) if args.label_type in ("index", "none") else \
        _dataset_info(args, model, run_names, run_source)
    to_label = DatasetInfoLabelMapper(info, label_type=args.label_type) if info is not None else None

    dataset = _Images(paths, create_transform(**cfg), cfg["input_size"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                                         pin_memory=dev.type == "cuda")
    k = min(args.topk, model.num_classes)
    indices, outputs, unreadable = _predict(compiled, loader, paths, args, dev, k)
    if len(unreadable) == len(paths):
        raise UsageError(f"none of the {len(paths)} image(s) can be read (e.g. {paths[0]}: {unreadable[paths[0]]}); "
                         f"fix the files or give others")

    one = (lambda v: v[0]) if k == 1 else (lambda v: v)  # timm: a scalar for top-1, a list for top-k
    output_col = args.output_col or args.output_type
    rows = []
    for path, name, idx, val in zip(paths, names, indices, outputs):
        if path in unreadable:  # --skip-bad
            continue
        row = {args.filename_col: _printable_name(name)}
        if args.include_index or to_label is None:
            row[args.index_col] = one(idx)
        if to_label is not None:
            row[args.label_col] = one([to_label(i) for i in idx])
        if not args.exclude_output:
            row[output_col] = one([_short_float(v) for v in val])
        rows.append(row)
    if args.results_separate_col:
        rows = [_columns(r) for r in rows]
    for fmt, path in out_paths.items():
        atomic_write(path, _render(rows, fmt, args.filename_col))
    if not args.no_console_results:
        sys.stdout.write(_render(rows, "json", args.filename_col))
    where = f"; results written to {', '.join(out_paths.values())}" if out_paths else ""
    names_from = f", class names from {source}" if source else ""
    if unreadable:
        print(f"skipped {len(unreadable)} unreadable image(s) (--skip-bad): "
              + ", ".join(f"{p} ({why})" for p, why in unreadable.items()), file=sys.stderr)
    if info is None and args.label_type not in ("index", "none"):
        print(f"no class names for this model's {model.num_classes} classes (give --class-map FILE); the index "
              f"column names the classes", file=sys.stderr)
    print(f"{len(rows)} image(s), top-{k} of {args.model} ({cfg['input_size'][-1]}px){names_from}{where}",
          file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    from ttt_zoo import flags
    from ttt_zoo.flags import MAX_IMG_SIDE, Range
    from ttt_zoo.torchcompile import add_torchcompile_args
    from ._common import add_model_kwargs
    p = sub.add_parser("predict", help="top-k classes of images (a file, a folder or a glob), as timm's inference.py",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", nargs="*", metavar="IMAGES", help="image files, folders (searched recursively) or globs")
    p.add_argument("--data-dir", default=None, metavar="PATH", help="one more image file, folder or glob (timm's name)")
    p.add_argument("-m", "--model", default=None,
                   help="model name (timm registry, hf-hub:/local-dir: too; default: the --checkpoint folder's)")
    add_model_kwargs(p)
    p.add_argument("--checkpoint", default="", metavar="PATH",
                   help="weights file, `ttt-zoo train` folder (args.yaml) or Hub folder (config.json); without it "
                        "the pretrained weights")
    p.add_argument("--pretrained", action="store_true", help="the model's pretrained weights (the default "
                                                             "without --checkpoint, as in timm)")
    p.add_argument("--num-classes", type=Range(int, ge=1, le=1_000_000), default=None,
                   help="default: the checkpoint's classifier rows")
    p.add_argument("--class-map", default="", metavar="FILE", help="class names: one per line (timm's class map)")
    p.add_argument("--img-size", type=Range(int, ge=1, le=MAX_IMG_SIDE), default=None,
                   help="input size (default: the model's)")
    p.add_argument("--input-size", type=Range(int, ge=1, le=MAX_IMG_SIDE), nargs=3, default=None, metavar="N",
                   help="C H W, e.g. 3 224 224")
    p.add_argument("--crop-pct", type=flags.CROP_PCT, default=None,
                   help="center crop fraction (default: the model's)")
    p.add_argument("--crop-mode", default=None, help="center, squash or border (default: the model's)")
    p.add_argument("--interpolation", default="", help="resize interpolation (default: the model's)")
    p.add_argument("--mean", type=flags.MEAN, nargs="+", default=None, help="default: the model's")
    p.add_argument("--std", type=flags.STD, nargs="+", default=None, help="default: the model's")
    p.add_argument("-b", "--batch-size", type=Range(int, ge=1, le=65536), default=64)
    p.add_argument("-j", "--workers", type=Range(int, ge=0, le=256), default=2)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--amp", action="store_true", help="autocast (bfloat16 on CPU, float16 on CUDA)")
    add_torchcompile_args(p)
    p.add_argument("--topk", type=Range(int, ge=1, le=1000), default=1, metavar="N",
                   help="classes per image (default 1)")
    p.add_argument("--label-type", choices=_LABEL_TYPES, default="description",
                   help="label column: name, description or detail (timm's); index / none: no label column")
    p.add_argument("--include-index", action="store_true", help="add the class index column")
    p.add_argument("--exclude-output", action="store_true", help="leave out the prob / logit column")
    p.add_argument("--output-type", choices=("prob", "logit"), default="prob", help="softmax probabilities or logits")
    p.add_argument("--fullname", action="store_true", help="the file's path in the filename column, not its name")
    p.add_argument("--filename-col", default="filename")
    p.add_argument("--index-col", default="index")
    p.add_argument("--label-col", default="label")
    p.add_argument("--output-col", default=None, help="default: the --output-type")
    p.add_argument("--results-separate-col", action="store_true",
                   help="one column per rank (index_0, label_0, prob_0, ...) in JSON too; csv always has them")
    p.add_argument("--results-dir", default=None, metavar="DIR",
                   help="folder of the results file (default name as timm's: <model>-<img_size>.<ext>)")
    p.add_argument("--results-file", default="", metavar="FILE", help="results file (.csv or .json)")
    p.add_argument("--results-format", nargs="+", default=None, metavar="FMT",
                   help="csv, json, json-split or json-records (default: the --results-file extension, else csv)")
    p.add_argument("--no-console-results", action="store_true", help="do not print the JSON results on stdout")
    p.add_argument("--force", action="store_true", help="replace an existing results file")
    p.add_argument("--skip-bad", action="store_true",
                   help="leave out the images that cannot be read (each is named) and write the others' results")
    p.set_defaults(func=run)
