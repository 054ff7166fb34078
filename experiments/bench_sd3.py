#!/usr/bin/env python
"""Speed of SD3.5-T5 against softmax SD3.5-Medium, side by side in one run (random weights, fp32, batch 1).

Shapes: SD3.5-Medium (width 1536 = 24 heads x 64, RMS qk-norm, 13 dual-attention blocks of 24), 4,096 and 16,384
image tokens (1024² and 2048² images: 128² and 256² latents, patch 2) + 333 text tokens (77 CLIP + 256 T5).

- block: one dual-attention block (softmax joint attn + [softmax | TTT] attn2) and one joint block (softmax | TTT
  joint attn), forward only;
- model: the whole transformer forward (the paper's layout: attn2 of the 13 dual blocks + joint attn of the last 5),
  optionally at a reduced depth ``--depth D`` keeping the proportions (the table says so).

    PYTHONPATH=. python experiments/bench_sd3.py               # the full table -> experiments/results/sd3_speed.md
    PYTHONPATH=. python experiments/bench_sd3.py --tiny --output /tmp/sd3_speed.md   # seconds, checks the script runs
"""
import argparse
import gc
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
              num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
              pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
              dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
TINY = dict(MEDIUM, num_attention_heads=2, attention_head_dim=16, caption_projection_dim=32, joint_attention_dim=32,
            pooled_projection_dim=32, in_channels=4, out_channels=4, pos_embed_max_size=32)


def layout(depth: int, full: int = 24):
    """The paper's layout scaled to ``depth`` blocks: round(13/24 depth) dual blocks, TTT in all their attn2 and in
    the joint attn of the last round(5/24 depth) blocks (>= 1 each)."""
    n_dual = max(1, round(13 * depth / full))
    n_joint = max(1, round(5 * depth / full))
    return tuple(range(n_dual)), list(range(depth - n_joint, depth))


def grid(tokens: int):
    side = int(round(tokens ** 0.5))
    if side * side != tokens:
        raise ValueError(f"--tokens {tokens} must be a square number of patches")
    return side, side


def set_grid(module: torch.nn.Module, hw) -> None:
    from ttt_zoo.sd3 import SD3TTTAttention
    for m in module.modules():
        if isinstance(m, SD3TTTAttention):
            m.ttt.feat_size = hw


def bench(args) -> List[Dict]:
    from diffusers import SD3Transformer2DModel
    from ttt_zoo.bench.measure import measure_steps
    from ttt_zoo.sd3 import SD3T5Transformer2DModel
    cfg = dict(TINY if args.tiny else MEDIUM)
    depth = args.depth or cfg["num_layers"]
    dual, joint = layout(depth)
    cfg.update(num_layers=depth, dual_attention_layers=dual)
    torch.manual_seed(0)
    with torch.no_grad():  # SD3.5-T5 with the softmax model's weights, copied in place (no third copy in memory)
        softmax = SD3Transformer2DModel(**cfg).eval()
        ttt = SD3T5Transformer2DModel(**cfg, ttt_joint_layers=joint).eval()
        missing, unexpected = ttt.load_state_dict(softmax.state_dict(), strict=False)
        assert not unexpected and sorted(missing) == sorted(ttt.new_parameter_names())
    width = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    p = cfg["patch_size"]
    rows = []
    for tokens in args.tokens:
        h, w = grid(tokens)
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(1, tokens, width, generator=g)
        ctx = torch.randn(1, args.text_tokens, width, generator=g)
        temb = torch.randn(1, width, generator=g)
        blocks = {"dual block (attn2)": dual[0], "joint block (joint attn)": joint[0]}
        for what, i in blocks.items():
            if args.model_only:
                break
            res = {}
            for name, model in (("softmax", softmax), ("sd3.5-t5", ttt)):
                blk = model.transformer_blocks[i]
                set_grid(blk, (h, w))
                with torch.no_grad():
                    res[name] = measure_steps(lambda: blk(x, ctx, temb), "cpu", args.warmup, args.repeats)
            rows.append(dict(what=f"{what}, block {i}", tokens=tokens, **_pair(res)))
            gc.collect()
        if args.block_only:
            continue
        lat = torch.randn(1, cfg["in_channels"], h * p, w * p, generator=g)
        enc = torch.randn(1, args.text_tokens, cfg["joint_attention_dim"], generator=g)
        pooled = torch.randn(1, cfg["pooled_projection_dim"], generator=g)
        t = torch.tensor([500.0])
        res = {}
        for name, model in (("softmax", softmax), ("sd3.5-t5", ttt)):
            with torch.no_grad():
                res[name] = measure_steps(lambda: model(lat, enc, pooled, t, return_dict=False), "cpu", args.warmup,
                                          args.repeats)
        rows.append(dict(what=f"whole transformer, {depth} blocks" + ("" if depth == 24 and not args.tiny else
                                                                      " (reduced depth)"), tokens=tokens, **_pair(res)))
        gc.collect()
    return rows


def _pair(res):
    s, t = res["softmax"]["step_time"], res["sd3.5-t5"]["step_time"]
    return dict(softmax_ms=s, t5_ms=t, speedup=s / t)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="image tokens (square numbers)")
    p.add_argument("--text-tokens", type=int, default=333)
    p.add_argument("--depth", type=int, default=None, help="blocks of the whole-model run (default 24; the layout "
                   "is scaled, see layout())")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-only", action="store_true")
    p.add_argument("--model-only", action="store_true")
    p.add_argument("--tiny", action="store_true", help="tiny width and 64 / 256 tokens: checks the script runs")
    p.add_argument("--output", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                    "sd3_speed.md"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.tokens = [64, 256] if args.tokens == [4096, 16384] else args.tokens
        args.depth = args.depth or 4
        args.text_tokens = min(args.text_tokens, 16)
    from ttt_zoo.bench.measure import describe_machine, machine_info
    from ttt_zoo.fileio import atomic_write
    info = machine_info("cpu", args.threads)
    rows = bench(args)
    shape = "TINY test shapes (NOT SD3.5-Medium)" if args.tiny else "SD3.5-Medium shapes: width 1536, 24 heads x 64"
    lines = ["# SD3.5-T5 vs softmax SD3.5-Medium: forward latency", "",
             f"`PYTHONPATH=. python {' '.join(['experiments/bench_sd3.py'] + sys.argv[1:])}`; {shape}; random weights, fp32, "
             f"CPU, batch 1, {args.text_tokens} text tokens; median of {args.repeats} runs after {args.warmup} "
             f"warm-up; both models in the same process, measured one after the other per row.",
             f"Machine: {describe_machine(info)}.", "",
             "| what | image tokens | softmax (ms) | SD3.5-T5 (ms) | speed-up |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['tokens']} | {r['softmax_ms']:.1f} | {r['t5_ms']:.1f} | {r['speedup']:.2f}x |"
              for r in rows]
    lines += ["", "Paper (Table 7, one H20 GPU, bf16, whole 28-step generation): 1.32x at 1024² (4,096 tokens), "
              "1.47x at 2048² (16,384 tokens)."]
    atomic_write(args.output, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
