"""Behaviour snapshot of every registered ttt-zoo model, to prove a refactor changes nothing.

    python tools/snapshot_models.py save  DIR [--models vit3_tiny ...]   # before the refactor
    python tools/snapshot_models.py check DIR [--models ...]             # after: compare, exit 1 on a difference

Recorded per model: parameter count, state-dict keys with shapes and dtypes, pretrained-cfg fields, the seeded
initial weights (a float64 checksum per tensor), seeded outputs on a fixed input (``forward``, ``forward_features``
and, for image models, ``features_only`` maps) twice: under the seeded init, and under weights derived from each
key's name (so a change of parameter creation order shows up apart from a change of the forward), and the messages
of a fixed set of bad calls.  ``check`` compares outputs at 1e-6 relative (a reordered reduction may move the last
bits), everything else exactly.
"""
import argparse
import json
import os
import sys
import zlib

import torch

_BAD_CALLS = {
    "odd_size": lambda m, c: m(torch.randn(1, c, 37, 41)),
    "wrong_channels": lambda m, c: m(torch.randn(1, c + 2, 64, 64)),
    "three_dims": lambda m, c: m(torch.randn(c, 64, 64)),
}


def _models(names):
    import ttt_zoo
    return names or ttt_zoo.list_zoo_models(include_diffusion=True)


def _is_diffusion(name):
    import ttt_zoo
    return ttt_zoo.is_diffusion_model(name)


def _key_weights(model):
    """Weights that depend on each key's name only: norm-like 1-d weights near 1, everything else small."""
    out = {}
    for k, v in model.state_dict().items():
        if not v.is_floating_point():
            out[k] = v
            continue
        g = torch.Generator().manual_seed(zlib.crc32(k.encode()))
        r = torch.randn(v.shape, generator=g, dtype=torch.float64)
        base = 1.0 if (v.dim() == 1 and k.endswith("weight")) else 0.0
        out[k] = (base + 0.02 * r).to(v.dtype)
    return out


def _inputs(name, model):
    g = torch.Generator().manual_seed(0)
    if _is_diffusion(name):
        c, h, w = model.pretrained_cfg["input_size"]
        x = torch.randn(2, c, h, w, generator=g)
        return (x, torch.tensor([10.0, 500.0]), torch.tensor([3, 7]))
    return (torch.randn(2, 3, 96, 64, generator=g),)


def _outputs(name, model):
    model.eval()
    args = _inputs(name, model)
    res = {}
    with torch.no_grad():
        res["forward"] = model(*args)
        if not _is_diffusion(name):
            res["forward_features"] = model.forward_features(*args)
    return res


def _record(name):
    try:
        return _record_model(name)
    except Exception as e:  # noqa: BLE001 - a model that cannot run at its default size is recorded as such
        return {"failure": f"{type(e).__name__}: {e}"}, {}


def _record_model(name):
    import timm
    torch.manual_seed(0)
    model = timm.create_model(name)
    sd = model.state_dict()
    rec = {
        "params": sum(p.numel() for p in model.parameters()),
        "keys": {k: [list(v.shape), str(v.dtype)] for k, v in sd.items()},
        "cfg": {k: (list(v) if isinstance(v, tuple) else v) for k, v in model.pretrained_cfg.items()
                if k in ("input_size", "num_classes", "mean", "std", "crop_pct", "first_conv", "classifier", "url",
                         "hf_hub_id", "license")},
        "init": {k: float(v.double().sum()) + float(v.double().abs().sum()) for k, v in sd.items()
                 if v.is_floating_point()},
    }
    tensors = {f"{name}/init/{k}": v for k, v in _outputs(name, model).items()}
    model.load_state_dict(_key_weights(model))
    tensors.update({f"{name}/keyw/{k}": v for k, v in _outputs(name, model).items()})
    if not _is_diffusion(name):
        fm = timm.create_model(name, features_only=True)
        fm.load_state_dict(_key_weights(fm))
        with torch.no_grad():
            for i, f in enumerate(fm.eval()(*_inputs(name, fm))):
                tensors[f"{name}/keyw/features{i}"] = f
        rec["feature_info"] = [dict(f) for f in fm.feature_info.get_dicts()]
    errors = {}
    c = model.pretrained_cfg["input_size"][0]
    for bad, call in _BAD_CALLS.items():
        if _is_diffusion(name):
            continue
        try:
            with torch.no_grad():
                call(model, c)
            errors[bad] = None
        except Exception as e:  # noqa: BLE001 - the message is what is recorded
            errors[bad] = f"{type(e).__name__}: {e}"
    rec["errors"] = errors
    return rec, {k: v.contiguous() for k, v in tensors.items()}


def _rel(a, b):
    """max|a - b| / max|b| over the finite entries; inf when the NaN/inf pattern differs."""
    a, b = a.double(), b.double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa].nan_to_num(), b[~fb].nan_to_num()):
        return float("inf")
    a, b = a[fa], b[fb]
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def main(argv=None):
    from safetensors.torch import load_file, save_file
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["save", "check"])
    p.add_argument("dir")
    p.add_argument("--models", nargs="*")
    p.add_argument("--resume", action="store_true", help="save: skip models already in DIR")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    os.makedirs(a.dir, exist_ok=True)
    bad = 0
    for name in _models(a.models):
        jpath, tpath = os.path.join(a.dir, f"{name}.json"), os.path.join(a.dir, f"{name}.safetensors")
        if a.mode == "save" and a.resume and os.path.exists(jpath):
            continue
        rec, tens = _record(name)
        if a.mode == "save":
            from ttt_zoo.fileio import atomic_path, atomic_write
            if tens:
                with atomic_path(tpath) as tmp:
                    save_file(tens, tmp)
            atomic_write(jpath, json.dumps(rec, indent=1, sort_keys=True))
            print(f"saved {name}")
            continue
        old = json.load(open(jpath))
        new = json.loads(json.dumps(rec))
        diffs = [k for k in sorted(set(old) | set(new)) if k != "init" and old.get(k) != new.get(k)]
        oi, ni = old.get("init", {}), new.get("init", {})  # float64 sums: the thread count may move the last bits
        if set(oi) != set(ni) or any(abs(oi[k] - ni[k]) > 1e-12 * max(1.0, abs(oi[k])) for k in oi):
            diffs.append("init")
        old_t = load_file(tpath) if os.path.exists(tpath) else {}
        if set(old_t) != set(tens):
            diffs.append(f"output set {sorted(set(old_t) ^ set(tens))}")
        worst = 0.0
        for k in set(old_t) & set(tens):
            if old_t[k].shape != tens[k].shape:
                diffs.append(f"{k} shape {list(old_t[k].shape)} -> {list(tens[k].shape)}")
                continue
            r = _rel(tens[k], old_t[k])
            worst = max(worst, r)
            if not r <= 1e-6:
                diffs.append(f"{k} rel {r:.2e}")
        bad += bool(diffs)
        print(f"{'DIFF' if diffs else 'same'} {name} (outputs max rel {worst:.1e})" + "".join(f"\n   {d}" for d in diffs))
    if a.mode == "check":
        print(f"{bad} model(s) differ")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
