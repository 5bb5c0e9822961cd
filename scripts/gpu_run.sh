#!/usr/bin/env bash
# Driver for the H200 (device tool): install this package (and carried wheels), then run
# each given command with its own time limit, logging to $OUT/<n>.log.
#   bash scripts/gpu_run.sh "python3 scripts/gpu_check_shared.py" "python3 scripts/gpu_check_routed.py --quick"
set -u
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
SITE=/tmp/site
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target $SITE . || exit 1
export PYTHONPATH=$SITE
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu_info.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu_info.txt"
n=0
for cmd in "$@"; do
  n=$((n + 1))
  echo "=== [$n] $cmd" | tee -a "$OUT/summary.log"
  start=$(date +%s)
  bash -c "$cmd" > "$OUT/$n.log" 2>&1
  rc=$?
  echo "=== [$n] rc=$rc in $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.log"
  tail -n 40 "$OUT/$n.log"
done
