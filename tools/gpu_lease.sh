#!/usr/bin/env bash
# One short GPU lease, prepared on the CPU: set up the package on the leased machine, then run the GPU checks within
# a fixed budget and pack every result into $OUT/gpu.tgz (the lease returns at most 8 files).
#   bash tools/gpu_lease.sh verify BUDGET   # kernel tests on CUDA + records, the benchmark vs DeiT-T, the profile
#   bash tools/gpu_lease.sh compile BUDGET  # the kernel files again, then ViT3-T vs DeiT-T under CUDA graphs
#                                           # (torch.compile mode reduce-overhead) and eager at 2048
#   bash tools/gpu_lease.sh diag BUDGET     # records for three ops, the tracebacks of the failing tests
#   bash tools/gpu_lease.sh retry BUDGET    # the CUDA file and the op files that can pass + records, ViT3-T vs DeiT-T
#                                           # at 1248 and 2048 (the second lease of 2026-11-26)
# The machine's image has torch/triton; timm is carried as a wheel in .whl/ (pinned like the CPU machines).
set -u
MODE=${1:-verify}
BUDGET=${2:-420}
T0=$(date +%s)
R=/tmp/gpu_run/gpu
mkdir -p "$R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_INTERPRET=0
left() { echo $((BUDGET - ($(date +%s) - T0))); }
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/timeline.txt"; }
pack() { mkdir -p "${OUT:-/tmp/out}"; tar czf "${OUT:-/tmp/out}/gpu.tgz" -C "$R/.." gpu kernels_records.json 2>/dev/null; stamp packed; }
trap pack EXIT

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$R/install.log" 2>&1 \
  || { ln -sfn ../kernels ttt_zoo/kernels; export PYTHONPATH=$PWD:${PYTHONPATH:-}; echo "editable install failed: symlink" >>"$R/install.log"; }
nvidia-smi >"$R/nvidia-smi.txt" 2>&1
python3 - <<'EOF' 2>&1 | tee "$R/versions.txt"
import torch, timm, triton, ttt_zoo.kernels as k
print("gpu", torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "timm", timm.__version__, "kernels", k.__file__)
EOF
stamp setup done

BENCH=(python3 -c "import sys; from ttt_zoo.cli import main; sys.exit(main())" bench --device cuda --amp
       --amp-dtype bfloat16 --num-warm-iter 3 --num-bench-iter 10)
bench() {  # name, seconds at most, bench args...
  local name=$1 cap=$2; shift 2
  local t=$(( $(left) < cap ? $(left) : cap ))
  if [ "$t" -lt 15 ]; then stamp "skip $name (no time left)"; return; fi
  timeout "$t" "${BENCH[@]}" "$@" --output "$R/$name" >"$R/$name.log" 2>&1
  local rc=$?
  pkill -f ttt_zoo.bench.child 2>/dev/null  # a timed-out run leaves its measuring child behind
  stamp "$name rc $rc (cap $t s)"
}

check() {  # deadline, files at once, xdist workers for the cuda file, test files...: tests + records
  local deadline=$1 parallel=$2 xdist=$3; shift 3
  python3 tools/gpu_check.py --steps tests records --output "$R/check" --deadline "$deadline" --parallel "$parallel" \
    --xdist "$xdist" --test-files "$@" >"$R/check.log" 2>&1
  stamp "gpu_check rc $?"
  pkill -f pytest 2>/dev/null  # workers of a timed-out file
  cp kernels/gpu_verified.json "$R/../kernels_records.json"
}

if [ "$MODE" = verify ]; then
  check 150 9 3 test_op_backend.py test_op_inner_mlp.py test_op_key_norm.py test_op_linear_attention.py \
    test_op_ttt_linear.py test_op_vit3_ttt.py test_op_vit3_variants.py test_numerics.py test_kernels_cuda.py
fi
if [ "$MODE" = diag ]; then  # the fourth lease: records for the ops whose files passed, and the failures' tracebacks
  TTT_ZOO_EAGER_FAILURES=1 timeout $(( BUDGET - 60 )) python3 -m pytest -v -p no:cacheprovider -n 4 --timeout=100 \
    -o timeout_method=signal tests/test_op_vit3_ttt.py::test_dispatch_under_torch_compile \
    "tests/test_op_vit3_ttt.py::test_swiglu_kernels" tests/test_op_inner_mlp.py::test_torch_compile_fullgraph \
    tests/test_op_inner_mlp.py::test_inner_kernels tests/test_op_ttt_linear.py::test_torch_compile_fullgraph \
    tests/test_kernels_cuda.py -k "not cuda or 2x2x999x72 or 2x2x999x48" >"$R/diag.log" 2>&1 &
  DIAG=$!
  python3 tools/gpu_check.py --steps tests records --output "$R/check" --deadline $(( BUDGET - 70 )) --parallel 4 \
    --xdist 4 --xdist-op 3 --only-ops linear_attention key_instance_norm vit3_variant_qkv_ttt \
    --test-files test_op_linear_attention.py test_op_key_norm.py test_op_vit3_variants.py test_kernels_cuda.py \
    >"$R/check.log" 2>&1
  stamp "gpu_check rc $?"
  cp kernels/gpu_verified.json "$R/../kernels_records.json"
  wait $DIAG; stamp "diag rc $?"
  exit 0
fi
if [ "$MODE" = compile ]; then  # the third lease: every kernel file again (fixes of the second), then CUDA graphs
  check 230 8 8 test_op_backend.py test_op_inner_mlp.py test_op_key_norm.py test_op_linear_attention.py \
    test_op_ttt_linear.py test_op_vit3_ttt.py test_op_vit3_variants.py test_kernels_cuda.py
  bench bench_compile_2048 200 --model vit3_tiny --backend triton --peers deit_tiny_patch16_224 --runtime compile \
    --torchcompile-mode reduce-overhead --bench both --img-size 2048 --batch-tokens 12544
  bench bench_eager_2048 100 --model vit3_tiny --backend triton --peers deit_tiny_patch16_224 --bench both \
    --img-size 2048 --batch-tokens 12544
  stamp done
  exit 0
fi
if [ "$MODE" = retry ]; then
  check 170 6 8 test_op_key_norm.py test_op_linear_attention.py test_op_vit3_ttt.py test_op_vit3_variants.py \
    test_kernels_cuda.py
  bench bench_vit3_large 140 --model vit3_tiny --backend triton --peers deit_tiny_patch16_224 --bench both \
    --img-size 1248 2048 --batch-tokens 12544
  stamp done
  exit 0
fi
bench bench_vit3 110 --model vit3_tiny --backend triton torch --peers deit_tiny_patch16_224 --bench both \
  --img-size 224 1248 2048 --batch-tokens 12544
bench profile 50 --profile --model vit3_tiny --backend triton torch --bench train --img-size 224 2048 \
  --batch-tokens 12544 --profile-top 40
bench bench_families 60 --model hvit3_tiny visionttt_tiny visionttt_h_tiny t5_tiny --peers deit_tiny_patch16_224 \
  --bench both --img-size 1248 --batch-tokens 12544
PYTHONPATH=$PWD/tools:${PYTHONPATH:-} bench bench_dit 40 --import gpu_check --model gpucheck_dit3_s_2 \
  gpucheck_dit5_s_2 --peers gpucheck_dit_s_2 --bench both --img-size 128 -b 3
stamp done
