"""An out-of-bounds checker for Triton kernels run in the interpreter (``TRITON_INTERPRET=1``).

The interpreter reads and writes raw addresses: a masked-in lane that points outside every tensor argument silently
reads garbage or corrupts the heap (on a GPU it is an illegal memory access).  ``install()`` wraps the interpreter's
loads and stores so that every masked-in address must fall inside the storage of one of the launch's tensor
arguments; otherwise the kernel raises ``TritonOutOfBounds`` naming the offending addresses.
"""
from __future__ import annotations

import numpy as np


class TritonOutOfBounds(RuntimeError):
    pass


_ranges: list = []  # (start, end) byte ranges of the current launch's tensor arguments
_installed = False


def _check(ptrs, mask, itemsize: int, what: str):
    addr = np.asarray(ptrs, dtype=np.uint64)
    live = addr if mask is None else addr[np.broadcast_to(np.asarray(mask, dtype=bool), addr.shape)]
    if live.size == 0:
        return
    ok = np.zeros(live.shape, dtype=bool)
    for start, end in _ranges:
        ok |= (live >= start) & (live + itemsize <= end)
    if not ok.all():
        bad = live[~ok]
        spans = ", ".join(f"[{s:#x}, {e:#x})" for s, e in _ranges)
        raise TritonOutOfBounds(f"{what} of {bad.size} element(s) outside every tensor argument "
                                f"(first {int(bad[0]):#x}; arguments {spans})")


def install():
    """Patch the Triton interpreter once per process; a no-op when Triton or the interpreter is unavailable."""
    global _installed
    if _installed:
        return
    from triton.runtime import interpreter as I

    builder_cls = type(I.interpreter_builder)
    load, store, cvt = builder_cls.create_masked_load, builder_cls.create_masked_store, I._implicit_cvt
    call = I.GridExecutor.__call__

    def masked_load(self, ptrs, mask, other, *a, **k):
        _check(ptrs.data, mask.data, np.dtype(I._get_np_dtype(ptrs.get_element_ty())).itemsize, "load")
        return load(self, ptrs, mask, other, *a, **k)

    def masked_store(self, ptrs, value, mask, *a, **k):
        _check(ptrs.data, mask.data, np.dtype(I._get_np_dtype(ptrs.get_element_ty())).itemsize, "store")
        return store(self, ptrs, value, mask, *a, **k)

    def implicit_cvt(arg):
        if hasattr(arg, "data_ptr") and hasattr(arg, "untyped_storage"):
            s = arg.untyped_storage()
            _ranges.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
        return cvt(arg)

    def grid_call(self, *args, **kwargs):
        saved = list(_ranges)
        _ranges.clear()
        try:
            return call(self, *args, **kwargs)
        finally:
            _ranges[:] = saved

    builder_cls.create_masked_load, builder_cls.create_masked_store = masked_load, masked_store
    I._implicit_cvt = implicit_cvt
    I.GridExecutor.__call__ = grid_call
    _installed = True
