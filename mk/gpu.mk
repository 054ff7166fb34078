# The GPU run in one command (include from the top-level Makefile: `include mk/gpu.mk`; needs VENV, PY from there).
#   make gpu-check     : on a CUDA machine: every kernel test on CUDA, the `cuda`-marker tests, `ttt-zoo bench` of
#                        every family vs DeiT-T / DiT-S/2, a ViT3-T profile, then GPU verification records for the
#                        ops that passed (kernels/gpu_verified.json); results in $(GPU_CHECK_OUT)/
#   make gpu-check-dry : the same path on the CPU (Triton interpreter, tiny), records under the output folder only
GPU_CHECK_OUT ?= gpu_check_out
GPU_CHECK_ARGS ?=

.PHONY: gpu-check gpu-check-dry

gpu-check: venv
	$(PY) tools/gpu_check.py --output $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

gpu-check-dry: venv
	$(PY) tools/gpu_check.py --dry-run --output $(GPU_CHECK_OUT)_dry $(GPU_CHECK_ARGS)
