#!/usr/bin/env bash
# The H200 benchmark batch, in one or two calls of the device tool (device time is scarce: ~10 minutes total).
#   bash benchmarks/gpu_final.sh serve   # runtime throughput (+ HF baselines), W8A8 table, attention kernels
#   bash benchmarks/gpu_final.sh quant   # GPTQ and AWQ on a Llama-3-8B-shaped random model
#   bash benchmarks/gpu_final.sh all     # both in one call, with capped layer counts (times scale per layer)
#   bash benchmarks/gpu_final.sh w4a16   # W4A16 kernel tests, config sweep and table (then --apply the sweep here)
# Everything lands in $OUT/<name>/ and is packed into $OUT/<part>.tgz (the device tool returns at most 8 files).
set -u
export PYTHONUNBUFFERED=1
part=${1:?all, serve, quant or w4a16}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  mkdir -p "$OUT/$name"
  echo "=== $name (limit ${limit}s)"
  OUT="$OUT/$name" timeout "$limit" "$@" > "$OUT/$name/log.txt" 2>&1
  echo "exit $?"; tail -n 25 "$OUT/$name/log.txt"
}
if [ "$part" = all ]; then  # one call of <= 10 minutes when device time is short: capped layer counts
  run serve 290 python3 benchmarks/bench_serve.py --hf-requests 16
  run w8a8 60 python3 benchmarks/bench_w8a8.py
  run gptq 170 python3 benchmarks/bench_gptq.py --layers 8
  run awq 60 python3 benchmarks/bench_awq.py --layers 2
elif [ "$part" = w4a16 ]; then  # kernel tests, config sweep + full table with the winners (~5 min)
  run w4a16-tests 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/kernels/test_w4a16.py
  run w4a16 420 python3 benchmarks/bench_w4a16.py --sweep --table --workers 14
elif [ "$part" = serve ]; then
  run serve 330 python3 benchmarks/bench_serve.py --hf-requests 32
  run w8a8 90 python3 benchmarks/bench_w8a8.py
  run attention 60 python3 benchmarks/bench_attention.py --quick
else  # 2026-12-01: GPTQ ~110 s with the model build, AWQ ~150 s, both on all 32 layers
  run gptq-tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gptq_block.py tests/calib
  run gptq 330 python3 benchmarks/bench_gptq.py
  run awq 200 python3 benchmarks/bench_awq.py --layers 32
fi
tar czf "$OUT/$part.tgz" -C "$OUT" $(cd "$OUT" && ls -d */)
