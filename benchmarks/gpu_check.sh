#!/usr/bin/env bash
# The GPU path, checked in one go on a CUDA machine (< 8 minutes): install, CUDA-marked tests,
# kernel tests compiled (not interpreted), parity of fp32 and bf16 against transformers on the
# test checkpoints, bench_engine's workload at a size that fills the GPU; one summary at the end.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; PYTHON=/path/to/python to pick one
#
# Each step has its own time limit (the sum stays under 8 minutes) and its log under $LOGS
# (default: a temp dir); a failed step does not stop the others. Exit status: 0 when every
# step passed. Installing needs a package index; without one (an offline box with torch
# already there) the repo is used from its source tree instead.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
LOGS=${LOGS:-$(mktemp -d -t batchgen-gpu-check.XXXXXX)}
START=$(date +%s)
declare -a SUMMARY=()
FAILED=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log it, remember PASS/FAIL
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s) rc
  echo "== $name (limit ${limit}s)" >&2
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  local took=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then SUMMARY+=("PASS  $name (${took}s)"); else
    FAILED=1; [ $rc -eq 124 ] && SUMMARY+=("TIME  $name (over ${limit}s)") || SUMMARY+=("FAIL  $name (rc $rc, ${took}s)")
    tail -n 20 "$LOGS/$name.log" >&2
  fi
  return $rc
}

# -- 1. environment and install ------------------------------------------------------------------
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$LOGS/gpu.txt" 2>&1 || true
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "no CUDA device visible to $PY (torch missing or a CPU build): nothing to check" >&2
  exit 2
fi
install() {
  # torch pinned first so pip keeps the CUDA build already there; triton for the kernels
  "$PY" -m pip install -q "torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')" \
      -e "$ROOT[test,gpu]" "triton==3.9.0" || {
    echo "pip install failed (offline?): using the source tree on PYTHONPATH" >&2
    mkdir -p "$LOGS/shim" && ln -sfn "$ROOT/kernels" "$LOGS/shim/batchgen_kernels"
    return 0
  }
}
step install 90 install
export PYTHONPATH="$ROOT:$LOGS/shim${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET   # the kernels must compile, not interpret
"$PY" -c 'import batchgen, batchgen_kernels, triton, transformers' >"$LOGS/imports.log" 2>&1 \
  || { SUMMARY+=("FAIL  imports (see $LOGS/imports.log)"); FAILED=1; }

# -- 2. tests: everything marked cuda, then the kernel tests compiled ------------------------------
step cuda-tests 90 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
step kernel-tests-compiled 70 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_paged_attention.py

# -- 3. parity against transformers (fp32 identical tokens; bf16 agreement) ---------------------
step parity 80 "$PY" benchmarks/gpu_parity.py

# -- 4. throughput at a size that fills the GPU --------------------------------------------------
step bench 130 "$PY" benchmarks/bench_gpu.py --rows 2048 --max-num-seqs 512 --hf-rows 256

# -- summary --------------------------------------------------------------------------------------
echo
echo "batchgen GPU check: $(cat "$LOGS/gpu.txt" 2>/dev/null | head -1), $(( $(date +%s) - START ))s, logs in $LOGS"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
for name in cuda-tests kernel-tests-compiled; do
  [ -f "$LOGS/$name.log" ] && echo "  $name: $(grep -E '(passed|failed|error)' "$LOGS/$name.log" | tail -1)"
done
[ -f "$LOGS/parity.log" ] && grep -h '^PARITY\|"arch"' "$LOGS/parity.log" | sed 's/^/  /'
[ -f "$LOGS/bench.log" ] && grep -v '^BENCH' "$LOGS/bench.log" | grep -E 'tok/s|rows' | sed 's/^/  /'
exit $FAILED
