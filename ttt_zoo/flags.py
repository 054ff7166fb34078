"""The range of every numeric command-line flag, declared beside the flag and checked here.

A flag's ``type=`` is a :class:`Range` (``p.add_argument("--lr", type=Range(float, gt=0, le=100))``): argparse calls
it on the text, so a value outside the range is argparse's one-line error naming the flag.  Values that do not come
through the text (a ``-c`` YAML file's) are checked by :func:`check_ranges`.  ``--model-kwargs`` sizes are capped by
:data:`MODEL_KWARG_RANGES` (:func:`check_model_kwargs`), before a model is built.  ``tests/test_flag_ranges.py`` walks
every numeric flag of every command with a value below and above its range.
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Dict, Mapping, Optional

from .errors import UsageError

__all__ = ["Range", "SizeRange", "check_ranges", "check_model_kwargs", "model_kwargs_problem", "ModelKwargs",
           "MODEL_KWARG_RANGES", "NOT_MODEL_KWARGS", "MAX_IMG_SIDE", "MAX_SEED", "MEAN", "STD", "CROP_PCT", "range_of",
           "out_of_memory"]

MAX_IMG_SIDE = 8192  # the largest image side a command accepts
MAX_EXPORT_SIDE = 4096  # the largest image side an exported graph is declared for (ttt_zoo.export)
MAX_SEED = 2 ** 32 - 1  # numpy's seeds
#: the op backends (``--backend``, ``TTT_ZOO_BACKEND``; ttt_zoo.kernels.backend reads them here, so --help needs no torch)
TRITON_BACKEND = "triton"
BACKENDS = ("auto", "torch", "torch_naive", TRITON_BACKEND)


def _num(v) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


class Range:
    """An argparse ``type`` of a number in a range: ``ge``/``gt`` below, ``le``/``lt`` above (all finite), and a
    ``hint`` added to the error (e.g. how to turn the feature off)."""

    def __init__(self, kind: type, *, ge=None, gt=None, le=None, lt=None, hint: str = ""):
        assert kind in (int, float) and (ge is None or gt is None) and (le is None or lt is None)
        assert (ge is not None or gt is not None) and (le is not None or lt is not None), "give both bounds"
        self.kind, self.ge, self.gt, self.le, self.lt, self.hint = kind, ge, gt, le, lt, hint
        self.__name__ = kind.__name__  # argparse names the type in "invalid int value"

    def text(self, name: str = "value") -> str:
        """``0 <= value < 1``"""
        lo = f"{_num(self.ge)} <= " if self.ge is not None else f"{_num(self.gt)} < "
        hi = f" <= {_num(self.le)}" if self.le is not None else f" < {_num(self.lt)}"
        return f"{lo}{name}{hi}"

    def problem(self, v, name: str = "value") -> Optional[str]:
        """Why ``v`` is refused, or None."""
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (self.kind is int and not float(v).is_integer()):
            return f"{v!r} is not {'an integer' if self.kind is int else 'a number'}; give {self.text(name)}"
        if not math.isfinite(v):
            return f"{v} is not a finite number; give {self.text(name)}"
        if ((self.ge is not None and v < self.ge) or (self.gt is not None and v <= self.gt)
                or (self.le is not None and v > self.le) or (self.lt is not None and v >= self.lt)):
            return f"{v} is out of range; give {self.text(name)}{self.hint}"
        return None

    def __call__(self, text: str):
        try:
            v = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if self.kind is int else 'a number'}; "
                                             f"give {self.text()}{self.hint}") from None
        why = self.problem(v)
        if why:
            raise argparse.ArgumentTypeError(why)
        return v

    def outside(self):
        """A value just below and one just above the range (for the tests)."""
        lo = self.ge - 1 if self.ge is not None else self.gt - (1 if self.kind is int else 0)
        hi = self.le + 1 if self.le is not None else self.lt + (1 if self.kind is int else 0)
        if self.kind is float and self.ge is not None:
            lo = self.ge - max(abs(self.ge), 1) * 0.5
        if self.kind is float and self.le is not None:
            hi = self.le + max(abs(self.le), 1) * 0.5
        return lo, hi

    def __repr__(self) -> str:
        return f"Range({self.kind.__name__}, {self.text()})"


class SizeRange(Range):
    """An image size: ``224`` -> (224, 224) or ``384x320`` -> (384, 320), each side in the range."""

    def __init__(self, le: int = MAX_IMG_SIDE):
        super().__init__(int, ge=1, le=le)
        self.__name__ = "size"

    def text(self, name: str = "side") -> str:
        return f"{super().text(name)} (224, or HEIGHTxWIDTH such as 384x320)"

    def __call__(self, text: str):
        parts = str(text).lower().split("x")
        if len(parts) not in (1, 2):
            raise argparse.ArgumentTypeError(f"bad image size {text!r}: give {self.text()}")
        try:
            hw = [super(SizeRange, self).__call__(p) for p in parts]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"bad image size {text!r}: {e}") from None
        return (hw[0], hw[-1])

    def problem(self, v, name: str = "side") -> Optional[str]:
        sides = v if isinstance(v, (tuple, list)) else [v]
        return next((p for p in (super(SizeRange, self).problem(s, name) for s in sides) if p), None)


# ----- preprocessing numbers: one range for the flags (--mean, --std, --crop-pct) and a Hub config.json -----

MEAN = Range(float, ge=0, le=1)  # of pixels in [0, 1]
STD = Range(float, ge=1e-3, le=10, hint=" (a smaller std scales pixels past 1000x)")
CROP_PCT = Range(float, ge=0.5, le=1, hint=" (the resize before the crop is side / crop_pct; timm's models use "
                                           "0.875 to 1)")


def range_of(action: argparse.Action) -> Optional[Range]:
    """The declared range of a parsed flag, or None."""
    return action.type if isinstance(action.type, Range) else None


def check_ranges(parser: argparse.ArgumentParser, args: argparse.Namespace, source: str = "") -> None:
    """Check the values that did not come through argparse's ``type`` (e.g. a ``-c`` YAML file's defaults):
    argparse's one-line error naming the flag."""
    for action in parser._actions:
        rng = range_of(action)
        value = getattr(args, action.dest, None)
        if rng is None or value is None or isinstance(value, str):  # a string went through the type already
            continue
        for v in (value if isinstance(value, (list, tuple)) and not isinstance(rng, SizeRange) else [value]):
            flag = max(action.option_strings, key=len)
            why = rng.problem(v, flag.lstrip("-").replace("-", "_"))
            if why:
                parser.error(f"argument {flag}: {why}{source}")


# ----- --model-kwargs: caps on the sizes of a model, checked before it is built -----

_UNIT = Range(float, ge=0, lt=1)
MODEL_KWARG_RANGES: Dict[str, Range] = {
    "depth": Range(int, ge=1, le=1000), "depths": Range(int, ge=1, le=1000),
    "embed_dim": Range(int, ge=1, le=16384), "embed_dims": Range(int, ge=1, le=16384),
    "hidden_size": Range(int, ge=1, le=16384), "num_heads": Range(int, ge=1, le=1024),
    "patch_size": Range(int, ge=1, le=1024), "mlp_ratio": Range(float, gt=0, le=64),
    "img_size": Range(int, ge=1, le=MAX_IMG_SIDE), "input_size": Range(int, ge=1, le=MAX_IMG_SIDE),
    "in_chans": Range(int, ge=1, le=1024), "num_classes": Range(int, ge=0, le=1_000_000),
    "drop_rate": _UNIT, "drop_path_rate": _UNIT, "attn_drop_rate": _UNIT, "proj_drop_rate": _UNIT,
}
_MAX_PARAMS = 100e9  # about 12 * depth * width^2 weights; more does not fit any machine we run on
_FEATURES = "the commands use the classifier; feature maps are for Python: timm.create_model(NAME, features_only=True)"
_WEIGHTS = "give the weights with --pretrained, --checkpoint or --initial-checkpoint"
#: timm's create_model options that are no constructor sizes: the commands set them (key -> what to do instead)
NOT_MODEL_KWARGS: Dict[str, str] = {
    "features_only": _FEATURES, "out_indices": _FEATURES, "feature_cls": _FEATURES, "feature_cfg": _FEATURES,
    "device": "the commands place the model themselves: use --device",
    "dtype": "the commands pick the precision: use --amp", "pretrained": _WEIGHTS, "pretrained_cfg": _WEIGHTS,
    "pretrained_cfg_overlay": _WEIGHTS, "checkpoint_path": _WEIGHTS, "cache_dir": _WEIGHTS,
}


def model_kwargs_problem(kwargs: Mapping[str, Any]) -> Optional[str]:
    """Why these constructor arguments are refused (a create_model option of :data:`NOT_MODEL_KWARGS`, a size
    outside :data:`MODEL_KWARG_RANGES`, each element of a list, or weights alone, about 12 x depth x width^2, past
    100 billion), or None."""
    for key in kwargs:
        if key in NOT_MODEL_KWARGS:
            return f"{key}={kwargs[key]!r} is not a constructor argument; {NOT_MODEL_KWARGS[key]}"
    for key, value in kwargs.items():
        rng = MODEL_KWARG_RANGES.get(key)
        if rng is None or value is None:
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            why = rng.problem(v, key)
            if why:
                return f"{key}={value!r}: {why}"
    depth = kwargs.get("depth") or sum(v for v in (kwargs.get("depths") or []) if isinstance(v, int)) or None
    width = kwargs.get("embed_dim") or kwargs.get("hidden_size")
    if isinstance(depth, int) and isinstance(width, int) and 12 * depth * width ** 2 > _MAX_PARAMS:
        return (f"depth {depth} x width {width}: about {12 * depth * width ** 2 / 1e9:.0f} billion weights, more "
                f"than any machine holds; give a smaller depth or width")
    return None


def check_model_kwargs(kwargs: Mapping[str, Any], flag: str = "--model-kwargs") -> None:
    """:func:`model_kwargs_problem` as a :class:`UsageError` naming ``flag``."""
    why = model_kwargs_problem(kwargs)
    if why:
        raise UsageError(f"{flag} {why}")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ``(default: X)`` after each flag's help, once: not where the help already speaks of its default
    (``"(default: the model's)"``, ``"off by default"``), nor for a default that says nothing (None, False, '')."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, "", [], {}):
            return text
        return super()._get_help_string(action)


class ModelKwargs(argparse.Action):
    """timm's ``ParseKwargs`` (``K=V``, values as Python literals, else strings), then the sizes checked by
    :func:`model_kwargs_problem` (argparse's one-line error naming the flag).  timm is imported when a value is
    parsed, not when a parser is built (``--help`` imports no torch)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from timm.utils import ParseKwargs
        if any("=" not in v for v in values if v):
            raise argparse.ArgumentError(self, f"expected KEY=VALUE, got {[v for v in values if '=' not in v]}")
        ParseKwargs.__call__(self, parser, namespace, values, option_string)
        why = model_kwargs_problem(getattr(namespace, self.dest))
        if why:
            raise argparse.ArgumentError(self, why)


# ----- out of memory: the one line the command boundary prints for an allocation that failed -----

_OOM_TEXT = ("can't allocate memory", "out of memory", "Cannot allocate memory")


def out_of_memory(e: BaseException, img_size: Any = None, batch_size: Optional[int] = None) -> Optional[str]:
    """The message for a failed allocation (``MemoryError``, torch's ``OutOfMemoryError`` or CPU allocator error),
    or None for any other error: how much was asked for, and the image size / batch size that quarter the need
    (memory grows with the image area and the batch)."""
    text = str(e)
    if not (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
            or (isinstance(e, RuntimeError) and any(t in text for t in _OOM_TEXT))):
        return None
    import re
    asked = re.search(r"allocate (\d+) bytes", text) or re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]iB)", text)
    what = "" if asked is None else (f" allocating {int(asked.group(1)) / 2 ** 30:.1f} GiB"
                                     if asked.group(1).isdigit() else f" allocating {asked.group(1)}")
    device = "GPU memory" if "CUDA" in text or type(e).__name__ == "OutOfMemoryError" else "memory"
    sides = tuple(img_size) if isinstance(img_size, (tuple, list)) else (img_size,) if img_size else ()
    show = lambda hw: str(hw[0]) if len(set(hw)) == 1 else "x".join(map(str, hw))  # noqa: E731
    at = ", ".join(x for x in (f"--img-size {show(sides)}" if sides else "",
                               f"-b {batch_size}" if batch_size else "") if x)
    fixes = [f"--img-size {show(tuple(max(v // 2, 1) for v in sides))} (a quarter of the memory)"] if sides else []
    fixes += [f"-b {max(batch_size // 4, 1)}"] if batch_size and batch_size > 1 else []
    how = " or ".join(fixes) if fixes else "a smaller --img-size or -b"
    return (f"out of {device}{what}{f' at {at}' if at else ''}: memory grows with the image area and the batch "
            f"size; give {how}")
