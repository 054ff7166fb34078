"""Shared by tools/mm_train.py and tools/mm_test.py: run mmdet's or mmseg's own tools/{train,test}.py.

The package is chosen from the config's ``default_scope`` ('mmdet' or 'mmseg').  ``--trust-checkpoint`` is the
one explicit opt-in to unpickling full mmengine checkpoints that hold more than the safe allow-list (see
``ttt_zoo.adapters._mm``); without it every checkpoint is read with ``weights_only=True``.

``--launcher pytorch`` (under torchrun) on a machine without CUDA runs on the CPU with the gloo backend: mmengine's
own ``init_dist`` calls ``torch.cuda.set_device`` and its DDP wrapper passes ``device_ids``, which only work on GPUs,
so the process group is started here (mmengine then skips ``init_dist``) and the model is wrapped by
``CPUDistributedDataParallel`` (no ``device_ids``; SyncBN, which needs GPUs, reverted to per-process BN).

A mistake in the command line or a package of the OpenMMLab stack missing (before ``make openmmlab``) is one
``error:`` line, exit status 2 (``--debug``: the traceback too).
"""
import faulthandler
import importlib.util
import os
import runpy
import sys

from ttt_zoo.adapters._mm import openmmlab_missing
from ttt_zoo.errors import UsageError


def not_installed(module: str) -> UsageError:
    return UsageError(openmmlab_missing(module))


def require(*modules: str) -> None:
    """Refuse to start, naming the first of ``modules`` that cannot be imported."""
    for m in modules:
        if importlib.util.find_spec(m) is None:
            raise not_installed(m)


def package_tool(config: str, tool: str) -> str:
    if not os.path.isfile(config):
        raise UsageError(f"{config}: no such config file; give one of configs_det/*.py or configs_seg/*.py")
    require("mmengine", "pkg_resources", "mmcv")
    from mmengine.config import Config
    try:
        scope = Config.fromfile(config, import_custom_modules=False).get("default_scope")
    except ModuleNotFoundError as e:  # a `mmdet::` / `mmseg::` base config: "mmdet is not installed, ..."
        name = e.name or str(e).split()[0]  # mmengine names the distribution: mmsegmentation for mmseg
        raise not_installed("mmseg" if name == "mmsegmentation" else name) from e
    if scope not in ("mmdet", "mmseg"):
        raise SystemExit(f"{config}: default_scope must be 'mmdet' or 'mmseg' (from the mmdet::/mmseg:: base "
                         f"configs), got {scope!r}.")
    require(scope)
    pkg = __import__(scope)
    path = os.path.join(os.path.dirname(pkg.__file__), ".mim", "tools", f"{tool}.py")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} not found: reinstall {scope} from its wheel (`make openmmlab`).")
    return path


def _launcher(argv) -> str:
    for i, a in enumerate(argv):
        if a == "--launcher" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--launcher="):
            return a.split("=", 1)[1]
    return "none"


def _register_cpu_ddp() -> None:
    from mmengine.model import MMDistributedDataParallel, revert_sync_batchnorm
    from mmengine.registry import MODEL_WRAPPERS

    if "CPUDistributedDataParallel" in MODEL_WRAPPERS.module_dict:
        return

    @MODEL_WRAPPERS.register_module()
    class CPUDistributedDataParallel(MMDistributedDataParallel):
        """mmengine's DDP wrapper for a CPU model: torch refuses the ``device_ids`` mmengine always passes."""

        def __init__(self, module, device_ids=None, **kwargs):
            super().__init__(module=revert_sync_batchnorm(module), device_ids=None, **kwargs)


def _setup_cpu_distributed(argv) -> list:
    """Start the gloo process group (torchrun's env) and point ``model_wrapper_cfg`` at the CPU wrapper, with
    the arguments mmengine's default DDP wrapping would use."""
    import torch.distributed as dist
    from mmengine.config import Config
    cfg = Config.fromfile(argv[0], import_custom_modules=False)
    if cfg.get("model_wrapper_cfg"):
        raise SystemExit(f"{argv[0]} sets model_wrapper_cfg; on a machine without CUDA, --launcher pytorch replaces "
                         "it with CPUDistributedDataParallel: remove it, or run on GPUs.")
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    _register_cpu_ddp()
    # mmengine's DictAction merges repeated --cfg-options, so the user's own options are kept
    return argv + ["--cfg-options", "model_wrapper_cfg.type=CPUDistributedDataParallel",
                   "model_wrapper_cfg.broadcast_buffers=False",
                   f"model_wrapper_cfg.find_unused_parameters={bool(cfg.get('find_unused_parameters', False))}",
                   "env_cfg.dist_cfg.backend=gloo"]


def _prepare(tool: str, argv: list) -> str:
    """Check the command line and the OpenMMLab stack; the path of the toolbox's own ``tools/{tool}.py``."""
    if not argv or argv[0].startswith("-"):
        raise SystemExit(f"usage: tools/mm_{tool}.py CONFIG [args of mmdet/mmseg tools/{tool}.py] "
                         f"[--trust-checkpoint]; give a config, e.g. configs_det/mask-rcnn_hvit3-t_fpn_1x_coco.py")
    path = package_tool(argv[0], tool)
    if "--trust-checkpoint" in argv:
        argv.remove("--trust-checkpoint")
        from ttt_zoo.adapters import allow_unsafe_checkpoints
        allow_unsafe_checkpoints()
    return path


def main(tool: str) -> None:
    from ttt_zoo.cli._common import run_command
    argv = [a for a in sys.argv[1:] if a != "--debug"]
    # a mistake or a missing package: one `error:` line, exit status 2 (UserExit), no traceback (--debug: with it)
    path = run_command(_prepare, tool, argv, debug=len(argv) < len(sys.argv) - 1)
    if isinstance(path, int):  # Ctrl-C while preparing: its exit status
        sys.exit(path)
    cpu_distributed = False
    if _launcher(argv) == "pytorch":
        import torch
        if not torch.cuda.is_available():
            faulthandler.enable()  # an abort in a rank prints every thread's Python stack to the job's log
            argv = _setup_cpu_distributed(argv)
            cpu_distributed = True
    sys.argv = [path] + argv
    runpy.run_path(path, run_name="__main__")
    if cpu_distributed:
        _shutdown_distributed()


def _shutdown_distributed() -> None:
    """End a finished CPU (gloo) run without leaving gloo to interpreter finalization.

    Wait for every rank, tear the process group down, run the exit handlers and flush the logs while the interpreter
    is whole, then leave with ``os._exit(0)``.  Left to finalization, gloo's threads were destroyed while joinable
    ('terminate called without an active exception', SIGABRT): 3 of 22 two-process launches aborted after a
    finished run without the teardown, and still 1 CI run of many with ``destroy_process_group`` alone, since the DDP
    wrapper keeps its own reference to the group until finalization.  torchrun then reports the whole job as failed.
    """
    import atexit
    import gc
    import logging

    import torch.distributed as dist
    gc.collect()  # the runner's cycles (model, DDP reducer, optimizer) go while the interpreter is whole
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    atexit._run_exitfuncs()  # what a normal exit runs first (mmengine's and logging's handlers)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
