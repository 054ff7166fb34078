#!/usr/bin/env bash
# The GPU lease (15 minutes of device time in all) in one prepared call, plus an optional second one
# (tools/README.md "gpu_lease.sh" says how to run it and read what comes back):
#   bash tools/gpu_lease.sh --preflight [BUDGET_S]   # on the CPU first: exit 0 only if a lease would not be wasted
#   bash tools/gpu_lease.sh [--resume] [BUDGET_S] [STEP|UNIT...]  # on the GPU: BUDGET_S default 540; all steps
# under the device tool: run(command="bash tools/gpu_lease.sh 540", carry=[".whl"], timeout_s=560), then, if the
# device time left allows, run(command="bash tools/gpu_lease.sh --resume 170", timeout_s=190) on the warm machine:
# the units the first call skipped or cut at their cap.
#
# The steps, most valuable first (GPU_LEASE_PLAN=1 prints every unit: name, step, cap, minimum, call, command):
#   kernels_json    `ttt-zoo kernels --verify --json`, where this checkout's CLI has it
#   verify          tools/gpu_check.py tests + records, one unit per kernel folder, from the op registry
#                   (ttt_zoo.kernels.available_ops(): a new op's folder gets a unit of DEFAULT_VERIFY_CAP)
#   bench_families  tools/gpu_check.py --steps bench --sizes 224: one model of each family vs DeiT-T, DiT3 / DiT5
#                   vs DiT-S/2, bf16 eager
#   graphs          ViT3-T vs DeiT-T compiled with CUDA graphs (reduce-overhead) at 224 and 1024
#   profile         ttt-zoo bench --profile, ViT3-T and DeiT-T training at 224
# Each unit runs in its own process group within its cap and the budget left (a unit that cannot get its minimum
# is skipped in one logged line; --resume runs it in the next call).
#
# Before any device call it stops in one line (exit 2) if a wheel of WHEEL_RULES is missing from .whl/ (made on the
# CPU by `make gpu-wheel`). On the device the first thing it does is write $OUT/versions.txt (python, torch, CUDA
# build, Triton, driver: read without a CUDA call); then it installs, offline, only the wheels whose package the
# device lacks (into $GPU_LEASE_CACHE/site) and stops in one line (exit 2, with what it wrote) if the stack cannot
# run the steps: no CUDA device, torch / triton / timm / the test plugins not importable, the checkout not the
# package imported.
# Every result is written as it is made into the work folder $GPU_LEASE_CACHE/gpu_lease/; after each unit, every
# GPU_LEASE_PACK_EVERY seconds while one runs, and on SIGTERM/SIGINT, $OUT gets summary.md and timeline.txt (each
# written beside, then renamed) and gpu_lease.tgz (the whole work folder). The Triton and inductor caches stay in
# $GPU_LEASE_CACHE (default .cache/gpu, git-ignored): a second call on the warm machine reuses them.
# Exit status: 0 every unit that ran passed, 1 some unit failed or was cut at its cap, 2 refused, 128+N a signal.
#
# GPU_LEASE_DRY_RUN=1: the CPU dry run (tests/test_gpu_lease.py, experiments/gpu_lease_dry_run.py): the same
# checks, steps, packing and records rule, with gpu_check --dry-run (Triton interpreter, the first selected case of
# each file), its tiny benchmark and a tiny profile, no CUDA-graph unit; records go into the work folder, never
# kernels/gpu_verified.json; caps x10 (a loaded CPU is slow).
# Also: GPU_LEASE_PYTHON (default python3), GPU_LEASE_WHEELS (default .whl), GPU_LEASE_HANG_AT=UNIT (test hook:
# that unit writes hanging.UNIT into the work folder and sleeps until it is killed), GPU_LEASE_PACK_EVERY (seconds,
# default 20), --wheel-specs (print NAME==VERSION of each wheel to carry; `make gpu-wheel` downloads them).
set -u
T0=$(date +%s)
cd "$(dirname "$0")/.." || exit 2
die() { echo "error: $*" >&2; exit 2; }

MODE=run
case ${1:-} in
  --preflight|--wheel-specs|--resume) MODE=${1#--}; shift ;;
  --plan) MODE=plan; shift ;;
  -*) [[ ${1:-} =~ ^-[0-9] ]] || die "no option '$1'; use --preflight, --resume, --plan or --wheel-specs" ;;
esac
[ "${GPU_LEASE_PLAN:-0}" = 1 ] && MODE=plan
BUDGET=${1:-540}
[[ $BUDGET =~ ^[0-9]+$ ]] ||
  die "BUDGET_S '$BUDGET' is not a whole number of seconds; give e.g. 540 (the call's timeout_s less 20)"
[ $# -gt 0 ] && shift
SECOND_CALL=170  # the optional second call's budget: 540 + 170 s of commands, 40 s of transfers, ~150 s start-up
SETUP=30         # seconds before the first unit on a fresh machine: versions, wheels, the stack check
RESERVE=15       # seconds kept back from the budget: a unit's kill grace and the last pack
DEFAULT_VERIFY_CAP=40  # a kernel folder without an entry in VERIFY_CAPS (a new op)
declare -A VERIFY_CAPS=([vit3_ttt]=85 [ttt_linear]=70 [inner_mlp]=60 [vit3_variant]=30 [key_norm]=30
                        [linear_attention]=40 [dwconv]=20 [adaln]=20 [mlp_gelu]=20)  # call 1 is full: 30 + 40 + these + bench 80 = 525
VERIFY_ORDER=(vit3_ttt ttt_linear inner_mlp vit3_variant key_norm linear_attention)  # then any other folder
ALL_STEPS=(kernels_json verify bench_families graphs profile)  # tools/gpu_check.py PLAN_ORDER
SELECT=("$@")
DRY=${GPU_LEASE_DRY_RUN:-0}
[ "$MODE" = plan ] && DRY=0
PY=python3  # the device's; the modes of the CPU take the venv's where there is one
[[ $MODE =~ ^(plan|preflight|wheel-specs)$ ]] && [ -x .venv/bin/python ] && PY=$PWD/.venv/bin/python
PY=${GPU_LEASE_PYTHON:-$PY}
WHEELS=${GPU_LEASE_WHEELS:-.whl}
PACK_EVERY=${GPU_LEASE_PACK_EVERY:-20}
HANG_AT=${GPU_LEASE_HANG_AT:-}
SCALE=1
[ "$DRY" = 1 ] && SCALE=10

# ---------------------------------------------------------------- the wheels a device run may need (one place)
# NAME OP VERSION: OP == is requirements.txt's pin (the wheel must be that version; the device's own copy is kept
# only at that version); OP >= a floor (the device's own copy is kept at or above it; the wheel is the version this
# checkout's venv has, which `make gpu-wheel` downloads); OP any: kept whenever present.
pin() { sed -n "s/^$1==\\([0-9][0-9.]*\\).*/\\1/p" requirements.txt; }
TIMM=$(pin timm)
[ -n "$TIMM" ] || die "requirements.txt pins no timm (a line timm==VERSION); restore it"
WHEEL_RULES=("timm == $TIMM" "pytest-xdist == $(pin pytest-xdist)" "pytest-timeout == $(pin pytest-timeout)"
             "pytest >= 7" "execnet >= 2.1" "pluggy >= 1.6" "iniconfig any" "packaging any" "pygments any")
for r in "${WHEEL_RULES[@]}"; do
  [[ $r =~ ^[a-z-]+\ (==\ [0-9.]+|\>=\ [0-9.]+|any)$ ]] ||
    die "requirements.txt pins no ${r%% *} (wheel rule '$r'); restore the pin"
done

wheel_specs() {  # NAME==VERSION of each wheel to carry: the pins, and the venv's version of the others
  local r name op v
  for r in "${WHEEL_RULES[@]}"; do
    read -r name op v <<<"$r"
    if [ "$op" != "==" ]; then
      v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) ||
        die "$PY has no $name, whose version the wheel takes; run it with the venv's python (make venv)"
    fi
    echo "$name==$v"
  done
}
if [ "$MODE" = wheel-specs ]; then
  wheel_specs
  exit 0
fi

missing_wheels() {  # the rules with no wheel in $WHEELS/ (a pin: of that version), one a line
  local r name op v f
  for r in "${WHEEL_RULES[@]}"; do
    read -r name op v <<<"$r"
    f=${name//-/_}
    if [ "$op" = "==" ]; then
      ls "$WHEELS/$f-$v-"*.whl >/dev/null 2>&1 || echo "$name $v"
    else
      ls "$WHEELS/$f-"[0-9]*.whl >/dev/null 2>&1 || echo "$name"
    fi
  done
}
if [ "$MODE" != plan ]; then
  lacking=$(missing_wheels | paste -sd, | sed 's/,/, /g')
  [ -z "$lacking" ] || die "no wheel of $lacking in $WHEELS/; make them on the CPU with \`make gpu-wheel\`" \
    "and carry them with the call (carry: [\".whl\"])"
fi

for s in "${SELECT[@]}"; do  # a step, or a unit the plan names
  [[ " ${ALL_STEPS[*]} " == *" $s "* ]] || [ "$MODE" = plan ] && continue
  GPU_LEASE_PLAN=1 GPU_LEASE_PYTHON=$PY bash "$0" "$BUDGET" 2>/dev/null | cut -f 1 |
    grep -qx -- "$s" && continue
  die "no step or unit '$s'; choose from: ${ALL_STEPS[*]} or a unit of \`GPU_LEASE_PLAN=1 bash $0\`"
done

CACHE=$(realpath -m "${GPU_LEASE_CACHE:-.cache/gpu}")
if [ "$MODE" = plan ] || [ "$MODE" = preflight ]; then  # nothing of a run is kept
  CACHE=$(mktemp -d) OUT=$CACHE/out
  trap 'rm -rf "$CACHE"' EXIT
fi
OUT=$(realpath -m "${OUT:-$CACHE/out}")
R=$CACHE/gpu_lease  # the work folder: every result as it is made
DONE=$CACHE/done    # a marker per unit that ran to its end (passed or failed): --resume skips it

# ------------------------------------------------------------------------------------------ the pre-flight
if [ "$MODE" = preflight ]; then
  problems=()
  bash -n "$0" 2>"$CACHE/syntax" || problems+=("tools/gpu_lease.sh does not parse: $(head -n 1 "$CACHE/syntax")")
  # shellcheck disable=SC2046
  carried=$(du -cb "$WHEELS" | tail -n 1 | cut -f 1)
  (( carried <= 64 * 1024 * 1024 )) || problems+=("$WHEELS/ is $(( carried >> 20 )) MiB; the carry takes 64 MiB")
  extra=$(ls "$WHEELS" | grep -v '\.whl$' | head -n 3 | paste -sd ' ')
  [ -z "$extra" ] || problems+=("$WHEELS/ holds more than wheels ($extra); leave only what make gpu-wheel made")
  GPU_LEASE_PLAN=1 bash "$0" "$BUDGET" "${SELECT[@]}" >"$CACHE/plan.tsv" 2>"$CACHE/plan.err" ||
    problems+=("the plan does not print: $(tail -n 1 "$CACHE/plan.err")")
  [ -s "$CACHE/plan.tsv" ] && { PYTHONPATH=$PWD HF_HUB_OFFLINE=1 "$PY" tools/gpu_check.py --check-plan \
    "$CACHE/plan.tsv" >"$CACHE/check" 2>&1 || problems+=("$(tail -n 3 "$CACHE/check" | paste -sd ';')"); }
  last=$(PYTHONPATH=$PWD "$PY" -c "from ttt_zoo.kernels.backend import load_gpu_records as l; r = l()
print(f\"torch {r[-1]['torch']}, triton {r[-1]['triton']} on {r[-1]['gpu']} ({r[-1]['date'][:10]})\" if r else 'none')" \
    2>/dev/null || echo unknown)
  if [ ${#problems[@]} -gt 0 ]; then
    for p in "${problems[@]:1}"; do echo "  also: $p" >&2; done
    die "a lease would be wasted: ${problems[0]}"
  fi
  n=$(grep -c $'\t' "$CACHE/plan.tsv")
  echo "pre-flight: ready: $n units ($(grep -c $'\t1\t' "$CACHE/plan.tsv") in call 1 of ${BUDGET} s, the rest in" \
    "call 2 of $SECOND_CALL s), wheels $(( carried >> 10 )) KiB in $WHEELS/; last device stack seen: $last"
  exit 0
fi

# -------------------------------------------------------------------------- the device's stack, before any CUDA call
if [ "$MODE" != plan ]; then
  mkdir -p "$R.new" "$OUT" "$CACHE/triton" "$CACHE/inductor" "$DONE" || die "cannot make $CACHE or OUT $OUT"
  rm -rf "$R" && mv "$R.new" "$R"
  [ "$MODE" = resume ] || rm -f "$DONE"/*
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=$CACHE/triton TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout is the package (ttt_zoo maps kernels/): no build
log() {
  local line="[$(( $(date +%s) - T0 )) s] $*"
  [ "$MODE" = plan ] && { echo "$line" >&2; return; }
  echo "$line" >>"$R/timeline.txt"
  echo "$line"
}
put() {  # a file of the work folder into $OUT, atomically
  cp "$R/$1" "$OUT/$1.part" 2>/dev/null && mv -f "$OUT/$1.part" "$OUT/$1"
}
pack() {  # summary and timeline into $OUT, and the work folder as $OUT/gpu_lease.tgz, each atomically
  put summary.md
  put timeline.txt
  tar czf "$OUT/gpu_lease.tgz.part" --exclude='.tmp-*' --exclude='*.tmp' -C "$CACHE" gpu_lease 2>"$CACHE/pack.err"
  if [ $? -le 1 ]; then  # 1: a file changed while it was read (a row being written): the others are complete
    mv -f "$OUT/gpu_lease.tgz.part" "$OUT/gpu_lease.tgz"
  else
    log "pack failed: $(tail -n 1 "$CACHE/pack.err")"
  fi
}
refuse() {  # after $OUT exists: one line, the timeline and what was written go back, exit 2
  log "refused: $*" >/dev/null
  pack
  die "$*"
}

stack() {  # python helpers of the setup: versions (no CUDA call) | missing WHEELDIR RULE... | check TIMM DRY
  "$PY" - "$@" <<'EOF'
import importlib.metadata as md, os, platform, subprocess, sys
mode, args = sys.argv[1], sys.argv[2:]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
def num(v):
    return tuple(int(p) for p in v.split("+")[0].split(".")[:3] if p.isdigit())
if mode == "versions":  # no CUDA call: torch.version.cuda is the build's, the driver from nvidia-smi
    print(f"python {platform.python_version()} ({sys.executable})")
    for name in ("torch", "triton", "timm", "pytest", "pytest-xdist", "pytest-timeout"):
        print(f"{name} {version(name) or 'missing'}")
    try:
        import torch
        print(f"torch.version.cuda {torch.version.cuda}")
    except Exception as e:
        print(f"torch import failed: {type(e).__name__}: {e}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        smi = f"nvidia-smi failed: {e}"
    print(f"gpu {smi or 'none seen by nvidia-smi'}")
elif mode == "missing":  # the wheels to install: the device lacks the package, or a pin's version, or the floor
    wheels = args[0]
    for rule in args[1:]:
        name, op, want = (rule.split() + [""])[:3]
        have = version(name)
        if have is None or (op == "==" and have != want) or (op == ">=" and num(have) < num(want)):
            stem = name.replace("-", "_") + "-" + (want + "-" if op == "==" else "")
            found = sorted(f for f in os.listdir(wheels) if f.startswith(stem) and f.endswith(".whl"))
            print(os.path.join(wheels, found[-1]))
elif mode == "check":  # one line: the versions, or (exit 1) why the stack cannot run the steps
    want, dry = args[0], args[1] == "1"
    def fail(msg):
        print(msg)
        sys.exit(1)
    try:
        import torch, timm, ttt_zoo, ttt_zoo.kernels, pytest, xdist, pytest_timeout
    except Exception as e:
        fail(f"{type(e).__name__}: {e}")
    for mod, folder in ((ttt_zoo, "ttt_zoo"), (ttt_zoo.kernels, "kernels")):
        if os.path.realpath(os.path.dirname(mod.__file__)) != os.path.realpath(folder):
            fail(f"{mod.__name__} is imported from {os.path.dirname(mod.__file__)}, not this checkout's {folder}/")
    if timm.__version__ != want:
        fail(f"timm is {timm.__version__} ({os.path.dirname(timm.__file__)}), not the pinned {want}")
    plugins = {ep.name for ep in md.entry_points(group="pytest11")}
    if not {"xdist", "timeout"} <= plugins:
        fail(f"pytest does not load pytest-xdist and pytest-timeout (its plugins: {', '.join(sorted(plugins))})")
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        if not dry:
            fail("triton is not installed")
        tv = "none"
    if not dry and not torch.cuda.is_available():  # the first CUDA call
        fail(f"no CUDA device here (torch {torch.__version__} sees none); run it on the GPU machine, "
             "or GPU_LEASE_DRY_RUN=1 on the CPU")
    gpu = "none (dry run)" if dry else torch.cuda.get_device_name()
    import contextlib, io
    from ttt_zoo.cli import build_parser
    try:  # `ttt-zoo kernels --verify --json`, where this checkout has it
        with contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(["kernels", "--verify", "--json"])
        kj = "yes"
    except SystemExit:
        kj = "no"
    print(f"gpu {gpu}; torch {torch.__version__}; cuda {torch.version.cuda}; triton {tv}; timm {timm.__version__}; "
          f"pytest {pytest.__version__}; kernels_json {kj}")
EOF
}

if [ "$MODE" = plan ]; then
  KERNELS_JSON=$(PYTHONPATH=$PWD "$PY" -c "
from ttt_zoo.cli import build_parser
try:
    build_parser().parse_args(['kernels', '--verify', '--json']); print('yes')
except SystemExit:
    print('no')" 2>/dev/null)
else
  log "lease: budget $BUDGET s, ${SELECT[*]:-every step}$([ "$MODE" = resume ] && echo ', resuming')$(
    [ "$DRY" = 1 ] && echo ' (DRY RUN: the CPU, tiny)')"
  stack versions >"$R/versions.txt" 2>&1
  put versions.txt
  log "versions (before any CUDA call): $(paste -sd ';' "$R/versions.txt" | sed 's/;/; /g')"
  mapfile -t install < <(stack missing "$WHEELS" "${WHEEL_RULES[@]}")
  if [ ${#install[@]} -gt 0 ]; then
    log "installing, offline, what $PY lacks: ${install[*]##*/}"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$CACHE/site" \
      "${install[@]}" >"$R/install.log" 2>&1 || refuse "pip could not install ${install[*]##*/} offline; see install.log"
    export PYTHONPATH=$CACHE/site:$PYTHONPATH
  else
    log "wheels: $PY has every package at its rule; nothing installed"
  fi
  [ -d "$CACHE/site" ] && [[ :$PYTHONPATH: != *":$CACHE/site:"* ]] && export PYTHONPATH=$CACHE/site:$PYTHONPATH
  stack_line=$(stack check "$TIMM" "$DRY") || refuse "the stack cannot run the steps: $stack_line"
  KERNELS_JSON=${stack_line##*kernels_json }
  log "stack: $stack_line"
  [ "$DRY" = 1 ] || nvidia-smi >"$R/nvidia-smi.txt" 2>&1
fi

# ------------------------------------------------------------------------------------------------ the units
[ "$MODE" = plan ] || printf '| unit | status | seconds | cap s |\n|---|---|---:|---:|\n' >"$R/summary.md"
UNIT= UNIT_PID= FAILED=0 PLANNED=$SETUP
now() { date +%s; }
left() { echo $(( BUDGET - RESERVE - ($(now) - T0) )); }
selected() {  # step, unit: chosen by the arguments (none: every one)
  [ ${#SELECT[@]} = 0 ] && return 0
  [[ " ${SELECT[*]} " == *" $1 "* || " ${SELECT[*]} " == *" $2 "* ]]
}
STEP=
step() {
  STEP=$1
  [ "$MODE" = plan ] || log "step $1 ($(( $(left) > 0 ? $(left) : 0 )) s of the budget left)"
}

unit() {  # name, cap s, min s, command... (@DEADLINE@ in it: the unit's seconds less 15)
  local name=$1 planned=$2 cap=$(( $2 * SCALE )) min=$3 t rc start status n=0
  shift 3
  selected "$STEP" "$name" || return 0
  if [ "$MODE" = plan ]; then  # which call it lands in: the first while the caps so far fit its budget
    local call=1
    (( PLANNED + planned <= BUDGET - RESERVE )) && PLANNED=$(( PLANNED + planned )) || { call=2; PLANNED=$BUDGET; }
    printf '%s\t%s\t%s\t%s\t%s\t' "$name" "$STEP" "$planned" "$min" "$call"
    local cmd=("${@//@DEADLINE@/$(( planned - 15 ))}")
    printf '%q ' "${cmd[@]}"
    echo
    return
  fi
  if [ -e "$DONE/$name" ]; then
    log "skip $name: it ran to its end in an earlier call ($(cat "$DONE/$name"))"
    echo "| $name | done in an earlier call | 0 | $cap |" >>"$R/summary.md"
    return
  fi
  t=$(( cap < $(left) ? cap : $(left) ))
  if (( t < min )); then
    log "skip $name: $(( t > 0 ? t : 0 )) s left for it, it needs at least $min s"
    echo "| $name | skipped | 0 | $cap |" >>"$R/summary.md"
    return
  fi
  local cmd=("${@//@DEADLINE@/$(( t - 15 ))}")
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
  case $rc in 124|137) ;; *) echo "$status" >"$DONE/$name" ;; esac
  log "$name: $status, $(( $(now) - start )) s; log $name.log"
  echo "| $name | $status | $(( $(now) - start )) | $t |" >>"$R/summary.md"
  [ -n "${AFTER_UNIT:-}" ] && $AFTER_UNIT
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
[ "$MODE" = plan ] || { trap 'on_signal TERM 143' TERM; trap 'on_signal INT 130' INT; }

# ------------------------------------------------------------------------------------------------ the steps
GPU_CHECK=("$PY" tools/gpu_check.py --deadline @DEADLINE@)
BENCH=("$PY" -m ttt_zoo bench)
if [ "$DRY" = 1 ]; then
  GPU_CHECK+=(--dry-run --first 1)
  HOW=(--model-kwargs depth=1 --device cpu --threads 1 -b 1 --num-warm-iter 0 --num-bench-iter 1)
else
  GPU_CHECK+=(--parallel 2 --xdist 8 --xdist-op 8 --test-timeout 60)
  HOW=(--backend triton --device cuda --amp --amp-dtype bfloat16 --num-warm-iter 3 --num-bench-iter 10
       --batch-tokens 12544)
fi
# the records: the dry run's in the work folder; the GPU run's in the cache, which a second call on the warm machine
# keeps (the device tool copies the checkout's kernels/gpu_verified.json anew each call), copied into the work folder
RECORDS=(--records "$R/gpu_verified.json")
if [ "$DRY" != 1 ]; then
  RECORDS=(--records "$CACHE/gpu_verified.json")
  if [ "$MODE" != plan ] && ! { [ "$MODE" = resume ] && [ -f "$CACHE/gpu_verified.json" ]; }; then
    cp kernels/gpu_verified.json "$CACHE/gpu_verified.json"  # a fresh start: the checkout's records
  fi
fi
copy_records() { [ "$DRY" = 1 ] || cp "$CACHE/gpu_verified.json" "$R/gpu_verified.json"; }

step_kernels_json() {
  step kernels_json
  if [ "$KERNELS_JSON" != yes ]; then
    [ "$MODE" = plan ] || log "kernels_json: this checkout's ttt-zoo has no \`kernels --verify --json\`; no unit"
    return
  fi
  local how=()
  [ "$DRY" = 1 ] && how=(--device cpu --dtype float32)  # the interpreter: one dtype
  # the JSON kept whatever the exit status (1: a check failed), written beside and renamed
  unit kernels_json 40 15 bash -c '"$@" >"$0.part"; rc=$?; mv "$0.part" "$0"; exit $rc' "$R/kernels_verify.json" \
    "$PY" -m ttt_zoo kernels --verify --json "${how[@]}"
}

kernel_folders() {  # "FOLDER OP..." per kernel folder, VERIFY_ORDER first: from the op registry
  PYTHONPATH=$PWD "$PY" - "${VERIFY_ORDER[@]}" <<'EOF'
import sys
from ttt_zoo.kernels import available_ops
from ttt_zoo.kernels.backend import kernel_folder
folders = {}
for op, impls in sorted(available_ops().items()):
    if impls["triton"]:
        folders.setdefault(kernel_folder(op), []).append(op)
order = [f for f in sys.argv[1:] if f in folders] + sorted(set(folders) - set(sys.argv[1:]))
for f in order:
    print(f, *folders[f])
EOF
}

step_verify() {  # each kernel folder: its tests on CUDA (the dry run: the interpreter), then its ops' records
  step verify
  local folders line folder
  folders=$(kernel_folders) || {
    log "verify: the op registry cannot be read: $(kernel_folders 2>&1 | tail -n 1)"
    echo "| verify | failed: the op registry cannot be read | 0 | |" >>"$R/summary.md"
    FAILED=1
    return
  }
  while read -r folder ops; do
    # shellcheck disable=SC2086
    AFTER_UNIT=copy_records unit "verify_$folder" "${VERIFY_CAPS[$folder]:-$DEFAULT_VERIFY_CAP}" 20 \
      "${GPU_CHECK[@]}" --steps tests records "${RECORDS[@]}" --only-ops $ops --output "$R/verify_$folder"
  done <<<"$folders"
}

step_bench_families() {  # one model of each family vs DeiT-T, DiT3 / DiT5-S/2 vs DiT-S/2 (gpu_check's lists)
  step bench_families
  unit bench_families 80 30 "${GPU_CHECK[@]}" --steps bench --sizes 224 --output "$R/bench_families"
}

step_graphs() {  # each compiled row compiles for tens of seconds; a second call reuses the inductor cache
  step graphs
  if [ "$DRY" = 1 ]; then
    log "graphs: no unit in the dry run (CUDA graphs need CUDA)"
    return
  fi
  local size
  for size in 224 1024; do  # tools/gpu_check.py GRAPH_SIZES
    unit "graphs_$size" 55 30 "${BENCH[@]}" --model vit3_tiny --peers deit_tiny_patch16_224 "${HOW[@]}" \
      --runtime compile --torchcompile-mode reduce-overhead --bench both --img-size "$size" --output "$R/graphs_$size"
  done
}

step_profile() {
  step profile
  local size=224
  [ "$DRY" = 1 ] && size=32
  unit profile 30 15 "${BENCH[@]}" --model vit3_tiny --peers deit_tiny_patch16_224 "${HOW[@]}" --profile \
    --profile-top 40 --bench train --img-size "$size" --output "$R/profile"
}

if [ "$MODE" = plan ]; then
  echo "# plan budget=$BUDGET reserve=$RESERVE setup=$SETUP second_call=$SECOND_CALL"
else
  pack
fi
for s in "${ALL_STEPS[@]}"; do
  "step_$s"
done
[ "$MODE" = plan ] && exit 0
log "done: $([ $FAILED = 0 ] && echo 'every unit that ran passed' || echo 'some unit failed or was cut');" \
  "read $OUT/summary.md and $OUT/gpu_lease.tgz"
pack
cat "$R/summary.md"
exit $FAILED
