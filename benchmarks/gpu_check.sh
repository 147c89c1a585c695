#!/usr/bin/env bash
# The GPU checks in one call of a lent device, most wanted first, inside a deadline.
#
#   bash benchmarks/gpu_check.sh [SECONDS]      (default 540; results under $OUT, or /tmp/gpu-out)
#   STEPS=serve,engine bash benchmarks/gpu_check.sh 280      (only the steps named)
#
# Where the machine has the CUDA torch and triton but none of pagefleet's other packages and
# no registry: carry them as cp312 wheels in .whl/ (and a redis-server in .whl/bin/), as the
# GPU section of docs/BENCHMARKS.md says. Every step runs under what is left of the deadline;
# its log goes to $OUT/log.txt, its figures to $OUT/<step>.json (at most 8 files come back).
set -u
budget=${1:-540}
deadline=$(( $(date +%s) + budget ))
out=${OUT:-/tmp/gpu-out}
work=/tmp/gpu-work
mkdir -p "$out" "$work"
log=$out/log.txt
: >"$log"

say() { echo "$*" | tee -a "$log"; }

# step NAME CAP CMD...: CMD under the smaller of CAP and what is left; its output in the log.
step() {
  local name=$1 cap=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then return; fi
  local left=$(( deadline - $(date +%s) ))
  if (( left < 25 )); then say "== $name: skipped, ${left}s left"; return; fi
  (( cap > left )) && cap=$left
  say "== $name (at most ${cap}s): $*"
  local t0
  t0=$(date +%s)
  PYTHONUNBUFFERED=1 timeout -k 5 "$cap" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  cat "$work/$name.log" >>"$log"
  say "== $name: exit $rc after $(( $(date +%s) - t0 ))s"
  tail -n 30 "$work/$name.log"
}

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >>"$log" 2>&1 || { say "wheels failed to install"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  [ -d .whl/bin ] && export PATH=$PWD/.whl/bin:$PATH
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$log" 2>&1 \
  || { say "pagefleet failed to install"; tail -n 30 "$log"; exit 1; }


{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name())'
  command -v redis-server
} 2>&1 | tee -a "$log"

# First, on a fresh machine (Triton's disk cache empty): what the worker's kernel warm-up costs at start.
step warm-up 90 python3 -c 'import time; from pagefleet import Engine
for model in ("tiny", "tiny"):  # the second start reads the variants back from the disk cache
    t0 = time.perf_counter(); e = Engine(model, device="cuda")
    print(f"{model}: engine ready in {time.perf_counter() - t0:.1f} s, kernel warm-up {e.executor.warm_up_seconds:.1f} s")'
step gpu-tests 220 python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs \
  tests/test_architectures.py tests/test_cuda_graphs.py tests/test_swap.py tests/test_kernels.py
step host-path 70 python3 -m pagefleet bench host-path --engine model --device cuda --json "$out/host-path-cuda.json"
step host-path-paced 60 python3 -m pagefleet bench host-path --engine model --device cuda --batch 64 --idle-ms 5 \
  --json "$out/host-path-cuda-paced.json"
step decode 110 python3 -m pagefleet bench decode --batch 1,64 --context 2048 --profile --json "$out/decode.json"
step kernels 80 python3 -m pagefleet bench kernels --json "$out/kernels.json"
step serve 120 python3 -m pagefleet bench serve --device cuda --num-prompts 200 --random-input-len 256 --random-output-len 128 \
  --compare-in-process --probe 20 --disable-tqdm --save-result --result-dir "$work/serve" --result-filename serve.json
cp "$work/serve/serve.json" "$out/serve.json" 2>/dev/null
step preemption 60 python3 -m pagefleet bench preemption --device cuda --out "$out/preemption.json"
step engine 120 python3 -m pagefleet bench engine --device cuda --json "$out/engine.json"
step kernel-tests ${KT_CAP:-200} python3 -m pytest -q -p no:cacheprovider -x -rfE \
  tests/test_fused_kernels.py tests/test_moe_kernel.py tests/test_kernels_in_models.py tests/test_kernel_variants.py
say "== done, $(( deadline - $(date +%s) ))s before the deadline"
grep "^== " "$log"
