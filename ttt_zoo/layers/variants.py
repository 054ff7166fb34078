"""The paper-variant options every TTT mixer takes ("TTT with KV Binding Is Secretly Linear Attention", Liu et al.,
Tables 1-2 and Figure 1): their names, the baseline values and the checks, in one place beside the mixer interface.

A mixer takes them as constructor keywords and says which apply to it (the others raise, naming why):

- ``inner_update``: ``'all'``, or ``'last'`` (Table 2, Variant 1: only the last inner layer steps);
- ``inner_model``: the mixer's own inner model, or ``'linear'`` (Table 2, Variant 3: one linear inner layer);
- ``normalize_grad``: gradient normalisation of the inner step (Table 2, Variant 6 switches it off);
- ``gradient_ascent``: the inner step goes up the gradient (Table 1);
- ``share_qk``: queries replaced by keys (Table 1, "Replace Q with K");
- ``inner_steps``: k inner steps before the read (Figure 1), an integer >= 1, settable after construction
  (``mixer.inner_steps = k`` or ``mixer.set_inner_steps(k)``; :class:`VariantOptions` checks every assignment).
"""

import operator
from typing import Any, Optional, Tuple

from torch import nn

__all__ = ["VARIANT_OPTIONS", "INNER_UPDATES", "VariantOptions", "check_inner_steps", "check_variant_options",
           "init_plain_step_variant"]

#: the options' names and their values in the papers' own models (ViT3's own inner model is ``'swiglu'`` and it
#: normalises its gradient: its mixer states those two defaults itself)
VARIANT_OPTIONS = dict(inner_update="all", inner_model=None, normalize_grad=False, gradient_ascent=False,
                       share_qk=False, inner_steps=1)
INNER_UPDATES = ("all", "last")


def check_inner_steps(mixer: str, steps: Any) -> int:
    """``steps`` as an int: a whole number >= 1 (a Python or NumPy integer; not a bool, not a float)."""
    try:
        ok = not isinstance(steps, bool) and operator.index(steps) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{mixer}: inner_steps must be an integer >= 1 (1, 2, 3, ...; not a bool or a float), "
                         f"got {steps!r}")
    return operator.index(steps)


def check_variant_options(mixer: str, inner_update: str, inner_model: Optional[str],
                          inner_models: Tuple[Optional[str], ...], inner_steps: Any) -> int:
    """Check ``inner_update``, ``inner_model`` (one of the mixer's ``inner_models``, its default first) and
    ``inner_steps``; returns the step count as an int."""
    if inner_update not in INNER_UPDATES:
        raise ValueError(f"{mixer}: inner_update must be one of {INNER_UPDATES} ('last': Table 2's Variant 1), "
                         f"got {inner_update!r}")
    if inner_model not in inner_models:
        raise ValueError(f"{mixer}: inner_model must be one of {inner_models} ({inner_models[0]!r}, the default: "
                         f"the mixer's own; 'linear': Table 2's Variant 3), got {inner_model!r}")
    return check_inner_steps(mixer, inner_steps)


def init_plain_step_variant(mixer: nn.Module, inner_update: str, inner_model: Optional[str], normalize_grad: bool,
                            gradient_ascent: bool, share_qk: bool, inner_steps: Any) -> None:
    """Check and set the variant options of a mixer whose inner step is a plain gradient step on a SwiGLU / MLP
    inner model (T5, DiT5): ``inner_update``, ``inner_model`` (``None`` or ``'linear'``), ``linear``,
    ``gradient_ascent``, ``share_qk``, ``inner_steps``."""
    name = type(mixer).__name__
    check_variant_options(name, inner_update, inner_model, (None, "linear"), inner_steps)
    if normalize_grad:
        raise ValueError(f"{name}: normalize_grad=True does not apply: its inner step is a plain gradient step "
                         f"without gradient normalisation (Table 2's Variant 6 is already the baseline).")
    if inner_model == "linear" and inner_update == "last":
        raise ValueError(f"{name}: inner_model='linear' has a single layer; inner_update='last' does not apply")
    mixer.inner_update = inner_update
    mixer.inner_model = inner_model
    mixer.linear = inner_model == "linear"
    mixer.gradient_ascent = gradient_ascent
    mixer.share_qk = share_qk
    mixer.inner_steps = inner_steps


class VariantOptions:
    """Mixin of the mixers that take the variant options: every assignment of ``inner_steps`` is checked
    (:func:`check_inner_steps`), and ``set_inner_steps`` is the method :func:`ttt_zoo.layers.mixer.set_inner_steps`
    calls.  A mixer with a further rule (TTT-Linear: k steps only with the dot loss) adds it in a property setter."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "inner_steps":
            value = check_inner_steps(type(self).__name__, value)
        super().__setattr__(name, value)

    def set_inner_steps(self, steps: int) -> None:
        """Number of inner steps on (k, v) (Figure 1 of the paper varies it at inference)."""
        self.inner_steps = steps
