#!/usr/bin/env bash
# Gather what an air-gapped GPU host lacks into one folder (default .bundle/, under 64 MB):
#   wheels/             pyzmq, tritonclient, python-rapidjson for CPython 3.12 manylinux x86_64, and
#                       py-spy (deploy/bench/profile.py samples the models' stub processes with it)
#   tritonserver.tar.xz tritonserver 2.51 + Python backend + the 3.12 stub + the libraries they
#                       link, cut from the installed nvidia-pytriton wheel (its bundled
#                       libpython 3.13 is left out: the 3.12 stub links the host's libpython).
#   lib/                what tritonclient's perf_analyzer links beyond glibc: libb64.so.0d (Debian's
#                       libb64-0d) and libcudart.so.12 (a CUDA 13 host has only .so.13)
# Run here (after deploy/setup.sh); on the GPU host run deploy/setup_offline.sh BUNDLE_DIR.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/.bundle}"
PYVER="${BUNDLE_PYTHON:-3.12}"
SITE="$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$OUT/wheels"

platforms=()
for n in 17 27 28; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$ROOT/.venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp "${platforms[@]}" -d "$OUT/wheels" \
  pyzmq==27.3.0 tritonclient==2.51.0 python-rapidjson py-spy==0.4.3

if [ ! -f "$OUT/tritonserver.tar.xz" ]; then
  stub="pytriton/tritonserver/python_backend_stubs/$PYVER"
  [ -d "$SITE/$stub" ] || { echo "no Python $PYVER stub in the pytriton wheel" >&2; exit 1; }
  (cd "$SITE" && tar -cJf "$OUT/tritonserver.tar.xz" --exclude='libpython3-*.13.so*' --exclude='__pycache__' \
     pytriton/tritonserver/bin pytriton/tritonserver/backends "$stub" nvidia_pytriton.libs)
fi
mkdir -p "$OUT/lib"
cp -L /lib/x86_64-linux-gnu/libb64.so.0d "$SITE/nvidia/cuda_runtime/lib/libcudart.so.12" "$OUT/lib/"
du -sh "$OUT"
