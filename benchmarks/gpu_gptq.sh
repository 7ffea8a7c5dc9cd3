#!/usr/bin/env bash
# One device call: the GPTQ kernel's CUDA tests, then GPTQ on a Llama-3-8B-shaped random model (all 32 layers,
# the stage's defaults: act-order and clipped grids), then AWQ on 8 layers. Results land in $OUT/<name>/.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p "$OUT/tests" "$OUT/gptq" "$OUT/awq"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gptq_block.py tests/calib/test_runner.py \
  > "$OUT/tests/log.txt" 2>&1; echo "tests exit $?"; tail -n 5 "$OUT/tests/log.txt"
OUT="$OUT/gptq" timeout "${GPTQ_LIMIT:-360}" python3 benchmarks/bench_gptq.py ${GPTQ_ARGS:-} > "$OUT/gptq/log.txt" 2>&1
echo "gptq exit $?"; tail -n 12 "$OUT/gptq/log.txt"
if [ -n "${AWQ_LAYERS:-}" ]; then
  OUT="$OUT/awq" timeout 120 python3 benchmarks/bench_awq.py --layers "$AWQ_LAYERS" > "$OUT/awq/log.txt" 2>&1
  echo "awq exit $?"; tail -n 8 "$OUT/awq/log.txt"
fi
