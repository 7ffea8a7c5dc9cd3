#!/usr/bin/env bash
# SmolLM2-135M accuracy cells on the GPU machine, many at once (fp32, TF32 off; the same protocol as on the CPU).
#
# The model cannot travel in one call: the GGUF (98 MB) is over the device tool's 64 MiB per call. It travels in
# two halves (split -b 49181216 -d <gguf> .gpuship/smollm2.gguf.part), in two back-to-back calls on one warm machine:
#   call 1, carry [".gpuship/smollm2.gguf.part00"]:  mkdir -p /tmp/m && cp .gpuship/smollm2.gguf.part00 /tmp/m/
#   call 2, carry [".gpuship/smollm2.gguf.part01", ".whl"]:  bash benchmarks/gpu_accuracy.sh JOBFILE
# .whl holds the gguf wheel (transformers reads GGUF through it; the GPU image lacks it). Later calls on the same
# warm machine need no carry: the assembled model, the gguf package and the float baseline stay in /tmp.
# JOBFILE lines: name|methods|bits|groups|params JSON|label|nsamples|calibration seed (the last two optional).
# Each job is one process (logs in /tmp/acc); after a first job has cached the float baseline the others start
# together, at most MAXJOBS (default 18) at a time; LIMIT (default 480) seconds for the whole batch. Each finished
# job appends its perplexity, KL and time to $OUT/summary.txt at once (a batch cut short by the call's time limit
# still returns what finished); the JSON results come back in $OUT/acc.tgz at the end (few files: the device
# tool returns only a handful).
set -u
export PYTHONUNBUFFERED=1
jobs_file=${1:?job file}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
export PYTHONPATH=/tmp/site
gguf=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! echo "$sha  $gguf" | sha256sum -c --status 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/gguf-*.whl || exit 1
  cat /tmp/m/smollm2.gguf.part00 .gpuship/smollm2.gguf.part01 > "$gguf" || exit 1
  echo "$sha  $gguf" | sha256sum -c || exit 1
fi
export QUANTKIT_CACHE=/tmp/qkcache
logs=/tmp/acc
mkdir -p "$logs"
limit=${LIMIT:-480}
max_jobs=${MAXJOBS:-18}  # processes at once (the machine has 16 cores; each process runs 1 torch thread)
start=$(date +%s)

run_job() {  # name, then accuracy.py's arguments
  local name=$1
  shift
  timeout "$(( limit - ($(date +%s) - start) ))" python3 benchmarks/accuracy.py "$@" < /dev/null > "$logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc t=$(( $(date +%s) - start ))s $(grep -h -o "'\(perplexity\|kl\|top1\|quantize_seconds\)': [0-9.]*" \
    "$logs/$name.log" | tr '\n' ' ')" >> "$OUT/summary.txt"
}

first=1
while IFS='|' read -r name methods bits groups params label nsamples seed; do
  [ -z "$name" ] || [ "${name:0:1}" = "#" ] && continue
  args=(--model "$gguf" --methods "$methods" --bits "$bits" --groups="$groups" --params "$params"
        --nsamples "${nsamples:-64}" --calib-seed "${seed:-0}" --threads 1 --device cuda --out "$logs/$name.json")
  [ -n "$label" ] && args+=(--label "$label")
  if [ $first = 1 ] && [ ! -d "$QUANTKIT_CACHE/baselines" ]; then  # computes and caches the float baseline
    run_job "$name" "${args[@]}"
  else
    while [ "$(jobs -rp | wc -l)" -ge "$max_jobs" ]; do wait -n; done
    run_job "$name" "${args[@]}" &
  fi
  first=0
done < "$jobs_file"
wait
echo "all done after $(( $(date +%s) - start ))s"
cat "$OUT/summary.txt"
tar czf "$OUT/acc.tgz" -C "$logs" $(cd "$logs" && ls *.json)
