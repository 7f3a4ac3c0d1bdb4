#!/usr/bin/env bash
# One GPU session on the air-gapped H200 host, from a checkout that carries .bundle/
# (deploy/offline_bundle.sh). Installs the bundle beside the host's torch/numpy, then runs the
# stages asked for (default: pytest compute serve), each writing its results to ${OUT:-deploy/reports}:
#   pytest   every CUDA-marked test (pytest -m cuda over the test files that mark any: build, scores vs the reference, call
#            cost independent of the pool, only the new tokens' rows written, the store on CUDA
#            pools; the FlexKV ones skip unless FlexKV is built: the flexkv stage builds it)
#   stress   tests.reliability.stress on the GPU ($STRESS_SECONDS, default 240; 48 unary streams over the
#            soak's small pool: host hits (--min-host-pages $STRESS_MIN_HOST_PAGES, default 2), evictions,
#            offloads; every 50th answer checked; exit 1 on a failed request, a wrong score or a crash;
#            the float32 model is built and a server started first: allow 100-150 s over $STRESS_SECONDS)
#   floor    what an ensemble step costs with no work in it (deploy/bench/hops.py: identity models, 1
#            step vs 3, c=1 and 32) and the owner's path hot and after 3 ms idle (deploy/bench/owner.py
#            --idle-ms): the part of the c=1 gap that is this host's, not the models'
#   compute  the compute benchmark of each GPU config (deploy/bench/compute.py), and hstu_compute's
#            host work per batch on this host's cores (deploy/bench/host_work.py)
#   serve    sweep, pooldemo and bench, for each GPU config:
#   sweep    the ensemble vs monolithic demo sweep (c=1..128 over 128 users, so that c=128 keeps
#            128 requests in flight (a user's requests run in order); every score checked at every
#            concurrency, clean-stop time; $SWEEP_REQUESTS requests, default 512, at $SWEEP_CONCURRENCY),
#            once per hstu_compute --cuda-graphs value in $SWEEP_CUDA_GRAPHS (default 0; "64 0" compares)
#   pooldemo the same demo on a small pool (2,048 pages, about half the trace's working set: host
#            hits through the onboarding path, every score checked)
#   bench    hstu-bench's phases $BENCH_PHASES (default: cache device_hit host_hits: device hit / host
#            hit / miss at 256..4,096 tokens; at 1,024 and 4,096 tokens a user's next request and a
#            miss, back to back, with each model's Triton compute time; p99 of a host-hit-heavy load
#            over an all-device-hit one at c=8); "sweep perf_analyzer" adds the bench's own client
#            and perf_analyzer at c=$BENCH_CONCURRENCY (default 1 8 32); "offload" the p99 with offload on
#            and off at c=8 (a second server, --store none). Every request the bench times is checked
#            against the float32 reference (perf_analyzer's cannot be)
#   crossover  where a host hit starts to beat a miss (README, "When a host hit pays"): every config's
#            AOTI package built first, in parallel; deploy/bench/onboard.py (the onboard's fixed cost,
#            and the reader's host time before the forward); then hstu-bench's cache phase per config at
#            $CACHE_TOKENS (default 256 512 1024 2048 4096 tokens), $CACHE_REPEATS repeats (default 2)
#   profile  deploy/bench/profile.py --serve on the first config: perf_analyzer (unary) on each model
#            at c=$PROFILE_CONCURRENCY (default 1 32), every stub sampled with py-spy meanwhile: each
#            model's hottest functions, and each step's mean batch and ms per execute; $PROFILE_ARGS e.g. "--models hstu_ranking"
#   flexkv   builds FlexKV from $FLEXKV_SRC (deploy/build_flexkv.sh; $FLEXKV_BUILD_ARGS, e.g.
#            "--wheels DIR --liburing DIR" on an air-gapped host), runs the flexkv store cases and
#            the --store flexkv serving tests (tests/integration/test_serve_flexkv.py), the store
#            benchmark (embedded and flexkv side by side: GB/s vs a pinned copy) for each FlexKV
#            copy-kernel width in $FLEXKV_CTA_SWEEP, then, on the first config, hstu-bench's
#            $FLEXKV_BENCH_PHASES with each store (default "host_hits offload": p50/p99 of a
#            host-hit-heavy trace at c=8; p99 with offload on/off at c=8. The cache phase's host hit
#            is the other model's offload, which FlexKV's per-pool tier never has: nan there)
# Stages run in the order given.
#   deploy/gpu_run.sh [pytest] [stress] [floor] [compute] [serve|sweep|pooldemo|bench] [crossover] [flexkv] [--configs "small large"] [--tolerance T (default: the model's, compute.reference.default_tolerance)]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-deploy/reports}"
STAGES=() CONFIGS="small large" TOL_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    pytest|stress|floor|compute|sweep|pooldemo|bench|crossover|profile|flexkv) STAGES+=("$1") ;;
    serve) STAGES+=(sweep pooldemo bench) ;;
    --configs) CONFIGS="$2"; shift ;;
    --tolerance) TOL_ARGS=(--tolerance "$2"); shift ;;
    *) echo "gpu_run.sh: unknown argument $1 (expected pytest, stress, floor, compute, serve, sweep, pooldemo, bench, crossover, profile, flexkv, --configs, --tolerance)" >&2; exit 2 ;;
  esac
  shift
done
[ ${#STAGES[@]} -gt 0 ] || STAGES=(pytest compute sweep pooldemo bench)
POOL_PAGES=32768
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# AOTI packages built with the GPU image's default compiler segfault on load.
export CXX=/usr/bin/g++ CC=/usr/bin/gcc
# Into the host Python itself: the Python-backend stub finds packages through the `python3` on
# PATH, not through PYTHONPATH.
eval "$(deploy/setup_offline.sh .bundle)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu-host.txt"
python3 -c "import torch, numpy, zmq, tritonclient.grpc; print('torch', torch.__version__, 'numpy', numpy.__version__)" \
  | tee -a "$OUT/gpu-host.txt"
# perf_analyzer starts (its libraries come from the bundle's lib/): its first line of help
"$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/perf_analyzer" --help 2>&1 | head -2 | tee -a "$OUT/gpu-host.txt" || true
status=0
# Every stage's output goes through `grep --line-buffered`: a plain grep in a pipe holds its lines
# until the end, so a stage killed by a time limit left an empty log.

for stage in "${STAGES[@]}"; do
  if [ "$stage" = pytest ]; then
    # Only the files that mark tests cuda are collected: the others import clients this host's
    # bundle lacks (tritonclient.http needs gevent).
    python3 -m pytest -q -rs -m cuda -p no:cacheprovider $(grep -rl "pytest.mark.cuda" tests --include="test_*.py") 2>&1 \
      | tee "$OUT/gpu-pytest-cuda.log" || status=1
  fi
  if [ "$stage" = stress ]; then
    # --min-host-pages 2: under the GPU's default (12) this workload's short histories recompute, and no
    # host hit is copied; $STRESS_ARGS adds e.g. "--store-dram-bytes 16777216" (rows reused under the reader)
    python3 -m tests.reliability.stress --device cuda --seconds "${STRESS_SECONDS:-240}" --concurrency 48 --check-every 50 \
      --min-host-pages "${STRESS_MIN_HOST_PAGES:-2}" ${STRESS_ARGS:-} \
      2>&1 | grep --line-buffered -v " INFO " | tee "$OUT/gpu-stress.log" || status=1
  fi
  if [ "$stage" = floor ]; then
    python3 -m deploy.bench.hops --concurrency 1 32 --report-dir "$OUT" 2>&1 | tee "$OUT/gpu-hops.log" || status=1
    for idle in 0 3; do
      python3 -m deploy.bench.owner --batch 1 8 --idle-ms "$idle" --report-dir "$OUT/owner-idle-$idle" 2>&1 \
        | tee -a "$OUT/gpu-owner-idle.log" || status=1
    done
  fi
  if [ "$stage" = compute ]; then
    for name in $CONFIGS; do
      python3 -m deploy.bench.compute --device cuda --model-config "deploy/configs/gpu_${name}_bf16.json" \
        --pool-pages "$POOL_PAGES" --report-dir "$OUT" 2>&1 | grep --line-buffered -v " INFO " || status=1
      # hstu_compute's Python around the call, on this host's cores (seconds)
      python3 -m deploy.bench.host_work --pinned --model-config "deploy/configs/gpu_${name}_bf16.json" \
        --report-dir "$OUT" || status=1
    done
  fi
  if [ "$stage" = crossover ]; then
    builds=()
    for name in $CONFIGS; do  # the cache phases would build them one after the other
      dir=$(python3 -c "from deploy.serving_options import model_dir_for as d; print(d('deploy/configs/gpu_${name}_bf16.json'))")
      python3 -c "import sys; from compute.build import main; raise SystemExit(main(sys.argv[1:]))" \
        --model-dir "$dir" --device cuda > "$OUT/gpu-build-$name.log" 2>&1 &
      builds+=($!)
    done
    for pid in "${builds[@]}"; do wait "$pid" || status=1; done
    python3 -m deploy.bench.onboard --device cuda --repeats 10 --report-dir "$OUT" 2>&1 | grep --line-buffered -v " INFO " \
      | tee "$OUT/gpu-onboard.log" || status=1
    for name in $CONFIGS; do
      python3 -m deploy.bench --device cuda --model-config "deploy/configs/gpu_${name}_bf16.json" "${TOL_ARGS[@]}" \
        --pool-pages "$POOL_PAGES" --phases cache --repeats "${CACHE_REPEATS:-2}" \
        --cache-tokens ${CACHE_TOKENS:-256 512 1024 2048 4096} --no-perf-analyzer --out-dir "$OUT/bench-cache-$name" 2>&1 \
        | grep --line-buffered -v " INFO " | tee "$OUT/gpu-cache-$name.log" || status=1
    done
  fi
  if [ "$stage" = flexkv ]; then
    bash deploy/build_flexkv.sh "${FLEXKV_SRC:?flexkv stage: set FLEXKV_SRC to a FlexKV source tree or .tar.gz}" \
      --prefix .flexkv ${FLEXKV_BUILD_ARGS:-} 2>&1 | tee "$OUT/gpu-flexkv-build.log" || status=1
    . .flexkv/env.sh
    python3 -m pytest -q -s -rs -m cuda -p no:cacheprovider tests/kvlifecycle/test_store_flexkv.py \
      tests/integration/test_serve_flexkv.py 2>&1 | grep --line-buffered -v " INFO " | tee "$OUT/gpu-pytest-flexkv.log" || status=1
    # FlexKV's GPU<->CPU copy kernel runs on FLEXKV_TRANSFER_NUM_CTA_{H2D,D2H} thread blocks
    # (FlexKV's default 4; the store process defaults to kvlifecycle.store.flexkv.TRANSFER_CTAS).
    for ctas in ${FLEXKV_CTA_SWEEP:-4 16 32}; do
      FLEXKV_TRANSFER_NUM_CTA_H2D=$ctas FLEXKV_TRANSFER_NUM_CTA_D2H=$ctas python3 -m deploy.bench.store --device cuda \
        --stores embedded flexkv --layers 3 --heads 4 --head-dim 128 --dtype bfloat16 --report-dir "$OUT/store-cta$ctas" \
        2>&1 | grep --line-buffered -v " INFO " | tee "$OUT/gpu-store-bench-cta$ctas.log" || status=1
    done
    name="${CONFIGS%% *}"
    for store in flexkv embedded; do
      [ -n "${FLEXKV_BENCH_PHASES-host_hits offload}" ] || break  # set to "" to skip
      python3 -m deploy.bench --device cuda --store "$store" --model-config "deploy/configs/gpu_${name}_bf16.json" \
        --pool-pages "$POOL_PAGES" --phases ${FLEXKV_BENCH_PHASES-host_hits offload} --repeats "${FLEXKV_BENCH_REPEATS:-2}" --no-perf-analyzer \
        --out-dir "$OUT/bench-$store" 2>&1 | grep --line-buffered -v " INFO " | tee "$OUT/gpu-bench-$store.log" || status=1
    done
    # Every server's own logs (tritonserver's model table names a model's load error in full).
    tar czf "$OUT/gpu-flexkv-server-logs.tgz" /tmp/hstu-serve-*/*.log 2>/dev/null || true
  fi
  if [ "$stage" = sweep ] || [ "$stage" = pooldemo ] || [ "$stage" = bench ] || [ "$stage" = profile ]; then
    python3 -m deploy.make_configs --device cuda ${MAKE_CONFIGS_ARGS:-}  # e.g. "--compute-instances 2"
  fi
  if [ "$stage" = profile ]; then
    name="${CONFIGS%% *}"
    python3 -m deploy.bench.profile --serve --device cuda --model-config "deploy/configs/gpu_${name}_bf16.json" \
      --pool-pages "$POOL_PAGES" --concurrency ${PROFILE_CONCURRENCY:-1 32} ${PROFILE_ARGS:-} --out-dir "$OUT/profile-$name" 2>&1 \
      | grep --line-buffered -v " INFO " | tee "$OUT/gpu-profile-$name.log" || status=1
  fi
  for name in $CONFIGS; do
    config="deploy/configs/gpu_${name}_bf16.json"
    if [ "$stage" = sweep ]; then
      # The float32 reference runs on the GPU too (on the CPU the large config's took over 5 minutes).
      # One sweep per value of $SWEEP_CUDA_GRAPHS (hstu_compute's --cuda-graphs; e.g. "64 0": on, then off).
      for graphs in ${SWEEP_CUDA_GRAPHS:-0}; do
        python3 -m deploy.demo --device cuda --model-config "$config" "${TOL_ARGS[@]}" --pool-pages "$POOL_PAGES" \
          --users 128 --requests "${SWEEP_REQUESTS:-512}" --median-events 600 --concurrency ${SWEEP_CONCURRENCY:-1 4 8 16 32 64 128} \
          --cuda-graphs "$graphs" --json-out "$OUT/gpu-demo-$name-graphs$graphs.json" 2>&1 \
          | tee "$OUT/gpu-demo-$name-graphs$graphs.log" | grep --line-buffered -v " INFO " || status=1
      done
    fi
    if [ "$stage" = pooldemo ]; then
      python3 -m deploy.demo --device cuda --model-config "$config" "${TOL_ARGS[@]}" --pool-pages 2048 \
        --users 128 --requests 256 --median-events 600 --concurrency 1 8 16 \
        --json-out "$OUT/gpu-demo-$name-pool2048.json" 2>&1 | tee "$OUT/gpu-demo-$name-pool2048.log" | grep --line-buffered -v " INFO " || status=1
    fi
    if [ "$stage" = bench ]; then
      python3 -m deploy.bench --device cuda --model-config "$config" --pool-pages "$POOL_PAGES" \
        --phases ${BENCH_PHASES:-cache device_hit host_hits} --concurrency ${BENCH_CONCURRENCY:-1 8 32} --users 64 \
        --repeats "${BENCH_REPEATS:-3}" "${TOL_ARGS[@]}" --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/gpu-bench-$name.log" | grep --line-buffered -v " INFO " || status=1
    fi
  done
done
exit $status
