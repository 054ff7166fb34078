"""Op-level GPU timing of the ViT3 inner step: Triton kernels vs. the recomputing PyTorch path vs. the naive
reference (forward+backward of swiglu_ttt and dwconv_ttt alone), plus a d=72 check of the Triton kernels.

    python tools/bench_gpu_ops.py
"""
import torch

from ttt_zoo.kernels.vit3_ttt import triton as T
from ttt_zoo.kernels.vit3_ttt.torch import dwconv_ttt_torch, swiglu_ttt_torch
from ttt_zoo.kernels.vit3_ttt.naive import dwconv_ttt_reference, swiglu_ttt_reference


def timeit(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def main():
    dt = torch.bfloat16
    for b, h, n, d in [(64, 6, 196, 32), (3, 6, 4096, 32), (1, 12, 16384, 64)]:
        q, k, v = [torch.randn(b, h, n, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3)]
        w1, w2 = [(torch.randn(1, h, d, d, device="cuda") * 0.02).requires_grad_() for _ in range(2)]
        do = torch.randn(b, h, n, d, device="cuda", dtype=dt)
        row = []
        for name, f in (("triton", T.swiglu_ttt_triton), ("torch", swiglu_ttt_torch), ("naive", swiglu_ttt_reference)):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = timeit(lambda: torch.autograd.backward(f(q, k, v, w1, w2, 1 / 3), do))
            row.append(f"{name} {ms:.3f} ms {(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MB")
        print(f"swiglu fwd+bwd B{b} h{h} N{n} d{d} bf16: " + " | ".join(row), flush=True)
    for b, d, hh, ww in [(64, 32, 14, 14), (3, 32, 64, 64)]:
        q, k, v = [torch.randn(b, d, hh, ww, device="cuda", dtype=dt, requires_grad=True) for _ in range(3)]
        w3 = (torch.randn(d, 1, 3, 3, device="cuda") * 0.02).requires_grad_()
        do = torch.randn(b, d, hh, ww, device="cuda", dtype=dt)
        row = []
        for name, f in (("triton", T.dwconv_ttt_triton), ("torch", dwconv_ttt_torch), ("naive", dwconv_ttt_reference)):
            ms = timeit(lambda: torch.autograd.backward(f(q, k, v, w3, 1 / 3), do))
            row.append(f"{name} {ms:.3f} ms")
        print(f"dwconv fwd+bwd B{b} d{d} {hh}x{ww} bf16: " + " | ".join(row), flush=True)
    # head dim 72 (padded to 128, run as column blocks of T.COL_BLOCK; the DiT3/DiT5-XL head dim)
    q, k, v = [torch.randn(1, 2, 100, 72, device="cuda", requires_grad=True) for _ in range(3)]
    w1, w2 = [(torch.randn(1, 2, 72, 72, device="cuda") * 0.05).requires_grad_() for _ in range(2)]
    try:
        out = T.swiglu_ttt_triton(q, k, v, w1, w2, 1 / 3)
        ref = swiglu_ttt_reference(q, k, v, w1, w2, 1 / 3)
        g = torch.autograd.grad(out.sum(), (q, k, v, w1, w2))
        gr = torch.autograd.grad(ref.sum(), (q, k, v, w1, w2))
        print("d72 kernels: max |out diff|", (out - ref).abs().max().item(),
              "max |grad diff|", max((a - r).abs().max().item() for a, r in zip(g, gr)))
    except Exception as e:  # report, do not hide
        print("d72 kernels FAILED:", type(e).__name__, str(e)[:300])


if __name__ == "__main__":
    main()
