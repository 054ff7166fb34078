#!/usr/bin/env bash
# Install the OpenMMLab stack (mmcv 2.1.0 built from source with CPU ops, mmengine, mmdet, mmseg) into a venv.
# The mmcv wheel is cached under $CACHE/<torch version>-<python tag>-<platform>/ so a rebuild only happens
# when torch, Python or the platform change (pip's own wheel cache is keyed by the sdist only).
# Usage: tools/openmmlab/install.sh [VENV_PYTHON] ; env: CACHE (default ~/.cache/ttt-zoo/mmcv, one cache per machine), MAX_JOBS (default 2).
set -euo pipefail
PY="${1:-.venv/bin/python}"
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ttt-zoo/mmcv}"
MMCV_VERSION=2.1.0
PIP=("$PY" -m pip)

key="$("$PY" - <<'PYEOF'
import sys, sysconfig, torch
print(f"torch{torch.__version__.replace('+', '_')}-cp{sys.version_info[0]}{sys.version_info[1]}-{sysconfig.get_platform()}")
PYEOF
)"
dir="$CACHE/$key"
mkdir -p "$dir"
# build requirements (mmcv is built without isolation against the installed torch)
"${PIP[@]}" install -q "setuptools>=77.0.3,<82" wheel ninja

whl="$(ls "$dir"/mmcv-$MMCV_VERSION-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$whl" ]; then
  echo "[openmmlab] building mmcv $MMCV_VERSION for $key (about 11 min on 2 cores)"
  start=$(date +%s)
  "${PIP[@]}" download -q --no-deps --no-binary :all: "mmcv==$MMCV_VERSION" -d "$CACHE/sdist"
  # build in a source tree under the cache (removed after a successful build)
  src="$CACHE/src-$key/mmcv-$MMCV_VERSION"
  [ -d "$src" ] || { mkdir -p "$CACHE/src-$key" && tar -xzf "$CACHE/sdist/mmcv-$MMCV_VERSION.tar.gz" -C "$CACHE/src-$key"; }
  TTT_ZOO_REAL_CXX="${CXX:-c++}" CXX="$HERE/cxx20" MMCV_WITH_OPS=1 FORCE_CUDA=0 MAX_JOBS="${MAX_JOBS:-2}" \
    "${PIP[@]}" wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$dir.tmp" "$src"
  mv "$dir.tmp"/mmcv-$MMCV_VERSION-*.whl "$dir"/ && rmdir "$dir.tmp" && rm -rf "$CACHE/src-$key"
  echo "[openmmlab] mmcv build took $(( $(date +%s) - start )) s"
  whl="$(ls "$dir"/mmcv-$MMCV_VERSION-*.whl | head -n1)"
fi
"${PIP[@]}" install -q --no-deps "$whl"
# mmcv's runtime deps, then the rest of the stack (pinned; mmdet 3.3 / mmseg 1.2.2 refuse mmcv 2.2)
"${PIP[@]}" install -q addict packaging pyyaml yapf "opencv-python==4.14.0.94" \
  "mmengine==0.10.7" "mmdet==3.3.0" "mmsegmentation==1.2.2" ftfy regex "setuptools>=77.0.3,<82" \
  pycocotools shapely scipy terminaltables prettytable
"$PY" -c "from mmcv.ops import nms, RoIAlign; import mmdet, mmseg, mmengine; print('[openmmlab] ok: mmcv ops, mmdet', mmdet.__version__, 'mmseg', mmseg.__version__)"
