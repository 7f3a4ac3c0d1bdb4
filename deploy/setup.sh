#!/usr/bin/env bash
# Creates .venv/ in the repository root and installs everything the project needs
# (apt + pip). Idempotent: a second run only checks and returns in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.setup-stamp"

# Debian packages: libb64 for perf_analyzer, libibverbs for Mooncake (needed even over TCP),
# nginx-light for hstu-cluster's routing proxy (grpc_pass, consistent hash on x-user-id).
apt_pkgs=(libb64-0d libibverbs1 nginx-light)
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"

# perf_analyzer (from the tritonclient wheel) links libcudart.so.12, which lives in the
# nvidia-cuda-runtime-cu12 wheel: wrap the binary so it runs from .venv/bin without setup.
wrap_perf_analyzer() {
  local bin="$VENV/bin/perf_analyzer"
  [ -f "$bin" ] || return 0
  if head -c 4 "$bin" | grep -q ELF; then
    mv "$bin" "$VENV/bin/perf_analyzer.bin"
    cat > "$bin" <<'WRAP'
#!/usr/bin/env bash
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cudart="$(ls -d "$here"/../lib/python3*/site-packages/nvidia/cuda_runtime/lib 2>/dev/null | head -1)"
export LD_LIBRARY_PATH="${cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/perf_analyzer.bin" "$@"
WRAP
    chmod +x "$bin"
  fi
}

# Re-install only when the pinned requirements or pyproject changed.
want="$(cat "$ROOT/deploy/requirements.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  wrap_perf_analyzer
  echo "setup: .venv up to date"
  exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r "$ROOT/deploy/requirements.txt"
"$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
wrap_perf_analyzer
echo "$want" > "$STAMP"
echo "setup: done ($VENV)"
