#!/usr/bin/env bash
# Install an offline bundle (deploy/offline_bundle.sh) into this host's existing Python without
# touching its torch or numpy (no dependencies are resolved), and unpack tritonserver.
#   deploy/setup_offline.sh BUNDLE_DIR [SITE_DIR]
# SITE_DIR given: wheels go there (add it to PYTHONPATH); else into the Python's site-packages.
# Prints the environment to export; hstu-serve finds tritonserver through HSTU_TRITON_HOME.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUNDLE="$(cd "$1" && pwd)"
SITE="${2:-}"
PY="${PYTHON:-python3}"
target=()
[ -n "$SITE" ] && target=(--target "$SITE")
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade "${target[@]}" "$BUNDLE"/wheels/*.whl
# perf_analyzer (from the tritonclient wheel, next to the Python without SITE_DIR): wrap it so
# that it finds the bundle's lib/.
pa="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")/perf_analyzer"
if [ -z "$SITE" ] && [ -f "$pa" ] && head -c 4 "$pa" | grep -q ELF; then
  mv "$pa" "$pa.bin"
  printf '#!/usr/bin/env bash\nexport LD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\nexec "%s.bin" "$@"\n' \
    "$BUNDLE/lib" "$pa" > "$pa"
  chmod +x "$pa"
fi
HOME_DIR="$BUNDLE/triton"
if [ ! -x "$HOME_DIR/pytriton/tritonserver/bin/tritonserver" ]; then
  mkdir -p "$HOME_DIR" && tar -xJf "$BUNDLE/tritonserver.tar.xz" -C "$HOME_DIR"
fi
echo "export HSTU_TRITON_HOME=$HOME_DIR"
echo "export PYTHONPATH=${SITE:+$SITE:}$ROOT\${PYTHONPATH:+:\$PYTHONPATH}"
