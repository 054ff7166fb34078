import os
import tempfile

# never touch the network or the user's caches from tests
_TMP_HOME = tempfile.mkdtemp(prefix="ttt_zoo_test_home_")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", os.path.join(_TMP_HOME, "hf"))
os.environ["TORCH_HOME"] = os.path.join(_TMP_HOME, "torch")
# no GPU: run Triton kernels in the interpreter (must be set before triton is first imported)
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import ttt_zoo  # noqa: E402,F401

if os.environ.get("TRITON_INTERPRET") == "1":  # every interpreted kernel is checked for out-of-bounds access
    from triton_bounds import install as _install_bounds_check  # noqa: E402

    _install_bounds_check()

FIXTURES = os.environ.get("TTT_ZOO_FIXTURES", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures"))


def pytest_collection_modifyitems(config, items):
    """A test parametrised with the Triton backend runs the kernels: mark it ``triton`` (the kernel stage of
    ``make test`` runs exactly the ``triton`` tests, in the interpreter; the main stage runs the rest)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v == "triton" for v in params.values()):
            item.add_marker(pytest.mark.triton)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
