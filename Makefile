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

.PHONY: demo test test-fast test-slow test-timm test-triton venv clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

include mk/openmmlab.mk

demo: venv
	$(VENV)/bin/ttt-zoo demo

# the default test run: unit + parity + Triton-interpreter tests, then timm's own model tests
# the OpenMMLab tests train in-process through mmengine's Runner, which changes process-wide state that later
# kernel tests in the same worker then see: they run in their own pytest process (test-mm)
# the Triton-interpreter tests (marker `triton`) run one test file per process: in shared xdist workers the
# interpreter crashed (SIGSEGV, then `vector::reserve` errors) after other files' kernels had run in the same process
test: venv $(TIMM_SUITE)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -n $(JOBS) -q tests --ignore=tests/test_mm_adapters.py -m "not triton" $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-triton
	$(MAKE) --no-print-directory test-mm
	$(MAKE) --no-print-directory test-timm

test-triton: venv
	@for f in $$(grep -l "triton" tests/test_*.py); do \
	  HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider -m triton $$f $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; \
	done

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
	cd tools/timm_suite && HF_HUB_OFFLINE=1 ../../$(PY) -m pytest -n $(JOBS) -q -p no:cacheprovider test_models.py $(TIMM_ARGS)

clean:
	rm -rf $(VENV) .cache $(TIMM_SUITE)
