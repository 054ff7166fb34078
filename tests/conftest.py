import os
import tempfile

# never touch the network or the user's caches from tests
_TMP_HOME = tempfile.mkdtemp(prefix="ttt_zoo_test_home_")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", os.path.join(_TMP_HOME, "hf"))
os.environ["TORCH_HOME"] = os.path.join(_TMP_HOME, "torch")
os.environ["TTT_ZOO_CACHE"] = os.path.join(_TMP_HOME, "ttt_zoo")  # the local kernel checks (kernels/verify.py)
# no GPU: run Triton kernels in the interpreter (must be set before triton is first imported)
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# xdist workers share the cores: one worker's torch (and its child processes) gets cores / workers threads.  With
# torch's default of every core per worker, OpenMP's spinning threads oversubscribed the 2 CPUs and the numerics tests
# ran 7 min on 2 workers instead of ~1 min.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)

import ttt_zoo  # noqa: E402,F401

if os.environ.get("TRITON_INTERPRET") == "1":  # every interpreted kernel is checked for out-of-bounds access
    from triton_bounds import install as _install_bounds_check  # noqa: E402

    _install_bounds_check()

def pytest_runtest_logreport(report):
    """``TTT_ZOO_EAGER_FAILURES=1`` (``tools/gpu_check.py``): a failure's traceback as it happens, not at the end,
    so a run stopped by its time limit (a GPU lease) still shows why each failed test failed."""
    if report.failed and os.environ.get("TTT_ZOO_EAGER_FAILURES") == "1" and "PYTEST_XDIST_WORKER" not in os.environ:
        import sys
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
        sys.stderr.flush()


def pytest_collection_modifyitems(config, items):
    """A test parametrised with the Triton backend runs the kernels: mark it ``triton`` (the kernel stage of
    ``make test`` runs exactly the ``triton`` tests, in the interpreter; the main stage runs the rest)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v == "triton" for v in params.values()):
            item.add_marker(pytest.mark.triton)


@pytest.fixture
def kernel_device():
    """Tensors made inside the test are on the device the kernels run on: CUDA when there is one (``make
    gpu-check``), else the CPU (the interpreter)."""
    from _ops import DEV  # the one place that decides where the op tests run
    with torch.device(DEV):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny tensors (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    faster there, and immune to thread wake-up stalls on a busy shared CPU; the count is restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache for this test; the hub is offline (set above)."""
    from huggingface_hub import constants
    assert constants.HF_HUB_OFFLINE, "tests must run with HF_HUB_OFFLINE=1"
    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return str(cache)
