# `make demo`  : create .venv if needed, install the pinned stack, run the demo.
# `make test`  : create .venv if needed, install the pinned stack, run the tests (incl. timm's test_models.py).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.ttt_zoo_installed
TIMM_VERSION := 1.0.31
TIMM_SUITE := tools/timm_suite/test_models.py
PYTEST_ARGS ?=
JOBS ?= 2

.PHONY: demo test test-main test-fast test-slow test-timm test-kernels test-compile venv clean

venv: $(STAMP)

# a new venv takes about 7 GB (torch 2.14.1 is a CUDA build; the OpenMMLab stack); pip's temporary files need more
VENV_DISK_GB ?= 10

$(STAMP): requirements.txt pyproject.toml
	@free=$$(df -Pk . | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	if [ ! -x $(PY) ] && [ "$$free" -lt $(VENV_DISK_GB) ]; then \
	  echo "error: $$free GB free on the disk of $(CURDIR); a new $(VENV) needs about $(VENV_DISK_GB) GB (torch is a CUDA build): free some space, or set VENV_DISK_GB=N to try anyway" >&2; exit 1; fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

include mk/openmmlab.mk
include mk/gpu.mk

demo: venv
	$(VENV)/bin/ttt-zoo demo

# the default test run: tools/test_stages.py runs every stage, then prints (and writes to .cache/test-times.txt) each
# stage's wall time and counts, every skip reason, and the 10 slowest tests.  A skip for a missing fixture or
# package fails the run.  The stages:
# - main: unit, parity and numerics tests, TRITON_INTERPRET=0 (forcing the Triton backend raises there);
# - kernels: the `triton` tests (the Triton interpreter), one pytest process per file: in xdist workers shared with
#   other files a later custom-op call crashed (SIGSEGV, `vector::reserve` errors from the dispatcher) although
#   every interpreted load and store is in bounds (tests/triton_bounds.py);
# - compile: whole-model torch.compile (marker `compile`, inductor, minutes of CPU each);
# - mm: the OpenMMLab tests train in-process through mmengine's Runner, which changes process-wide state;
# - timm: timm's own tests/test_models.py on our models, and timm's ONNX export with both exporters
#   (tests/test_timm_onnx_export.py).
STAGES = $(PY) tools/test_stages.py --jobs $(JOBS)
test: venv $(TIMM_SUITE)
	$(STAGES) -- $(PYTEST_ARGS)

test-main: venv
	$(STAGES) --stages main -- $(PYTEST_ARGS)

test-kernels: venv
	$(STAGES) --stages kernels -- $(PYTEST_ARGS)

test-compile: venv
	$(STAGES) --stages compile -- $(PYTEST_ARGS)

test-fast: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(JOBS) -q tests --ignore=tests/test_mm_adapters.py -m "not slow" $(PYTEST_ARGS)

test-slow: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(JOBS) -q tests --ignore=tests/test_mm_adapters.py -m slow $(PYTEST_ARGS)

# timm's tests/test_models.py from the pinned sdist, restricted to our models by tools/timm_suite/conftest.py
$(TIMM_SUITE): | venv
	@mkdir -p .cache
	$(PIP) download -q --no-deps --no-binary :all: timm==$(TIMM_VERSION) -d .cache/timm-sdist
	tar -xzf .cache/timm-sdist/timm-$(TIMM_VERSION).tar.gz -C .cache timm-$(TIMM_VERSION)/tests/test_models.py
	cp .cache/timm-$(TIMM_VERSION)/tests/test_models.py $(TIMM_SUITE)

test-timm: venv $(TIMM_SUITE)
	$(STAGES) --stages timm -- $(TIMM_ARGS)

clean:
	rm -rf $(VENV) .cache $(TIMM_SUITE)
