#!/usr/bin/env bash
# One GPU session on the air-gapped H200 host, from a checkout that carries .bundle/
# (deploy/offline_bundle.sh). Installs the bundle beside the host's torch/numpy, builds the
# CUDA AOTI package, serves the ensemble on the GPU, checks a 200-request trace against the
# fp32 reference and sweeps concurrency; results land in ${OUT:-deploy/reports}.
#   deploy/gpu_run.sh [CONFIG_JSON] [TOLERANCE]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-deploy/reports}"
CONFIG="${1:-deploy/configs/gpu_small_bf16.json}"
TOL="${2:-5e-2}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# AOTI packages built with the image's default compiler segfault on load (DESIGN.md).
export CXX=/usr/bin/g++ CC=/usr/bin/gcc
# Into the host Python itself: the Python-backend stub finds packages through the `python3` on
# PATH, not through PYTHONPATH (DESIGN.md).
eval "$(deploy/setup_offline.sh .bundle)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu-host.txt"
python3 -c "import torch, numpy, zmq, tritonclient.grpc; print('torch', torch.__version__, 'numpy', numpy.__version__)" \
  | tee -a "$OUT/gpu-host.txt"
python3 -m deploy.make_configs --device cuda
python3 -m deploy.demo --device cuda --model-config "$CONFIG" --tolerance "$TOL" --pool-pages 32768 \
  --users 40 --requests 200 --median-events 600 --concurrency 1 4 8 16 32 \
  --json-out "$OUT/gpu-demo-$(basename "$CONFIG" .json).json" 2>&1 | tee "$OUT/gpu-demo.log" | grep -v "^20.*INFO"
