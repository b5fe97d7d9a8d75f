#!/usr/bin/env bash
# GPU tests and benchmarks in one go, on the GPU machine (system python with torch + Triton,
# no network). Carry .whl (platformdirs) and .peers (spconv, from ../shared/tools/peers-for-gpu.sh).
# Usage: bash scripts/gpu_check.sh [tests] [tests-split] [cuda] [planner] [submconv] [cache] [aot] [table] [tuning] [unet]
#        [e2e] [layers] [ddp] [precision] [issue20] [host] [builds] [builds-tests]
#        (no argument: everything). Results land in scripts/results/ and, if set, in $OUT.
# The results name the code's commit: on a copied tree whose .git is another commit's, set
# FLEXPLAN_BENCH_COMMIT (e.g. FLEXPLAN_BENCH_COMMIT=$(git rev-parse --short HEAD) where the
# command is written).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || { echo "flexplan install failed"; exit 1; }
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps .whl/*.whl >/dev/null 2>&1
[ -d .peers ] && source .peers/peers-on-gpu.sh .peers
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests planner submconv cache aot table unet e2e)
status=0
for step in "${steps[@]}"; do
  echo "=== $step"
  case $step in
    tests)    python3 -m pytest -q -m gpu tests ;;
    # the same, one test file at a time under its own time limit (GPU_TEST_TIMEOUT seconds,
    # default 150), a summary line per file, the log in $OUT/gpu-tests.log as it goes: a
    # device call's limit then cuts one file, not the whole run's output
    tests-split)
      log=${OUT:-/tmp}/gpu-tests.log; one=$(mktemp); : > "$log"; split_status=0
      for file in $(grep -l "mark.gpu" tests/test_*.py); do
        limit=${GPU_TEST_TIMEOUT:-150}
        # (torch.compile's tests compile whole networks: twice the limit; 120 s cut them)
        case $file in *test_compile*) limit=$((limit * 2)) ;; esac
        timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider \
          "$file" > "$one" 2>&1; rc=$?
        cat "$one" >> "$log"
        last=$(grep -E '(passed|failed|error|skipped|deselected)' "$one" | tail -1)
        echo "$file: rc $rc${last:+, $last}$([ $rc -eq 124 ] && echo ', timed out')" \
          | tee -a "$log"
        [ $rc -eq 0 ] || [ $rc -eq 5 ] || split_status=1  # (5: no test selected)
      done
      rm -f "$one"
      [ $split_status -eq 0 ] ;;
    # the GPU tests of the planner's graphs, builds and convolutions alone (~3 min): what a
    # change to the build graphs or the launch path needs before a benchmark
    builds-tests)
      builds_status=0
      for file in tests/test_build_graphs.py tests/test_strided.py tests/test_planner.py \
                  tests/test_derived_keys.py tests/test_cuda_graphs.py tests/test_conv.py; do
        out=$(timeout "${GPU_TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu \
                -p no:cacheprovider "$file" 2>&1); rc=$?
        echo "$file: rc $rc, $(echo "$out" | grep -E 'passed|failed|error' | tail -1)"
        [ $rc -eq 0 ] || [ $rc -eq 5 ] || { builds_status=1; echo "$out" | tail -30; }
      done
      [ $builds_status -eq 0 ] ;;
    # CPU-suite tests whose device fixture takes the GPU here: the ops, pools, tensors and
    # BatchNorm folding on CUDA tensors (the suite runs them on the CPU)
    cuda)     python3 -m pytest -q tests/test_conv.py tests/test_autocast.py \
                tests/test_sparse_pool.py tests/test_sparse_tensor.py tests/test_eval_fusion.py ;;
    planner)  python3 scripts/bench_planner.py ;;
    submconv) python3 scripts/bench_submconv.py ;;
    cache)    python3 scripts/bench_cache.py --train-demo ;;
    aot)      python3 scripts/bench_aot.py ;;
    table)    python3 scripts/bench_table_vs_heuristic.py ;;
    tuning)   python3 scripts/bench_tuning.py ;;  # tunes a table from scratch (minutes)
    unet)     python3 scripts/bench_unet_spconv.py ;;
    e2e)      python3 scripts/bench_e2e.py ;;  # whole train / inference steps vs spconv
    layers)   python3 scripts/bench_layers.py ;;  # the e2e encoder's layer shapes vs spconv, every dtype
    ddp)      python3 scripts/bench_ddp.py ;;  # DDP training on 1 and 2 GPUs vs spconv (2-GPU machine)
    precision) python3 scripts/bench_precision.py ;;  # precision modes and BatchNorm folding, step by step vs spconv
    # issue #20's verdict in one call (~4 min): its benchmark in fp16, both libraries in turns,
    # and bench_precision's interleaved fresh-coordinate rows
    issue20)  python3 scripts/bench_e2e.py --modes fp16 \
                && python3 scripts/bench_precision.py --networks unet,encoder --phases train,infer \
                     --coords fresh --base flexplan/fp16,spconv/fp16 --steps 25 --warmup 12 ;;
    # a plan build's host time, eager and replayed from CUDA graphs (submanifold, strided)
    builds)   python3 scripts/probe_build_graphs.py ;;
    # host cost of a launch (loop) and of named functions inside fresh / repeated U-Net steps
    host)     python3 scripts/probe_launch.py \
                && python3 scripts/probe_host_parts.py --coords fresh \
                && python3 scripts/probe_host_parts.py --coords same ;;
    *) echo "unknown step $step"; false ;;
  esac || status=1
done
if [ -n "${OUT:-}" ]; then cp scripts/results/*.md "$OUT"/ 2>/dev/null; fi
exit $status
