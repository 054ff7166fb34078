# OpenMMLab stack for the detection/segmentation adapters (include from the top-level Makefile:
# `include mk/openmmlab.mk`; needs VENV, PY from there).
#   make openmmlab : build mmcv 2.1.0 with its CPU ops (about 11 min on 2 idle cores, once per machine: the wheel
#                    is cached under ~/.cache/ttt-zoo/mmcv/<torch version>-<python>-<platform>/), install it with mmengine
#                    0.10.7, mmdet 3.3.0, mmsegmentation 1.2.2, then check `from mmcv.ops import nms, RoIAlign`.
#   make test-mm   : the mmdet/mmseg smoke-training tests (tests/test_mm_adapters.py, marker `mm`).
OPENMMLAB_STAMP := $(VENV)/.openmmlab_installed
MMCV_CACHE ?= $(HOME)/.cache/ttt-zoo/mmcv

.PHONY: openmmlab test-mm

openmmlab: $(OPENMMLAB_STAMP)

$(OPENMMLAB_STAMP): tools/openmmlab/install.sh | venv
	CACHE=$(MMCV_CACHE) bash tools/openmmlab/install.sh $(PY)
	@touch $(OPENMMLAB_STAMP)

# `make test` also runs the mm tests, so it needs the stack
test: openmmlab

test-mm: venv openmmlab
	$(STAGES) --stages mm -- $(PYTEST_ARGS)
