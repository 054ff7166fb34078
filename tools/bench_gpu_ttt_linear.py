"""Op-level GPU benchmark of the bidirectional TTT-Linear scan (Vision-TTT): Triton kernels vs. the PyTorch paths.

    python tools/bench_gpu_ttt_linear.py [--tokens 196 1024 4096 16384] [--heads 3] [--head-dim 64] [--dtype bf16]
    python tools/bench_gpu_ttt_linear.py --dry-run   # tiny shapes on the CPU (Triton interpreter); writes to /tmp

Backends, side by side in one run on the same inputs: ``triton`` (both directions in one kernel launch, recomputing
backward), ``torch`` (the recomputing PyTorch path) and ``torch_naive`` (the reference under autograd).  For every
token count: forward (no grad) and forward+backward time (mean over --iters after warm-up) and peak memory above
the inputs (``torch.cuda.max_memory_allocated``), plus the max |out - out_torch| and the largest relative gradient
difference vs. ``torch`` as a sanity check.  The batch is ``max(1, --batch-tokens // N)`` so every row does similar
work.  Writes ``tools/results/gpu_ttt_linear_bench.md`` (``--out`` to change).
"""
import argparse
import os
import platform
import sys
import tempfile
import time

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
BACKENDS = ("triton", "torch", "torch_naive")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[196, 1024, 4096, 16384])
    p.add_argument("--batch-tokens", type=int, default=16384, help="batch = max(1, batch_tokens // N)")
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--mini-batch", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu_ttt_linear_bench.md"))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU through the Triton interpreter")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        args.tokens, args.batch_tokens, args.heads, args.head_dim, args.mini_batch = [37], 37, 1, 16, 8
        args.dtype, args.iters = "fp32", 1
        if args.out == parse_args([]).out:
            args.out = os.path.join(tempfile.gettempdir(), "gpu_ttt_linear_bench_dryrun.md")
    import torch
    from ttt_zoo.kernels import ttt_linear_bidir
    from ttt_zoo.kernels.backend import MAX_HEAD_DIM

    limit = MAX_HEAD_DIM["ttt_linear_bidir"]
    if args.head_dim > limit and not args.dry_run:
        print(f"note: head dim {args.head_dim} > {limit}: backend='triton' raises, 'auto' runs PyTorch", flush=True)

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or pass --dry-run to check the script on the CPU")
    dtype = getattr(torch, DTYPES[args.dtype])
    cuda = device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def measure(fn):
        """(ms per call, peak MiB above the memory in use before the call)."""
        fn()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        sync()
        ms = (time.perf_counter() - t0) * 1e3 / args.iters
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20 if cuda else float("nan")
        return ms, peak

    h, d, mb = args.heads, args.head_dim, args.mini_batch
    rows = []
    for n in args.tokens:
        b = max(1, args.batch_tokens // n)
        g = torch.Generator(device=device).manual_seed(0)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype).requires_grad_()
        q, k, v = rnd(b, h, n, d), rnd(b, h, n, d), rnd(b, h, n, d)
        lr = (torch.rand(b, h, n, generator=g, device=device) / d).to(dtype).requires_grad_()
        tau = (torch.rand(mb, generator=g, device=device) + 0.5).to(dtype).requires_grad_()
        w0, b0 = rnd(1, h, d, d, scale=0.02), rnd(1, h, 1, d, scale=0.02)
        ln_w = (1.0 + 0.1 * torch.randn(h, d, generator=g, device=device)).to(dtype).requires_grad_()
        ln_b = rnd(h, d, scale=0.1)
        inputs = (q, k, v, lr, tau, w0, b0, ln_w, ln_b)
        do = torch.randn(b, h, n, d, generator=g, device=device).to(dtype)
        ref_out = ref_grads = None
        for backend in args.backends:
            def fwd():
                with torch.no_grad():
                    return ttt_linear_bidir(*inputs, mini_batch=mb, backend=backend)[0]

            def fwd_bwd():
                out = ttt_linear_bidir(*inputs, mini_batch=mb, backend=backend)[0]
                return torch.autograd.grad(out, inputs, do)
            row = dict(n=n, b=b, backend=backend)
            try:
                row["fwd_ms"], row["fwd_mib"] = measure(fwd)
                row["fb_ms"], row["fb_mib"] = measure(fwd_bwd)
                out, grads = fwd().float(), [t.float() for t in fwd_bwd()]
                if ref_out is None:  # the first backend is the comparison point
                    ref_out, ref_grads = out, grads
                row["out_diff"] = (out - ref_out).abs().max().item()
                row["grad_rel"] = max(((a - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
                                      for a, r in zip(grads, ref_grads))
            except torch.cuda.OutOfMemoryError as e:  # report, do not hide
                row["error"] = f"OOM: {str(e)[:80]}"
                torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
        del inputs, q, k, v, lr, tau, w0, b0, ln_w, ln_b, do, ref_out, ref_grads

    dev = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()}, interpreter)"
    lines = [f"# TTT-Linear bidirectional scan: Triton vs PyTorch ({'DRY RUN, ' if args.dry_run else ''}{dev})", "",
             f"torch {torch.__version__}; heads {h}, head dim {d}, mini-batch {mb}, {args.dtype}, ln_residual, "
             f"in-chunk RoPE, shared w0; batch = max(1, {args.batch_tokens} // N); mean of {args.iters} iters; "
             f"memory = peak above the inputs.  Diffs are vs. the first backend ({args.backends[0]}).", "",
             "| N | B | backend | fwd ms | fwd MiB | fwd+bwd ms | fwd+bwd MiB | max abs out diff | max rel grad diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['n']} | {r['b']} | {r['backend']} | {r['error']} | | | | | |")
        else:
            lines.append(f"| {r['n']} | {r['b']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['fwd_mib']:.1f} | "
                         f"{r['fb_ms']:.3f} | {r['fb_mib']:.1f} | {r['out_diff']:.2e} | {r['grad_rel']:.2e} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
