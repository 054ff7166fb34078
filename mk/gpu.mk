# The GPU run in one command (include from the top-level Makefile: `include mk/gpu.mk`; needs VENV, PY from there).
#   make gpu-check     : on a CUDA machine: every kernel test on CUDA, the `cuda`-marker tests, `ttt-zoo bench` of
#                        every family vs DeiT-T / DiT-S/2, a ViT3-T profile, then GPU verification records for the
#                        ops that passed (kernels/gpu_verified.json); results in $(GPU_CHECK_OUT)/
#   make gpu-check-dry : the same path on the CPU (Triton interpreter, tiny), records under the output folder only
#   make gpu-wheel     : the wheels tools/gpu_lease.sh may install on the GPU machine (it reaches no registry), in
#                        .whl/: timm and the test plugins at their requirements.txt pins, pytest and its pure-Python
#                        dependencies (`bash tools/gpu_lease.sh --wheel-specs` lists them); carried: carry [".whl"]
#   make gpu-preflight : on the CPU before a lease: the wheels, their size, the script and its plan; exit 0 only if a
#                        lease would not be wasted (tools/README.md "gpu_lease.sh")
GPU_CHECK_OUT ?= gpu_check_out
GPU_CHECK_ARGS ?=

.PHONY: gpu-check gpu-check-dry gpu-wheel gpu-preflight
GPU_WHEELS ?= .whl

gpu-check: venv
	$(PY) tools/gpu_check.py --output $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

gpu-check-dry: venv
	$(PY) tools/gpu_check.py --dry-run --output $(GPU_CHECK_OUT)_dry $(GPU_CHECK_ARGS)

# the wheels a missing one names, downloaded beside, then moved in: an interrupted download leaves no wheel that
# looks whole; nothing is downloaded when every one is there
gpu-wheel:
	@grep -qE '^timm==$(TIMM_VERSION)( |$$)' requirements.txt || { echo "error: requirements.txt does not pin" \
	  "timm==$(TIMM_VERSION) (Makefile TIMM_VERSION); make them agree" >&2; exit 2; }
	@specs=$$(GPU_LEASE_PYTHON=$(PY) bash tools/gpu_lease.sh --wheel-specs) || exit 2; \
	todo=; for s in $$specs; do n=$${s%%==*}; v=$${s#*==}; \
	  ls $(GPU_WHEELS)/$$(echo $$n | tr - _)-$$v-*.whl >/dev/null 2>&1 || todo="$$todo $$s"; done; \
	[ -z "$$todo" ] && { echo "$(GPU_WHEELS)/: every wheel there"; exit 0; }; \
	rm -rf $(GPU_WHEELS).part && mkdir -p $(GPU_WHEELS) && \
	$(PY) -m pip download -q --no-deps --only-binary=:all: -d $(GPU_WHEELS).part $$todo && \
	mv $(GPU_WHEELS).part/*.whl $(GPU_WHEELS)/ && rm -rf $(GPU_WHEELS).part && echo "$(GPU_WHEELS)/:$$todo"

gpu-preflight: gpu-wheel
	GPU_LEASE_PYTHON=$(PY) GPU_LEASE_WHEELS=$(GPU_WHEELS) bash tools/gpu_lease.sh --preflight
