"""Op-level measurements of the TTT ops (``--ops``), run inside a fresh child process, one per op.

Every op registered in ``ttt_zoo.kernels`` dispatch is reached through ``get_op(name, device, backend)``, so
``triton``, ``torch`` and ``torch_naive`` are exactly the paths the layers run. For each shape and backend: forward
(no grad) and forward + backward (``torch.autograd.grad`` with a fixed output gradient) time and peak memory with
the shared :func:`~ttt_zoo.bench.measure.measure_steps`, and the max |out - ref| and the largest relative gradient
difference against ``torch_naive`` run in fp32 on the same inputs.
"""

from typing import Callable, Dict, List, Sequence, Tuple

import torch

__all__ = ["OPS", "bench_ops", "shape_label"]


def _inputs(op: str) -> Callable:
    """The op's input builder: the one the kernels' local check uses (``kernels.verify.CASES``)."""
    from ttt_zoo.kernels.verify import CASES
    return CASES[op][0]


def _tokens(heads: int, d: int, extra=()) -> List[tuple]:
    """196 ... 16384 tokens (a 224 ... 2048 px image at patch 16), batch shrinking so each row has similar work."""
    return [(b, heads, n, d, *extra) for n, b in ((196, 64), (1024, 16), (4096, 4), (16384, 1))]


# op -> (input builder, shape fields, default shapes, dry-run shapes). Defaults follow the models that use the op.
OPS: Dict[str, Tuple[Callable, str, List[tuple], List[tuple]]] = {
    "vit3_swiglu_ttt": (_inputs("vit3_swiglu_ttt"), "B heads N d",
                        [(64, 6, 196, 32), (3, 6, 4096, 32), (1, 12, 16384, 64), (1, 2, 100, 72)], [(2, 2, 49, 16)]),
    "vit3_dwconv_ttt": (_inputs("vit3_dwconv_ttt"), "B d H W", [(64, 32, 14, 14), (3, 32, 64, 64)], [(2, 8, 7, 5)]),
    "vit3_qkv_ttt": (_inputs("vit3_qkv_ttt"), "B heads H W d", [(64, 3, 14, 14, 64), (4, 3, 32, 32, 64), (1, 3, 64, 64, 64)],
                     [(2, 2, 4, 3, 8)]),
    "t5_swiglu_ttt": (_inputs("t5_swiglu_ttt"), "B heads N d", _tokens(3, 64) + [(1, 2, 4096, 72)],
                      [(2, 2, 49, 16)]),
    "dit5_mlp_ttt": (_inputs("dit5_mlp_ttt"), "B heads N d", _tokens(6, 64), [(2, 2, 49, 16)]),
    "key_instance_norm": (_inputs("key_instance_norm"), "B N C", [(64, 196, 192), (16, 1024, 192), (4, 4096, 192), (1, 16384, 192)],
                          [(2, 49, 16)]),
    "ttt_linear": (_inputs("ttt_linear"), "B heads N d mini_batch", [(max(1, 16384 // n), 3, n, 64, 16)
                                                                  for n in (196, 1024, 4096, 16384)],
                   [(1, 1, 37, 16, 8)]),
    "ttt_linear_bidir": (_inputs("ttt_linear_bidir"), "B heads N d mini_batch", [(max(1, 16384 // n), 3, n, 64, 16)
                                                                        for n in (196, 1024, 4096, 16384)],
                         [(1, 1, 37, 16, 8)]),
}


def shape_label(op: str, shape: Sequence[int]) -> str:
    return " ".join(f"{k}{v}" for k, v in zip(OPS[op][1].split(), shape))


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _make_inputs(op: str, shape, device: str, dtype: torch.dtype) -> list:
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*size, scale=1.0, shift=0.0, weight=False, uniform=False):
        t = torch.rand(*size, generator=g) if uniform else torch.randn(*size, generator=g)
        # activations in the benchmark dtype, inner weights in fp32 as the layers keep them
        return (t * scale + shift).to(device, torch.float32 if weight else dtype).requires_grad_()
    return OPS[op][0](shape, rnd)


def _diff(out, grads, ref_out, ref_grads) -> Tuple[float, float]:
    out_diff = (out.float() - ref_out).abs().max().item()
    rel = max(((a.float() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for a, r in zip(grads, ref_grads))
    return out_diff, rel


def bench_ops(spec: Dict) -> Dict:
    """All shapes x backends of one op; one row per (shape, backend), errors (e.g. out of memory) in the row."""
    from ttt_zoo.kernels import get_op
    from .measure import measure_steps
    op, device = spec["op"], spec["device"]
    dtype = getattr(torch, spec["dtype"])
    rows = []
    for shape in spec["shapes"]:
        args = _make_inputs(op, shape, device, dtype)
        diff_inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        do = torch.randn(_first(get_op(op, torch.device(device), "torch")(*args)).shape,
                         generator=torch.Generator().manual_seed(1)).to(device, dtype)
        ref = None
        try:  # the fp32 reference on the same values
            ref_args = [a.detach().float().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
            ref_out = _first(get_op(op, torch.device(device), "torch_naive")(*ref_args))
            ref = (ref_out.detach(), torch.autograd.grad(ref_out, [a for a in ref_args if isinstance(a, torch.Tensor)],
                                                         do.float()))
        except Exception as e:  # noqa: BLE001 - e.g. the naive path out of memory: timings still useful
            print(f"note: {op} {shape}: fp32 reference failed ({type(e).__name__}), no diffs", flush=True)
        for backend in spec["backends"]:
            row = dict(op=op, shape=shape_label(op, shape), dtype=spec["dtype"], backend=backend)
            try:
                fn = get_op(op, torch.device(device), backend)

                def fwd():
                    with torch.no_grad():
                        return fn(*args)

                def fwd_bwd():
                    return torch.autograd.grad(_first(fn(*args)), diff_inputs, do)
                f = measure_steps(fwd, device, spec["num_warm_iter"], spec["num_bench_iter"])
                fb = measure_steps(fwd_bwd, device, spec["num_warm_iter"], spec["num_bench_iter"])
                row.update(fwd_ms=round(f["step_time"], 4), fwd_peak_mb=f["peak_mem_mb"],
                           fwd_bwd_ms=round(fb["step_time"], 4), fwd_bwd_peak_mb=fb["peak_mem_mb"])
                if ref is not None:
                    out = _first(fn(*args))
                    row["out_diff"], row["grad_rel_diff"] = _diff(out, torch.autograd.grad(out, diff_inputs, do),
                                                                  *ref)
            except Exception as e:  # noqa: BLE001 - report in the table (out of memory, missing kernel), go on
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
    return dict(rows=rows)
