#!/usr/bin/env bash
# The GPU lease in one prepared call (tools/README.md "gpu_lease.sh" says how to run it and read what comes back):
#   bash tools/gpu_lease.sh [BUDGET_S] [STEP...]        # BUDGET_S default 540; STEPs default: all five, in order
# under the device tool: run(command="bash tools/gpu_lease.sh 540", carry=[".whl"], timeout_s=560).
#
# It stops in one line (exit 2) before running anything if something is missing: the pinned timm wheel in .whl/
# (made on the CPU by `make gpu-wheel`; installed into $GPU_LEASE_CACHE/site), a CUDA device, the checkout's ttt_zoo
# importable (with the checkout on PYTHONPATH: nothing is built) with the pinned timm.
# Then the steps, each unit within its own cap, its step's cap and the budget left (a unit that cannot get its
# minimum is skipped in one logged line):
#   verify_vit3    150 s  tools/gpu_check.py tests + records of the ViT3 ops (a record only when every collected
#                         cuda case of the op ran and passed)
#   bench_eager    100 s  ViT3-T (Triton path) against DeiT-T, bf16, eager: 224 train, 512 train (its peak-memory
#                         column), 1248 inference, 2048 both
#   bench_graphs   140 s  the same, both compiled with CUDA graphs (torch.compile mode reduce-overhead)
#   profile         60 s  ttt-zoo bench --profile, ViT3-T and DeiT-T training at 224 and 2048
#   verify_others  rest   gpu_check of the other ops, one kernel folder per unit, while time is left
# Every result is written as it is made into the work folder $GPU_LEASE_CACHE/gpu_lease/ and packed into
# $OUT/gpu_lease.tgz (written beside, then renamed) after each unit, every GPU_LEASE_PACK_EVERY seconds while one
# runs, and on SIGTERM/SIGINT; $OUT/timeline.txt is the log.  The Triton and inductor caches stay in
# $GPU_LEASE_CACHE (default .cache/gpu, git-ignored): a second call on the warm machine reuses them.
# Exit status: 0 every unit that ran passed, 1 some unit failed or was cut at its cap, 2 refused, 128+N a signal.
#
# GPU_LEASE_DRY_RUN=1: the CPU dry run (tests/test_gpu_lease.py): the same checks, steps, packing and records
# rule, with gpu_check --dry-run (Triton interpreter, the first selected case of each file), one tiny eager bench
# unit (32 px, depth 1) and a tiny profile; the wheel must be there but is not installed (the running Python's
# timm is checked against the pin), and records go into the work folder, never kernels/gpu_verified.json.
# Also: GPU_LEASE_PYTHON (default python3), GPU_LEASE_WHEELS (default .whl), GPU_LEASE_HANG_AT=UNIT (test hook:
# that unit writes hanging.UNIT into the work folder and sleeps until it is killed), GPU_LEASE_PLAN=1 (print the GPU
# run's units, name, cap, minimum and command, and run nothing), GPU_LEASE_PACK_EVERY (seconds, default 20).
set -u
T0=$(date +%s)
cd "$(dirname "$0")/.." || exit 2
die() { echo "error: $*" >&2; exit 2; }

BUDGET=${1:-540}
[[ $BUDGET =~ ^[0-9]+$ ]] ||
  die "BUDGET_S '$BUDGET' is not a whole number of seconds; give e.g. 540 (the call's timeout_s less 20)"
[ $# -gt 0 ] && shift
ALL_STEPS=(verify_vit3 bench_eager bench_graphs profile verify_others)
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=("${ALL_STEPS[@]}")
for s in "${STEPS[@]}"; do
  [[ " ${ALL_STEPS[*]} " == *" $s "* ]] || die "no step '$s'; choose from: ${ALL_STEPS[*]}"
done
DRY=${GPU_LEASE_DRY_RUN:-0}
PLAN=${GPU_LEASE_PLAN:-0}  # print the GPU run's units (name, cap s, min s, command), run nothing, need nothing
if [ "$PLAN" = 1 ]; then
  DRY=0 GPU_LEASE_CACHE=$(mktemp -d) OUT=
  trap 'rm -rf "$GPU_LEASE_CACHE"' EXIT
fi
PY=${GPU_LEASE_PYTHON:-python3}
WHEELS=${GPU_LEASE_WHEELS:-.whl}
CACHE=$(realpath -m "${GPU_LEASE_CACHE:-.cache/gpu}")
OUT=$(realpath -m "${OUT:-$CACHE/out}")
PACK_EVERY=${GPU_LEASE_PACK_EVERY:-20}
HANG_AT=${GPU_LEASE_HANG_AT:-}
RESERVE=15  # seconds kept back from the budget: a unit's kill grace and the last pack
SCALE=1  # the caps' factor: 10 in the dry run, where a loaded CPU is slow (it checks the flow, not the time)
[ "$DRY" = 1 ] && SCALE=10

# ------------------------------------------------------------------ what must be there, before anything runs
TIMM=$(sed -n 's/^timm==\([0-9][0-9.]*\).*/\1/p' requirements.txt)
[ -n "$TIMM" ] || die "requirements.txt pins no timm (a line timm==VERSION); restore it"
WHEEL=$(ls "$WHEELS"/timm-"$TIMM"-*.whl 2>/dev/null | head -n 1)
[ -n "$WHEEL" ] || [ "$PLAN" = 1 ] ||
  die "no timm $TIMM wheel in $WHEELS/; make it on the CPU with \`make gpu-wheel\`" \
  "and carry it with the call (carry: [\".whl\"])"
if [ "$DRY" != 1 ] && [ "$PLAN" != 1 ]; then
  why=$("$PY" -c "import torch; print('' if torch.cuda.is_available() else f'torch {torch.__version__} sees none')" \
    2>&1 | tail -n 1)
  [ -z "$why" ] || die "no CUDA device here ($why); run it on the GPU machine, or GPU_LEASE_DRY_RUN=1 on the CPU"
fi

R=$CACHE/gpu_lease  # the work folder: every result as it is made
rm -rf "$R" && mkdir -p "$R" "$CACHE/triton" "$CACHE/inductor" || die "cannot make the work folder $R"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=$CACHE/triton TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
QUIET=1  # until the checks pass, the timeline goes to its file only (a refusal prints its one line)
log() {
  local line="[$(( $(date +%s) - T0 )) s] $*"
  echo "$line" >>"$R/timeline.txt"
  [ "$QUIET" = 1 ] || echo "$line"
}

check_imports() {  # one line: the versions, or (exit 1) why the package or the pinned timm cannot be imported
  "$PY" - "$TIMM" "$DRY" <<'EOF'
import os, sys
want, dry = sys.argv[1], sys.argv[2] == "1"
def fail(msg):
    print(msg)
    sys.exit(1)
try:
    import torch, timm, ttt_zoo, ttt_zoo.kernels
except Exception as e:
    fail(f"{type(e).__name__}: {e}")
for mod, folder in ((ttt_zoo, "ttt_zoo"), (ttt_zoo.kernels, "kernels")):
    if os.path.realpath(os.path.dirname(mod.__file__)) != os.path.realpath(folder):
        fail(f"{mod.__name__} is imported from {os.path.dirname(mod.__file__)}, not from this checkout's {folder}/")
if timm.__version__ != want:
    fail(f"timm is {timm.__version__} ({os.path.dirname(timm.__file__)}), not the pinned {want}")
try:
    import triton
    tv = triton.__version__
except ImportError:
    if not dry:
        fail("triton is not installed")
    tv = "none"
gpu = "none (dry run)" if dry else torch.cuda.get_device_name()
print(f"gpu {gpu}; torch {torch.__version__}; cuda {torch.version.cuda}; triton {tv}; timm {timm.__version__}; "
      f"ttt_zoo {os.path.dirname(ttt_zoo.__file__)}")
EOF
}

install_wheel() {  # the pinned timm into $CACHE/site, once per machine
  [ -d "$CACHE/site/timm-$TIMM.dist-info" ] && return
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$CACHE/site" "$WHEEL" \
    >>"$R/install.log" 2>&1
}

log "lease: budget $BUDGET s, steps ${STEPS[*]}$([ "$DRY" = 1 ] && echo ' (DRY RUN: the CPU, tiny)')"
# the checkout itself is the package (ttt_zoo/__init__.py maps kernels/ as ttt_zoo.kernels): nothing to build
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "$PLAN" = 1 ]; then
  versions="plan only"
elif [ "$DRY" = 1 ]; then
  log "dry run: $WHEEL is there, not installed ($PY's own timm must be the pinned $TIMM)"
  versions=$(check_imports) || die "cannot run the package with $PY ($versions); install it (make venv)"
else
  install_wheel
  export PYTHONPATH=$CACHE/site:$PYTHONPATH
  versions=$(check_imports) || die "cannot run the package with $PY ($versions); see $R/install.log"
  nvidia-smi >"$R/nvidia-smi.txt" 2>&1
fi
echo "$versions" >"$R/versions.txt"
mkdir -p "$OUT" || die "cannot make OUT $OUT"
log "versions: $versions"
QUIET=0
cat "$R/timeline.txt"

# ------------------------------------------------------------------------------ packing and the units
pack() {  # the work folder into $OUT/gpu_lease.tgz, atomically; the timeline beside it
  cp "$R/timeline.txt" "$OUT/timeline.txt.part" && mv -f "$OUT/timeline.txt.part" "$OUT/timeline.txt"
  tar czf "$OUT/gpu_lease.tgz.part" --exclude='.tmp-*' --exclude='*.tmp' -C "$CACHE" gpu_lease 2>"$CACHE/pack.err"
  if [ $? -le 1 ]; then  # 1: a file changed while it was read (a row being written): the others are complete
    mv -f "$OUT/gpu_lease.tgz.part" "$OUT/gpu_lease.tgz"
  else
    log "pack failed: $(tail -n 1 "$CACHE/pack.err")"
  fi
}

echo "| unit | status | seconds | cap s |" >"$R/summary.md"
echo "|---|---|---:|---:|" >>"$R/summary.md"
UNIT= UNIT_PID= STEP_END=0 FAILED=0
now() { date +%s; }
left() { echo $(( BUDGET - RESERVE - ($(now) - T0) )); }
step() {  # name, cap s: the units that follow share it
  STEP_END=$(( $(now) + $2 * SCALE ))
  local l; l=$(left)
  log "step $1 (cap $(( $2 * SCALE )) s, $(( l > 0 ? l : 0 )) s of the budget left)"
}

unit() {  # name, cap s, min s, command... (@DEADLINE@ in it: the unit's seconds less 15)
  local name=$1 cap=$(( $2 * SCALE )) min=$3 t rc start status n=0
  shift 3
  t=$(( cap < $(left) ? cap : $(left) ))
  t=$(( t < STEP_END - $(now) ? t : STEP_END - $(now) ))
  if (( t < min )) && [ "$PLAN" != 1 ]; then
    log "skip $name: $(( t > 0 ? t : 0 )) s left for it, it needs at least $min s"
    echo "| $name | skipped | 0 | $cap |" >>"$R/summary.md"
    return
  fi
  local cmd=("${@//@DEADLINE@/$(( t - 15 ))}")
  if [ "$PLAN" = 1 ]; then
    printf '%s\t%s\t%s\t' "$name" "$cap" "$min"
    printf '%q ' "${cmd[@]}"
    echo
    return
  fi
  if [ "$name" = "$HANG_AT" ]; then
    cmd=(bash -c 'touch "$0"; exec sleep 3600' "$R/hanging.$name")
  fi
  log "start $name (cap $t s): ${cmd[*]}"
  start=$(now)
  UNIT=$name
  timeout -k 10 "$t" "${cmd[@]}" >"$R/$name.log" 2>&1 &  # its own process group (timeout's)
  UNIT_PID=$!
  while kill -0 "$UNIT_PID" 2>/dev/null; do
    sleep 1 & wait $!
    (( ++n % PACK_EVERY )) || pack
  done
  wait "$UNIT_PID"
  rc=$?
  kill -KILL -- "-$UNIT_PID" 2>/dev/null  # whatever it left behind (pytest-xdist workers, a bench child)
  UNIT_PID=
  case $rc in
    0) status=passed ;;
    124|137) status="cut at its cap (rc $rc)"; FAILED=1 ;;
    *) status="failed (rc $rc)"; FAILED=1 ;;
  esac
  log "$name: $status, $(( $(now) - start )) s; log $name.log"
  echo "| $name | $status | $(( $(now) - start )) | $t |" >>"$R/summary.md"
  pack
}

on_signal() {  # the unit running ends, everything finished so far is packed
  trap - TERM INT
  log "stopped by SIG$1 during ${UNIT:-setup}"
  echo "| ${UNIT:-setup} | stopped by SIG$1 | $(( $(now) - T0 )) s into the run | |" >>"$R/summary.md"
  if [ -n "$UNIT_PID" ]; then
    kill -TERM "$UNIT_PID" 2>/dev/null  # timeout passes it on to the unit's group, SIGKILL 10 s later
    wait "$UNIT_PID"
    kill -KILL -- "-$UNIT_PID" 2>/dev/null
  fi
  pack
  exit "$2"
}
trap 'on_signal TERM 143' TERM
trap 'on_signal INT 130' INT

# ------------------------------------------------------------------------------------------- the steps
GPU_CHECK=("$PY" tools/gpu_check.py --steps tests records --deadline @DEADLINE@)
BENCH=("$PY" -m ttt_zoo bench)
if [ "$DRY" = 1 ]; then
  GPU_CHECK+=(--dry-run --first 1 --records "$R/gpu_verified.json")
  HOW=(--model-kwargs depth=1 --device cpu --threads 1 -b 1 --num-warm-iter 0 --num-bench-iter 1)
else
  GPU_CHECK+=(--parallel 2 --xdist 8 --xdist-op 8 --test-timeout 100)
  HOW=(--backend triton --device cuda --amp --amp-dtype bfloat16 --num-warm-iter 3 --num-bench-iter 10
       --batch-tokens 12544)
fi
VS_DEIT=(--model vit3_tiny --peers deit_tiny_patch16_224 "${HOW[@]}")

verify() {  # unit name, cap s, min s, ops...: their tests on CUDA, then a record for each op that passed
  local name=$1 cap=$2 min=$3
  shift 3
  unit "$name" "$cap" "$min" "${GPU_CHECK[@]}" --only-ops "$@" --output "$R/$name"
  if [ "$DRY" != 1 ]; then  # gpu_check wrote the checkout's records file
    cp kernels/gpu_verified.json "$R/gpu_verified.json" && pack
  fi
}

step_verify_vit3() {
  step verify_vit3 150
  verify verify_vit3 150 60 vit3_swiglu_ttt vit3_dwconv_ttt vit3_qkv_ttt
}

BENCH_UNITS=(224_train "--bench train --img-size 224" 512_memory "--bench train --img-size 512"
             1248_infer "--bench inference --img-size 1248" 2048_both "--bench both --img-size 2048")

bench_units() {  # prefix, min s, caps (one per size), runtime args...: one bench run per size
  local prefix=$1 min=$2 i
  local caps=($3)
  shift 3
  for i in 0 1 2 3; do
    local name=${prefix}_${BENCH_UNITS[2 * i]}
    # shellcheck disable=SC2206
    local what=(${BENCH_UNITS[2 * i + 1]})
    unit "$name" "${caps[i]}" "$min" "${BENCH[@]}" "${VS_DEIT[@]}" "$@" "${what[@]}" --output "$R/$name"
  done
}

step_bench_eager() {
  step bench_eager 100
  if [ "$DRY" = 1 ]; then
    unit eager_32_train 120 20 "${BENCH[@]}" "${VS_DEIT[@]}" --bench train --img-size 32 --output "$R/eager_32_train"
  else
    bench_units eager 20 "30 30 30 50" --runtime torch
  fi
}

step_bench_graphs() {  # each compiled row compiles for tens of seconds; a second call reuses the inductor cache
  step bench_graphs 140
  if [ "$DRY" = 1 ]; then
    log "bench_graphs: no unit in the dry run (CUDA graphs need CUDA)"
  else
    bench_units graphs 30 "90 70 70 120" --runtime compile --torchcompile-mode reduce-overhead
  fi
}

step_profile() {
  step profile 60
  if [ "$DRY" = 1 ]; then  # ViT3-T alone
    unit profile 60 20 "${BENCH[@]}" --model vit3_tiny "${HOW[@]}" --profile --bench train --img-size 32 \
      --output "$R/profile"
  else
    unit profile 60 30 "${BENCH[@]}" "${VS_DEIT[@]}" --profile --profile-top 40 --bench train --img-size 224 2048 \
      --output "$R/profile"
  fi
}

step_verify_others() {  # the kernel folders in the order of their glue (issue 39 item 3)
  step verify_others "$BUDGET"
  verify verify_ttt_linear 150 45 ttt_linear ttt_linear_bidir
  verify verify_inner_mlp 120 45 t5_swiglu_ttt dit5_mlp_ttt
  verify verify_vit3_variant 90 40 vit3_variant_qkv_ttt
  verify verify_key_norm 60 30 key_instance_norm
  verify verify_linear_attention 60 30 linear_attention
}

pack
for s in "${STEPS[@]}"; do
  "step_$s"
done
log "done: $([ $FAILED = 0 ] && echo 'every unit that ran passed' || echo 'some unit failed or was cut');" \
  "read $OUT/gpu_lease.tgz (gpu_lease/summary.md)"
pack
cat "$R/summary.md"
exit $FAILED
