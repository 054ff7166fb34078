"""The single dispatch point: CPU/meta use the PyTorch reference; a forced backend is honoured or explained."""
import pytest
import torch

from ttt_zoo import kernels
from ttt_zoo.kernels import get_op, resolve_backend, swiglu_ttt_reference


def test_cpu_and_meta_use_pytorch_paths():
    from ttt_zoo.kernels import swiglu_ttt_torch
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    assert get_op("vit3_swiglu_ttt", torch.device("meta")) is swiglu_ttt_torch
    assert get_op("vit3_swiglu_ttt", torch.device("cpu"), "torch_naive") is swiglu_ttt_reference


def test_env_and_argument_force_backend(monkeypatch):
    monkeypatch.setenv("TTT_ZOO_BACKEND", "torch")
    assert resolve_backend(None, torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="Unknown TTT backend 'cudnn'.*TTT_ZOO_BACKEND"):
        resolve_backend("cudnn", torch.device("cpu"))
    with pytest.raises(KeyError, match="Unknown TTT op"):
        get_op("nope", torch.device("cpu"))


def test_available_ops_lists_vit3_ops():
    ops = kernels.available_ops()
    assert {"vit3_swiglu_ttt", "vit3_dwconv_ttt"} <= set(ops)
    assert all(v["torch"] for v in ops.values())
