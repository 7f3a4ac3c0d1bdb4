#!/usr/bin/env bash
# Build FlexKV (not on PyPI) from source for `hstu-serve --store flexkv`, on a host with CUDA.
#
#   deploy/build_flexkv.sh SRC [--prefix DIR] [--wheels DIR] [--liburing DIR]
#
# SRC is a FlexKV source tree with its submodules (`git clone --recursive`) or a .tar.gz of one.
# The build lands in DIR (default: .flexkv/ in this checkout), where the launcher finds it:
#   DIR/src          the built source tree (`import flexkv` from here)
#   DIR/env.sh       the LD_LIBRARY_PATH (and PYTHONPATH) lines for a shell (`. DIR/env.sh`)
#   hstu-flexkv.pth  in $PYTHON's site-packages: puts DIR/src and DIR/site on sys.path of every
#                    process of that Python. Triton's Python-backend stub ignores PYTHONPATH (it
#                    builds sys.path from the `python3` on PATH), and the pool's owner runs there.
#   DIR/stamp        what was built (source digest, torch, arch); a rerun with the same stamp is a no-op
# --wheels DIR       install FlexKV's Python dependencies (nvtx, expiring-dict, pyzmq) from wheels in
#                    DIR without a registry (an air-gapped host); without it they come from pip's index
# --liburing DIR     a prefix holding liburing's headers and library (e.g. `dpkg -x` of liburing-dev and
#                    liburing2 into DIR) when the system has none
# Environment: TORCH_CUDA_ARCH_LIST (default: the local GPU's), MAX_JOBS (default: nproc), PYTHON (python3).
# FlexKV's Prometheus metrics are left out (FLEXKV_ENABLE_METRICS=0): the project exports its own.
set -euo pipefail
die() { echo "build_flexkv.sh: $*" >&2; exit 1; }

SRC="" PREFIX="$(cd "$(dirname "$0")/.." && pwd)/.flexkv" WHEELS="" URING=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --liburing) URING="$2"; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$SRC" ] || die "one SRC expected, got '$SRC' and '$1'"; SRC="$1" ;;
  esac
  shift
done
[ -n "$SRC" ] || die "missing SRC: a FlexKV source tree (git clone --recursive) or a .tar.gz of one"
[ -e "$SRC" ] || die "SRC $SRC does not exist"
PYTHON="${PYTHON:-python3}"
mkdir -p "$PREFIX" && PREFIX="$(cd "$PREFIX" && pwd)"  # absolute: the build runs in $PREFIX/src
SRC="$(cd "$(dirname "$SRC")" && pwd)/$(basename "$SRC")"

# ---- what the build needs, each checked with the fix named ----------------------------------
command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] \
  || die "nvcc not found: install the CUDA toolkit or set CUDA_HOME (FlexKV compiles CUDA kernels)"
command -v cmake >/dev/null || die "cmake not found: install cmake (>= 3.18)"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
  || die "$PYTHON has no CUDA torch (or sees no GPU): FlexKV builds against the torch it will run with"
if [ -n "$URING" ]; then
  lib=$(dirname "$(find "$URING" -name 'liburing.so*' | head -1)" 2>/dev/null) || true
  inc=$(dirname "$(find "$URING" -name liburing.h | head -1)" 2>/dev/null) || true
  [ -n "$lib" ] && [ -n "$inc" ] || die "--liburing $URING: no liburing.so* and liburing.h under it"
  export LIBRARY_PATH="$lib:${LIBRARY_PATH:-}" CPATH="$inc:${CPATH:-}" LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
  URING_LIB="$lib"
else
  URING_LIB=""
  { ldconfig -p 2>/dev/null | grep -q liburing.so; } && [ -e /usr/include/liburing.h ] \
    || die "liburing not found: apt-get install liburing-dev, or pass --liburing DIR"
fi
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$("$PYTHON" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
fi
# FLEXKV_DEBUG=1 keeps FlexKV's Python modules as Python (no Cython pass): the Cython pass fails on
# its sglang connector at this commit, and the CUDA/C++ extension is built the same either way.
export TORCH_CUDA_ARCH_LIST FLEXKV_ENABLE_METRICS=0 FLEXKV_DEBUG=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"

# ---- idempotence: the same source, torch and arch build once ---------------------------------
if [ -d "$SRC" ]; then digest=$(cd "$SRC" && find . -path ./build -prune -o -type f \( -name '*.py' -o -name '*.cpp' \
  -o -name '*.cu' -o -name '*.h' -o -name 'CMakeLists.txt' \) -print0 | sort -z | xargs -0 cat | sha256sum | cut -c1-16)
else digest=$(sha256sum "$SRC" | cut -c1-16); fi
stamp="src=$digest torch=$("$PYTHON" -c 'import torch; print(torch.__version__)') arch=$TORCH_CUDA_ARCH_LIST"
install_pth() {
  local site
  site=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  printf '%s\n%s\n' "$PREFIX/src" "$PREFIX/site" >"$site/hstu-flexkv.pth" \
    || die "cannot write $site/hstu-flexkv.pth (run as the owner of $PYTHON's site-packages)"
}
if [ -f "$PREFIX/stamp" ] && [ "$(cat "$PREFIX/stamp")" = "$stamp" ] \
   && PYTHONPATH="$PREFIX/src:$PREFIX/site:${PYTHONPATH:-}" LD_LIBRARY_PATH="$PREFIX/src/flexkv/lib:${URING_LIB}:${LD_LIBRARY_PATH:-}" \
      "$PYTHON" -c "import flexkv.c_ext" 2>/dev/null; then
  install_pth
  echo "build_flexkv.sh: FlexKV already built in $PREFIX ($stamp)"; exit 0
fi

# ---- build ----------------------------------------------------------------------------------
rm -rf "$PREFIX/src" "$PREFIX/site" && mkdir -p "$PREFIX/src" "$PREFIX/site"
if [ -d "$SRC" ]; then cp -a "$SRC"/. "$PREFIX/src/"
else tar -xzf "$SRC" -C "$PREFIX/src" --strip-components=1; fi
[ -f "$PREFIX/src/third_party/xxHash/xxhash.h" ] && [ -d "$PREFIX/src/third_party/spdlog/include" ] \
  || die "$SRC lacks its submodules (third_party/xxHash, third_party/spdlog): clone with --recursive"
if [ -n "$WHEELS" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$PREFIX/site" "$WHEELS"/*.whl
else
  "$PYTHON" -m pip install -q --target "$PREFIX/site" nvtx "expiring-dict==1.1.2"
fi
t0=$(date +%s)
cd "$PREFIX/src"
export CXX="${CXX:-/usr/bin/g++}" CC="${CC:-/usr/bin/gcc}"
mkdir -p build
(cd build && cmake .. -DFLEXKV_ENABLE_MONITORING=OFF >"$PREFIX/cmake.log" 2>&1 \
   && cmake --build . -j"$MAX_JOBS" >>"$PREFIX/cmake.log" 2>&1) \
  || { tail -20 "$PREFIX/cmake.log" >&2; die "cmake failed; the whole log is $PREFIX/cmake.log"; }
mkdir -p flexkv/lib && cp build/lib/*.so* flexkv/lib/
LD_LIBRARY_PATH="$PREFIX/src/flexkv/lib:${LD_LIBRARY_PATH:-}" "$PYTHON" setup.py build_ext --inplace \
  >"$PREFIX/build_ext.log" 2>&1 \
  || { grep -i " error" "$PREFIX/build_ext.log" | head -20 >&2; die "setup.py build_ext failed; see $PREFIX/build_ext.log"; }
cat >"$PREFIX/env.sh" <<ENV
# FlexKV built by deploy/build_flexkv.sh ($stamp)
export PYTHONPATH="$PREFIX/src:$PREFIX/site\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$PREFIX/src/flexkv/lib${URING_LIB:+:$URING_LIB}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
ENV
. "$PREFIX/env.sh"
"$PYTHON" -c "from flexkv.kvmanager import KVManager; from flexkv.server.client import KVTPClient" \
  || die "the build finished but \`import flexkv\` fails (see above)"
install_pth
echo "$stamp" >"$PREFIX/stamp"
echo "build_flexkv.sh: built FlexKV in $(( $(date +%s) - t0 )) s into $PREFIX; use it with: . $PREFIX/env.sh"
