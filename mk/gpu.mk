# The GPU run in one command (include from the top-level Makefile: `include mk/gpu.mk`; needs VENV, PY from there).
#   make gpu-check     : on a CUDA machine: every kernel test on CUDA, the `cuda`-marker tests, `ttt-zoo bench` of
#                        every family vs DeiT-T / DiT-S/2, a ViT3-T profile, then GPU verification records for the
#                        ops that passed (kernels/gpu_verified.json); results in $(GPU_CHECK_OUT)/
#   make gpu-check-dry : the same path on the CPU (Triton interpreter, tiny), records under the output folder only
#   make gpu-wheel     : the pinned timm as a wheel in .whl/, made on the CPU for tools/gpu_lease.sh (the GPU
#                        machine cannot reach a registry; the device tool's run carries it: carry [".whl"])
GPU_CHECK_OUT ?= gpu_check_out
GPU_CHECK_ARGS ?=

.PHONY: gpu-check gpu-check-dry gpu-wheel
GPU_WHEELS ?= .whl
GPU_WHEEL := $(GPU_WHEELS)/timm-$(TIMM_VERSION)-py3-none-any.whl

gpu-check: venv
	$(PY) tools/gpu_check.py --output $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

gpu-check-dry: venv
	$(PY) tools/gpu_check.py --dry-run --output $(GPU_CHECK_OUT)_dry $(GPU_CHECK_ARGS)

gpu-wheel: $(GPU_WHEEL)

# downloaded beside, then moved in: an interrupted download leaves no wheel that looks whole
$(GPU_WHEEL):
	@grep -qE '^timm==$(TIMM_VERSION)( |$$)' requirements.txt || { echo "error: requirements.txt does not pin" \
	  "timm==$(TIMM_VERSION) (Makefile TIMM_VERSION); make them agree" >&2; exit 2; }
	rm -rf $(GPU_WHEELS).part && mkdir -p $(GPU_WHEELS)
	$$([ -x $(PY) ] && echo $(PY) || echo $(PYTHON)) -m pip download -q --no-deps --only-binary=:all: \
	  timm==$(TIMM_VERSION) -d $(GPU_WHEELS).part
	mv $(GPU_WHEELS).part/timm-$(TIMM_VERSION)-py3-none-any.whl $@ && rm -rf $(GPU_WHEELS).part
