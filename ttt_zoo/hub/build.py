"""Building a model from a checkpoint for a Hub folder (with the ``checkpoint_filter_fn`` beside each model), the
architectures a folder may hold (the zoo's registry plus non-timm ones registered with
:func:`register_hub_architecture`), example inputs and measurements (parameters, GMACs)."""
from __future__ import annotations

import copy
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ttt_zoo.checkpoint import HUB_ORG, CheckpointError, WeightsError, load_checkpoint_file, unwrap_checkpoint
from ttt_zoo.errors import HubFolderError

__all__ = ["HubArchitecture", "register_hub_architecture", "hub_architectures", "zoo_architectures",
           "registered_pretrained", "hub_repo_id", "split_name", "registered_cfg", "check_tag",
           "build_from_checkpoint", "example_inputs", "flat_outputs", "measure"]

#: the GitHub repo torch.hub loads ``hubconf.py`` from (set when the project has its public home)
GITHUB_REPO = "ttt-zoo/ttt-zoo"


def hub_repo_id(name: str, org: str = HUB_ORG) -> str:
    """'vit3_tiny.in1k' -> 'ttt-zoo/vit3_tiny.in1k' (timm's own scheme, with our organisation)."""
    return f"{org}/{name}"


def _zoo_models() -> List[str]:
    from ttt_zoo.registry import list_zoo_models
    return list_zoo_models(include_diffusion=True)


def registered_pretrained() -> List[str]:
    """Every ``model.tag`` of ttt-zoo's registry that has released weights (a url or a hub id)."""
    import timm
    zoo = set(_zoo_models())
    return sorted(n for n in timm.list_models(pretrained=True) if n.partition(".")[0] in zoo)


# ----- architectures that are not timm models -----

@dataclass
class HubArchitecture:
    """A non-timm architecture a hub folder can hold (e.g. an mmdet/mmseg backbone)."""
    name: str
    build: Callable[..., nn.Module]
    filter_fn: Callable[[Dict[str, Any], nn.Module], Dict[str, torch.Tensor]]
    default_args: Dict[str, Any] = field(default_factory=dict)
    kind: str = "backbone"
    description: str = ""
    pretrained_cfg: Dict[str, Any] = field(default_factory=dict)


_HUB_ARCHS: Dict[str, HubArchitecture] = {}


def register_hub_architecture(arch: HubArchitecture) -> HubArchitecture:
    _HUB_ARCHS[arch.name] = arch
    return arch


def hub_architectures() -> Dict[str, HubArchitecture]:
    """The registered non-timm architectures, by name."""
    return dict(_HUB_ARCHS)


def zoo_architectures() -> List[str]:
    """Every name a folder's ``architecture`` may take: the zoo's timm models and the non-timm architectures."""
    return _zoo_models() + sorted(_HUB_ARCHS)


def _register_backbones() -> None:
    from ttt_zoo.models.hvit3 import HVIT3_SIZES, HViT3Backbone, backbone_filter_fn
    for size, cfg in HVIT3_SIZES.items():  # heads follow the widths (head dim 32), so a width override stays valid
        args = dict(embed_dim=cfg["embed_dim"], depths=cfg["depths"])
        register_hub_architecture(HubArchitecture(
            name=f"hvit3_backbone_{size}", build=HViT3Backbone, filter_fn=backbone_filter_fn, default_args=args,
            description=("H-ViT3 dense-prediction backbone (the authors' mmdet/mmseg `ViTTT` layout): four stages of "
                         "ViT3 TTT blocks, LayerNorm'ed outputs at strides 4/8/16/32, any input size."),
            pretrained_cfg=dict(license="apache-2.0", paper_ids="arXiv:2512.01643",
                                paper_name="ViT3: Unlocking Test-Time Training in Vision",
                                origin_url="https://github.com/LeapLabTHU/ViTTT",
                                input_size=(3, 224, 224), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                                interpolation="bicubic", crop_pct=1.0)))


_register_backbones()


# ----- building a model from a checkpoint -----

def split_name(name: str) -> Tuple[str, str]:
    """'vit3_tiny.digits' -> ('vit3_tiny', 'digits')."""
    arch, _, tag = name.partition(".")
    return arch, tag


_split = split_name
_TAG_CHARS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
def registered_cfg(name: str) -> Optional[Dict[str, Any]]:
    """timm's pretrained cfg of ``model.tag`` (or of the model's default tag), or None for a tag it does not know
    (a user's own tag, e.g. 'vit3_tiny.digits')."""
    from timm.models import get_pretrained_cfg
    try:
        cfg = get_pretrained_cfg(name)
    except RuntimeError:  # 'Invalid pretrained tag'
        return None
    return cfg.to_dict() if cfg is not None else None


def check_tag(tag: str) -> str:
    """A tag usable in a hub id (``ORG/model.tag``): letters, digits, '_' and '-'."""
    if not _TAG_CHARS.match(tag):
        raise HubFolderError(f"Invalid tag {tag!r}: use letters, digits, '_' and '-' (e.g. 'digits', 'ft_cifar10').")
    return tag


def _checkpoint_weight(name: str, checkpoint: Dict[str, Any], cfg_key: str, dim: int) -> Optional[torch.Tensor]:
    """The checkpoint's weight of the module the pretrained cfg names under ``cfg_key`` ('classifier',
    'first_conv'), if it has ``dim`` dimensions."""
    module = (registered_cfg(name) or registered_cfg(_split(name)[0]) or {}).get(cfg_key)
    try:
        w = unwrap_checkpoint(checkpoint).get(f"{module}.weight") if isinstance(module, str) else None
    except CheckpointError:
        return None
    return w if w is not None and w.dim() == dim else None


def _checkpoint_classes(name: str, checkpoint: Dict[str, Any]) -> Optional[int]:
    """Rows of the checkpoint's classifier (named by the pretrained cfg), e.g. 10 for a 10-class fine-tune."""
    w = _checkpoint_weight(name, checkpoint, "classifier", 2)
    return int(w.shape[0]) if w is not None else None


def build_from_checkpoint(name: str, checkpoint: Any, model_args: Optional[Dict[str, Any]] = None,
                          source: str = "checkpoint") -> Tuple[nn.Module, Dict[str, Any]]:
    """Build ``name`` (``model`` or ``model.tag``) and load ``checkpoint`` (a path or a loaded dict) strictly.

    timm models load through timm's own path (``create_model(pretrained=True)`` with the checkpoint as the
    pretrained cfg's ``state_dict``: ``build_model_with_cfg`` -> ``load_pretrained`` -> the model file's
    ``checkpoint_filter_fn``); the classifier is built with the checkpoint's number of classes unless
    ``model_args`` sets ``num_classes``.  A tag timm does not know (a user's own, e.g. 'vit3_tiny.digits') builds
    the model's default cfg renamed to that tag, without the authors' weight locations.  Returns (model in eval
    mode, the constructor arguments used)."""
    import timm
    if isinstance(checkpoint, str):
        source, checkpoint = checkpoint, load_checkpoint_file(checkpoint)
    model_args = dict(model_args or {})
    arch, tag = _split(name)
    if tag:
        check_tag(tag)
    if arch not in _HUB_ARCHS and arch not in _zoo_models():
        known = ", ".join(_zoo_models() + sorted(_HUB_ARCHS))
        raise CheckpointError(f"Unknown model {arch!r}. ttt-zoo models: {known}.")
    try:
        if arch in _HUB_ARCHS:  # not a timm model: build, filter, load strictly
            spec = _HUB_ARCHS[arch]
            model = spec.build(**dict(spec.default_args, **model_args))
            model.load_state_dict(spec.filter_fn(checkpoint, model))
        else:
            n = _checkpoint_classes(name, checkpoint)
            if n is not None:
                model_args.setdefault("num_classes", n)
            overlay = dict(state_dict=checkpoint, **({"num_classes": n} if n is not None else {}))
            conv = _checkpoint_weight(name, checkpoint, "first_conv", 4)
            if conv is not None and model_args.get("in_chans") == conv.shape[1]:  # e.g. a 1-channel fine-tune
                size = (registered_cfg(name) or registered_cfg(arch) or {}).get("input_size") or (3, 224, 224)
                overlay["input_size"] = (conv.shape[1], *size[1:])  # its weights as they are, not adapted by timm
            variant = name
            if tag and registered_cfg(name) is None:  # a custom tag: not the authors' release
                overlay.update(tag=tag, url=None, hf_hub_id=None, hf_hub_filename=None, file=None)
                variant = arch
            model = timm.create_model(variant, pretrained=True, pretrained_cfg_overlay=overlay, **model_args)
    except TypeError as e:
        raise CheckpointError(f"Bad --model-args for {arch}: {e}") from e
    except WeightsError:  # damaged weights: said as they are (the file and the tensor), not as another model
        raise
    except CheckpointError as e:
        why = str(e).split(" Build the model that matches")[0]
        raise CheckpointError(f"{source} is not a checkpoint for {name}: {why} Pass the --model (see `ttt-zoo list`) "
                              f"and --model-kwargs K=V (or --model-args JSON) that match the checkpoint.") from e
    except RuntimeError as e:  # load_state_dict(strict=True)
        raise CheckpointError(f"{source} does not fit {name} (built with {model_args}): "
                              f"{str(e).splitlines()[-1].strip()}") from e
    return model.eval(), model_args


# ----- inputs, measurements -----

def example_inputs(model: nn.Module, batch: int = 1, device: Any = "cpu", seed: int = 0,
                   input_size: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, ...]:
    """Inputs for ``model``: its own ``example_inputs(batch)`` if it has one, else an image batch of the
    pretrained cfg's size, plus DiT-style ``t`` (timesteps) and ``y`` (labels) when ``forward`` takes them."""
    if hasattr(model, "example_inputs"):
        return tuple(model.example_inputs(batch))
    g = torch.Generator().manual_seed(seed)
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    c, h, w = input_size or cfg.get("input_size", (getattr(model, "in_chans", 3), 224, 224))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    x = torch.randn(batch, c, h, w, generator=g).to(device=device, dtype=dtype)
    params = list(inspect.signature(model.forward).parameters)
    if params[:3] == ["x", "t", "y"]:
        t = torch.randint(0, 1000, (batch,), generator=g).to(device)
        y = torch.randint(0, max(int(getattr(model, "num_classes", 1000)), 1), (batch,), generator=g).to(device)
        return x, t, y
    return (x,)


def flat_outputs(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flat_outputs(o)]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in flat_outputs(out[k])]
    return []


def measure(model: nn.Module, input_size: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Parameters and GMACs (``torch.utils.flop_counter`` FLOPs / 2) for one sample, counted on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode
    params = sum(p.numel() for p in model.parameters())
    meta = copy.deepcopy(model).to("meta").eval()
    inputs = tuple(t.to("meta") for t in example_inputs(model, 1, input_size=input_size))
    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.no_grad():
            meta(*inputs)
        macs = counter.get_total_flops() / 2e9
    except Exception:  # noqa: BLE001 - a model that cannot run on meta simply gets no GMACs on its card
        macs = None
    return dict(params=params, macs=macs, macs_input=list(inputs[0].shape[1:]))


