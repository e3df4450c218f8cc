#!/usr/bin/env bash
# The GPU path, checked in one go on a CUDA machine (< 8 minutes): install, CUDA-marked tests,
# kernel tests compiled (not interpreted), parity of fp32 and bf16 against transformers on the
# test checkpoints, bench_engine's workload at a size that fills the GPU, (on 2+ GPUs) a 2-worker
# dask-cuda job whose workers must each have used their own device, and (where a python with vLLM's
# CUDA build is at hand) batchgen against vLLM on one model; one summary at the end.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; PYTHON=/path/to/python to pick one
#
# Each step has its own time limit (the sum stays under ~9.5 minutes, ~12 with the vLLM step) and its log under $LOGS
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
export -f install; export PY ROOT LOGS  # `timeout` runs programs, not functions: through bash
step install 90 bash -c install
export PYTHONPATH="$ROOT:$LOGS/shim${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET   # the kernels must compile, not interpret
"$PY" -c 'import batchgen, batchgen_kernels, triton, transformers' >"$LOGS/imports.log" 2>&1 \
  || { SUMMARY+=("FAIL  imports (see $LOGS/imports.log)"); FAILED=1; }

# -- 2. tests: everything marked cuda, then the kernel tests compiled ------------------------------
step cuda-tests 90 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests
step kernel-tests-compiled 70 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_paged_attention.py

# -- 3. parity against transformers (fp32 identical tokens; bf16 agreement) ---------------------
step parity 80 "$PY" benchmarks/gpu_parity.py

# -- 4. throughput at a size that fills the GPU --------------------------------------------------
step bench 130 "$PY" benchmarks/bench_gpu.py --rows 2048 --max-num-seqs 512 --hf-rows 256

# -- 5. a 2-worker dask-cuda job: each worker's engine on its own device ----------------------------
cat >"$LOGS/dask_cuda_check.py" <<'PY'
"""batchgen.cluster.connect() on this GPU machine -> dask_cuda.LocalCUDACluster with 2 workers;
a job runs on both; each worker's engine must sit on a different physical GPU (by UUID), the
one its CUDA_VISIBLE_DEVICES entry names first, and hold memory there."""
import sys, tempfile
sys.path.insert(0, "tests/helpers")
import dask.dataframe as dd, pandas as pd, torch
import tiny_models
import batchgen.cluster as bc

def probe(dask_worker):
    import os, torch
    side = dask_worker.extensions["batchgen"]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "uuid": str(props.uuid),
            "allocated": torch.cuda.memory_allocated(), "engines": len(side.host.engines.specs()),
            "rows": side.host.counters.rows_done + side.host.counters.returned}

ckpt = tiny_models.build_checkpoint("llama", tempfile.mkdtemp())
client = bc.connect(n_workers=2, dask_cuda=True)
assert type(client.cluster).__name__ == "LocalCUDACluster", type(client.cluster)
pdf = pd.DataFrame({"prompt": [f"row {i}" for i in range(64)]})
out = dd.from_pandas(pdf, npartitions=8).map_partitions(bc.generate, model=ckpt, max_tokens=8,
                                                       temperature=0.0).compute()
assert out["error"].isna().all() and len(out) == 64
seen = client.run(probe)
print(seen)
uuids = [s["uuid"] for s in seen.values()]
assert len(seen) == 2 and len(set(uuids)) == 2, f"workers share a device: {seen}"
assert all(s["engines"] == 1 and s["allocated"] > 0 for s in seen.values()), seen
print("DASK_CUDA OK", uuids)
PY
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$NGPU" -ge 2 ]; then
  dask_cuda_check() {  # dask-cuda is the optional `cuda` extra: installed here when missing
    "$PY" -c 'import dask_cuda' 2>/dev/null || "$PY" -m pip install -q "dask-cuda>=24.8" || return 3
    "$PY" "$LOGS/dask_cuda_check.py"
  }
  export -f dask_cuda_check
  step dask-cuda 90 bash -c dask_cuda_check
else
  SUMMARY+=("SKIP  dask-cuda (needs 2 GPUs, this machine shows $NGPU)")
fi

# -- 6. against vLLM's CUDA build on the same model and requests (bench_vllm.py --device cuda) -------
# vLLM pins its own torch, so it lives in a virtualenv of its own: VLLM_PYTHON names a python that
# imports it, else bench_vllm's default one, if a run with a package index made it; none: skipped
# (this script installs nothing that large on its own).
VLLM_PY=${VLLM_PYTHON:-$ROOT/benchmarks/.venvs/vllm-cuda/bin/python}
if [ -x "$VLLM_PY" ] && "$VLLM_PY" -c 'import vllm' 2>/dev/null; then
  step vllm 150 "$PY" benchmarks/bench_vllm.py --device cuda --model compute --dtype bfloat16 --pairs 2 \
      --vllm-python "$VLLM_PY"
else
  SUMMARY+=("SKIP  vllm (no python with vLLM's CUDA build: set VLLM_PYTHON, or run benchmarks/bench_vllm.py --device cuda once with a package index)")
fi

# -- summary --------------------------------------------------------------------------------------
echo
echo "batchgen GPU check: $(cat "$LOGS/gpu.txt" 2>/dev/null | head -1), $(( $(date +%s) - START ))s, logs in $LOGS"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
for name in cuda-tests kernel-tests-compiled; do
  [ -f "$LOGS/$name.log" ] && echo "  $name: $(grep -E '(passed|failed|error)' "$LOGS/$name.log" | tail -1)"
done
[ -f "$LOGS/parity.log" ] && grep -h '^PARITY\|"arch"' "$LOGS/parity.log" | sed 's/^/  /'
[ -f "$LOGS/bench.log" ] && grep -v '^BENCH' "$LOGS/bench.log" | grep -E 'tok/s|rows' | sed 's/^/  /'
[ -f "$LOGS/vllm.log" ] && grep -E 'tok/s|per pair|tokens:|model on' "$LOGS/vllm.log" | sed 's/^/  /'
exit $FAILED
