"""``ttt-zoo convert``: a checkpoint (official or ours) to a Hugging Face Hub folder with a model card."""

import contextlib
import os

from ttt_zoo.hub_format import HUB_ORG

from ._common import add_model_kwargs, cli_errors, model_kwargs

__all__ = ["add_parser"]


def _lock_output(stack: contextlib.ExitStack, out: str) -> None:
    """One convert per output folder, until it ends. The lock file is beside the folder (which is swapped in by
    rename), so a second convert to it is refused, naming the first one's PID."""
    from ttt_zoo.fileio import folder_lock
    from ttt_zoo.hub import HubFolderError
    from ttt_zoo.hub.staging import output_folder
    out = output_folder(out)  # a symlink: its target is the folder that is replaced
    try:
        stack.enter_context(folder_lock(out, "ttt-zoo convert", beside=True))
    except OSError as e:
        out = os.path.abspath(out)
        raise HubFolderError(f"Cannot write the output folder {out}: {e.strerror or e} ({os.path.dirname(out)}). "
                             f"Choose an output folder you can write to.") from e


@cli_errors
def run(args) -> int:
    with contextlib.ExitStack() as stack:
        return _convert(args, stack)


def _convert(args, stack: contextlib.ExitStack) -> int:
    from ttt_zoo.hub import HubFolderError, convert_all, convert_checkpoint, registered_pretrained
    from ttt_zoo.hub.staging import check_output
    if args.all:
        from ttt_zoo.run_folder import refuse_run_output
        refuse_run_output(args.out_root, "--out-root")  # before its lock file is made beside it
        _lock_output(stack, args.out_root)  # the whole root: the folders below it are written one by one
        res = convert_all(args.out_root, args.checkpoint_dir, args.filter, args.download, args.skip_missing,
                          not args.no_flops, args.force)
        print(f"converted {len(res['converted'])} checkpoint(s); missing: {res['missing'] or 'none'}")
        return 0
    if args.sd3:
        return _convert_sd3(args, stack)
    from ttt_zoo.run_folder import resolve_checkpoint, run_model_kwargs
    ck = None
    if args.checkpoint and not args.model and args.tag:  # a run names its own model
        ck = resolve_checkpoint(args.checkpoint, "CHECKPOINT")
        args.model = ck.model
    if not args.checkpoint or not args.model:
        raise HubFolderError("Give a CHECKPOINT and --model MODEL.TAG (registered: "
                             f"{', '.join(registered_pretrained())}; a `ttt-zoo train` run folder needs only "
                             f"--tag NAME), or use --all.")
    name = _model_name(args.model, args.tag)
    out = args.out or os.path.join("hub", name)
    check_output(out, args.force)  # refused before its lock file is made and before the checkpoint is read
    _lock_output(stack, out)
    check_output(out, args.force)  # again, with the lock held
    # a run folder or a file in one: checked against the run
    ck = ck or resolve_checkpoint(args.checkpoint, "CHECKPOINT")
    info = convert_checkpoint(ck.weights, name, out, run_model_kwargs(ck, name.split(".")[0], model_kwargs(args))
                              or None, args.hub_id, not args.no_flops, args.force, args.source_url,
                              class_names=ck.class_names)  # the run's classes: config.json's label_names
    macs = f", {info['macs']:.3f} GMACs" if info["macs"] is not None else ""
    names = f"; label_names: the run's {len(info['class_names'])} classes" if info.get("class_names") else ""
    print(f"converted {args.checkpoint} -> {out} ({info['params']:,} params{macs}); hub id {info['hub_id']}{names}")
    return 0


def _convert_sd3(args, stack: contextlib.ExitStack) -> int:
    """A local SD3 / SD3.5 diffusers folder (pipeline or transformer) -> SD3.5-T5 (docs/sd3.md)."""
    from ttt_zoo.errors import UsageError
    from ttt_zoo.sd3.hub import convert_sd3_folder
    if not args.checkpoint or not args.out:
        raise UsageError("--sd3 needs the SD3 folder and --out OUT, e.g. `ttt-zoo convert "
                         "path/to/stable-diffusion-3.5-medium --sd3 --out sd3.5-medium-t5`")
    from ttt_zoo.hub.staging import check_output
    check_output(args.out, args.force)  # a run folder or a file is refused before its lock file is made
    _lock_output(stack, args.out)
    info = convert_sd3_folder(args.checkpoint, args.out, args.hub_id, args.base_name, args.force, args.finetuned,
                              ttt_dual_layers=args.dual_layers, ttt_joint_layers=args.joint_layers,
                              ttt_key_norm_span=args.key_norm_span, ttt_rms_qk_norm=args.rms_qk_norm)
    print(f"converted {args.checkpoint} -> {args.out}: TTT in attn2 of blocks {info['dual_layers']}, joint attn of "
          f"blocks {info['joint_layers']}; {info['new_params_str']} new parameters")
    return 0


def _layers(text: str):
    """--joint-layers 19,20,21 -> [19, 20, 21]; '' -> [] (no layers)."""
    import argparse
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of block indices "
                                         f"(e.g. 19,20,21)") from None


def _model_name(model: str, tag) -> str:
    """--model vit3_tiny --tag digits -> 'vit3_tiny.digits' (the same as --model vit3_tiny.digits)."""
    from ttt_zoo.hub import HubFolderError
    if not tag:
        return model
    arch, _, own = model.partition(".")
    if own and own != tag:
        raise HubFolderError(f"--model {model} already has the tag {own!r}; --tag {tag} names another. Give one.")
    return f"{arch}.{tag}"


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert checkpoints into timm-format Hugging Face Hub folders",
                       description="Convert an official or ttt-zoo checkpoint into a hub folder "
                                   "(model.safetensors, config.json, README.md).")
    p.add_argument("checkpoint", nargs="?", help="checkpoint file (.pth / .pt / .safetensors; any official layout)")
    p.add_argument("--model", help="ttt-zoo model with a tag: a registered one (vit3_tiny.in1k, the authors' "
                   "weights) or your own (vit3_tiny.digits, hub id ttt-zoo/vit3_tiny.digits)")
    p.add_argument("--tag", help="tag of your own weights (same as --model MODEL.TAG), e.g. digits")
    p.add_argument("--out", help="output folder (default: ./hub/<model>)")
    add_model_kwargs(p)  # constructor arguments of non-default architectures
    p.add_argument("--hub-id", help=f"repo id recorded in the folder (default {HUB_ORG}/<model>.<tag>)")
    p.add_argument("--source-url", help="where CHECKPOINT was downloaded from (stated on the card)")
    p.add_argument("--all", action="store_true", help="convert every registered pretrained tag")
    p.add_argument("--filter", default="*", help="with --all: only tags matching this glob")
    p.add_argument("--checkpoint-dir", help="with --all: folder of <model>.<tag>.pth files "
                   "(default: where pretrained=True caches the authors' files)")
    p.add_argument("--out-root", default="hub", help="with --all: parent of the output folders")
    p.add_argument("--download", action="store_true", help="with --all: download missing authors' checkpoints")
    p.add_argument("--skip-missing", action="store_true", help="with --all: skip tags without a checkpoint")
    p.add_argument("--no-flops", action="store_true", help="do not measure GMACs")
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder (the old one is kept "
                   "until the new one is complete)")
    g = p.add_argument_group("SD3.5-T5", "with --sd3: CHECKPOINT is a local SD3 / SD3.5 diffusers folder (a pipeline "
                             "or its transformer/), converted into SD3.5-T5 (docs/sd3.md)")
    g.add_argument("--sd3", action="store_true", help="convert an SD3 diffusers folder into SD3.5-T5")
    g.add_argument("--dual-layers", type=_layers, default=None,
                   help="comma-separated blocks whose attn2 becomes TTT (default: every dual-attention block)")
    g.add_argument("--joint-layers", type=_layers, default=None,
                   help="comma-separated blocks whose joint attn becomes TTT (default: the last 5; without "
                        "dual-attention blocks the last half)")
    g.add_argument("--key-norm-span", choices=("joint", "separate"), default="joint")
    g.add_argument("--rms-qk-norm", choices=("keep", "skip"), default="keep")
    g.add_argument("--base-name", help="the source's hub id, e.g. stabilityai/stable-diffusion-3.5-medium")
    g.add_argument("--finetuned", help="describe the fine-tune these weights had (default: none; the card says so)")
    p.set_defaults(func=run)
