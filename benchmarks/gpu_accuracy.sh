#!/usr/bin/env bash
# SmolLM2-135M accuracy cells on the GPU machine, many at once (fp32, TF32 off; the same protocol as on the CPU).
#
# The model cannot travel in one call: the GGUF (98 MB) is over the device tool's 64 MiB per call. It travels in
# two halves (split -b 49181216 -d <gguf> .gpuship/smollm2.gguf.part), in two back-to-back calls on one warm machine:
#   call 1, carry [".gpuship/smollm2.gguf.part00"]:  mkdir -p /tmp/m && cp .gpuship/smollm2.gguf.part00 /tmp/m/
#   call 2, carry [".gpuship/smollm2.gguf.part01", ".whl"]:  bash benchmarks/gpu_accuracy.sh JOBFILE
# .whl holds the gguf wheel (transformers reads GGUF through it; the GPU image lacks it).
# JOBFILE lines: name|methods|bits|groups|params JSON|label|nsamples|calibration seed (the last two optional).
# Each job is one process writing $OUT/acc/<name>.json; all start together after a first job has cached the
# float baseline.
set -u
export PYTHONUNBUFFERED=1
jobs_file=${1:?job file}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site
gguf=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/m/smollm2.gguf.part00 .gpuship/smollm2.gguf.part01 > "$gguf" || exit 1
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $gguf" | sha256sum -c || exit 1
export QUANTKIT_CACHE=/tmp/qkcache
mkdir -p "$OUT/acc"
limit=${LIMIT:-480}
start=$(date +%s)
first=1
while IFS='|' read -r name methods bits groups params label nsamples seed; do
  [ -z "$name" ] || [ "${name:0:1}" = "#" ] && continue
  args=(--model "$gguf" --methods "$methods" --bits "$bits" --groups="$groups" --params "$params"
        --nsamples "${nsamples:-64}" --calib-seed "${seed:-0}" --threads 1 --device cuda --out "$OUT/acc/$name.json")
  [ -n "$label" ] && args+=(--label "$label")
  left=$(( limit - ($(date +%s) - start) ))
  if [ $first = 1 ]; then  # computes and caches the float baseline for the others
    timeout "$left" python3 benchmarks/accuracy.py "${args[@]}" < /dev/null > "$OUT/acc/$name.log" 2>&1
    echo "$name exit $? after $(( $(date +%s) - start ))s"
    first=0
  else
    timeout "$left" python3 benchmarks/accuracy.py "${args[@]}" < /dev/null > "$OUT/acc/$name.log" 2>&1 &
  fi
done < "$jobs_file"
wait
echo "all done after $(( $(date +%s) - start ))s"
grep -h "'perplexity'" "$OUT"/acc/*.log | cut -c1-220
tar czf "$OUT/acc.tgz" -C "$OUT" acc && rm -rf "$OUT/acc"
