#!/usr/bin/env bash
# Device-side driver of the end-to-end benchmark on the H200 (bench/README.md, "The H200 kit"): setup,
# generate, run.
#
#   bash bench/e2e_h200.sh setup                 wheels -> /tmp/site; SageAttention 2.x from .whl-sage/ (an
#                                                earlier call's build) when it is not importable yet
#   (SageAttention 2.x is built on the device by a one-off command of the call, never by a
#   file in this repository; see bench/README.md)
#   bash bench/e2e_h200.sh gen [gguf|fp8] [--workflow FILE]
#                                                write the full-size random model files (skips what exists); with
#                                                --workflow, the files that workflow loads (the 5B template: the
#                                                TI2V-5B fp16, UMT5-XXL, the Wan 2.2 VAE; the I2V template: the
#                                                Wan 2.1 I2V 14B fp8, UMT5-XXL, CLIP vision H, the Wan 2.1 VAE)
#   bash bench/e2e_h200.sh runs SPECS [ARGS...]  python3 -m bench.e2e --runs SPECS ARGS, JSON lines to $OUT/e2e.jsonl
#   bash bench/e2e_h200.sh call W SPECS [ARGS..] setup + gen W + runs, starting no run that could end after
#                                                the call's budget (E2E_CALL_BUDGET_S, default 570 s, counted
#                                                from E2E_T0, the command's start in epoch seconds)
#   bash bench/e2e_h200.sh whole W SPECS [ARGS]  setup + gen W + python3 -m bench.whole_prompt: each spec as fresh
#                                                processes (first prompt, repeat prompt), no warm-up; ARGS must
#                                                name the caches (--caches none | kept DIR | pack DIR); no
#                                                process starts that could end after the call's budget (each
#                                                taken as E2E_LONGEST_PROCESS_S, default 210 s); JSON lines
#                                                to $OUT/whole-prompt.jsonl, the processes' stderr to
#                                                $OUT/whole-prompt.log.  With --workflow FILE in ARGS, SPECS
#                                                are that saved workflow's variants (VARIANT@{GB|full}, VARIANT
#                                                template|comfy|compilenode) and gen writes what it loads
#   bash bench/e2e_h200.sh gpu-tier [ARGS...]    setup + the gpu tier (pytest tests/gpu -v -rs ARGS), its output
#                                                with this checkout's path taken out to $OUT/gpu-tier.log (the
#                                                form of bench/records/gpu-tier/), the dispatch table beside it
#   bash bench/e2e_h200.sh info                  GPU, driver, torch, disk, memory
#
# Every sub-command is idempotent, so a call on a fresh machine can start with "setup; gen" and a
# call on a machine that kept its files loses only seconds to them.
# Inductor's and Triton's caches default to .e2e/ (kept on a warm machine): a later call reuses finished compiles.
# A whole-prompt process sets its own (and the pack's timing cache) from --caches.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/.e2e/out}
MODELS=${E2E_MODELS:-$REPO/.e2e/models}
SITE=${E2E_SITE:-/tmp/site}
mkdir -p "$OUT" "$MODELS"
export COMFYUI_PATH=${COMFYUI_PATH:-$REPO/.host/ComfyUI}
export COMFYUI_GGUF_PATH=${COMFYUI_GGUF_PATH:-$REPO/.host/ComfyUI-GGUF}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export SAGEATTENTION_COMMIT=${SAGEATTENTION_COMMIT:-unknown}
# WAN_SAGE_COMMIT, when set, names the commit in the records; else bench._host.git_head() reads it here
# (with "+tree:<id>" when a copied tree is newer than its git directory)
export E2E_T0=${E2E_T0:-$(date +%s)}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$REPO/.e2e/inductor-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$REPO/.e2e/triton-cache}
BUDGET=${E2E_CALL_BUDGET_S:-570}
LONGEST_RUN=${E2E_LONGEST_RUN_S:-100}     # a 720p81 run, fp8 at 24 GB, with margin
LONGEST_PROCESS=${E2E_LONGEST_PROCESS_S:-210}   # a whole-prompt process, GGUF 720p81 4 steps at 24 GiB, with margin

setup() {
  # only these three: a sageattention-1.0.6 wheel in .whl (the host tier's) would shadow the 2.x build
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/gguf-*.whl .whl/torchsde-*.whl .whl/trampoline-*.whl || return 1
  if ls .whl-sage/sage-site.tgz.part* >/dev/null 2>&1 && ! python3 -c "import sageattention._qattn_sm90" 2>/dev/null; then
    cat .whl-sage/sage-site.tgz.part* | tar xzf - -C "$SITE" || return 1   # the build of an earlier call
  fi
  python3 - <<'PY'
import importlib
for m in ("gguf", "torchsde", "sageattention"):
    try:
        mod = importlib.import_module(m)
        print(f"{m}: {getattr(mod, '__version__', '?')} from {mod.__file__}")
    except Exception as e:
        print(f"{m}: MISSING ({type(e).__name__}: {e})")
try:
    import sageattention._qattn_sm90  # noqa: F401
    print("sageattention sm90 kernels: importable")
except Exception as e:
    print(f"sageattention sm90 kernels: NOT importable ({e})")
PY
}


gen() {
  local weights=${1:-gguf}; shift || true
  # one A14B expert format on disk at a time (64 GiB disk): drop the other one's experts first (a saved workflow's
  # files, "$@" = --workflow FILE, are the TI2V-5B set, the Wan 2.1 I2V 14B set, kept whatever W is, or the
  # experts of --weights)
  if [ "$weights" = fp8 ]; then rm -f "$MODELS"/diffusion_models/*.gguf
  else rm -f "$MODELS"/diffusion_models/random-wan2.2-t2v-*fp8*.safetensors; fi
  python3 -m bench.e2e --models-dir "$MODELS" --scale "${E2E_SCALE:-full}" --weights "$weights" --generate-only --av-stub --quiet "$@"
  ls -l "$MODELS"/*/ && df -h "$MODELS" | tail -1
}

runs() {
  local specs=$1; shift
  python3 -m bench.e2e --models-dir "$MODELS" --scale "${E2E_SCALE:-full}" --av-stub --runs "$specs" --out "$OUT/e2e.jsonl" "$@" \
    2> >(tee -a "$OUT/e2e.log" | grep -E "^e2e |Traceback|Error|error:|loaded (partially|completely)|wan-sage" >&2)
}

call() {
  local weights=$1 specs=$2; shift 2
  setup >/dev/null || { echo "setup failed"; return 1; }
  gen "$weights" || return 1
  local left=$(( BUDGET - ($(date +%s) - E2E_T0) - LONGEST_RUN ))
  echo "e2e call: $(( $(date +%s) - E2E_T0 )) s spent before the runs; no run starts after $left s"
  runs "$specs" --weights "$weights" --deadline-s "$left" --warmup "$@"
}

workflow_arg() {   # "--workflow FILE" when the arguments name one (the files gen writes are that workflow's)
  while [ $# -gt 0 ]; do
    if [ "$1" = --workflow ] && [ $# -gt 1 ]; then printf '%s\n' "--workflow" "$2"; return; fi
    shift
  done
}

whole() {
  local weights=$1 specs=$2; shift 2
  local wf=(); mapfile -t wf < <(workflow_arg "$@")
  setup >/dev/null || { echo "setup failed"; return 1; }
  gen "$weights" "${wf[@]}" || return 1
  echo "e2e whole: $(( $(date +%s) - E2E_T0 )) s spent before the processes; each taken as $LONGEST_PROCESS s, within $BUDGET s"
  python3 -m bench.whole_prompt --runs "$specs" --t0 "$E2E_T0" --budget-s "$BUDGET" --process-s "$LONGEST_PROCESS" \
    --out "$OUT/whole-prompt.jsonl" --log "$OUT/whole-prompt.log" \
    --models-dir "$MODELS" --scale "${E2E_SCALE:-full}" --weights "$weights" --av-stub "$@"
}

gpu_tier() {
  setup || { echo "setup failed"; return 1; }
  local log=$OUT/gpu-tier.log
  echo "gpu tier: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), commit ${WAN_SAGE_COMMIT:-unset}" | tee "$log"
  # -v: a line per test as it ends.  With -q the whole tier is one line of dots, which sed passes on only at its
  # newline, so a tier that a call's time limit cut short left nothing in the log.  -v also prints pytest's rootdir,
  # this checkout's path alone on its line: "." in the log.
  WAN_SAGE_GPU_TABLE=$OUT/dispatch-table.jsonl python3 -m pytest tests/gpu -v -rs -p no:cacheprovider "$@" 2>&1 \
    | sed -u -e "s#$REPO/##g" -e "s#$REPO\$#.#" | tee -a "$log"
  return "${PIPESTATUS[0]}"
}

info() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  df -h "$MODELS" /tmp | cat; free -g | head -2; nproc
}

cmd=${1:-}; shift || true
case "$cmd" in
  setup) setup ;;
  gen) gen "$@" ;;
  runs) runs "$@" ;;
  call) call "$@" ;;
  whole) whole "$@" ;;
  gpu-tier) gpu_tier "$@" ;;
  info) info ;;
  *) sed -n '2,34p' "$0"; exit 2 ;;
esac
