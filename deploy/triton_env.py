"""Locate the tritonserver shipped in the `nvidia-pytriton` wheel and build its environment.

The wheel carries a full tritonserver 2.51 (`pytriton/tritonserver/{bin,backends}`), the Python
backend, stubs for several Python versions and the shared libraries they link
(`nvidia_pytriton.libs`). To run it by hand:
  1. copy `python_backend_stubs/<X.Y>/triton_python_backend_stub` into `backends/python/`;
  2. put `nvidia_pytriton.libs` and this Python's libdir on `LD_LIBRARY_PATH`;
  3. put this venv's `bin` first on `PATH`: the stub finds site-packages through the
     `python3` on `PATH`, not through `PYTHONPATH`; then tritonserver's `bin`.
`hstu-serve --print-env` prints the result for a `tritonserver` started by hand.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TritonInstall:
    """Paths of the tritonserver installation inside the pytriton wheel."""

    root: Path  # .../site-packages/pytriton/tritonserver

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def backend_dir(self) -> Path:
        return self.root / "backends"

    @property
    def libs_dir(self) -> Path:
        return self.root.parent.parent / "nvidia_pytriton.libs"

    def stub_source(self, python_version: str) -> Path:
        return self.root / "python_backend_stubs" / python_version / "triton_python_backend_stub"

    @property
    def installed_stub(self) -> Path:
        return self.backend_dir / "python" / "triton_python_backend_stub"


def find_triton() -> TritonInstall:
    """Find the tritonserver of the `nvidia-pytriton` wheel installed for this Python, or the one
    unpacked from an offline bundle (`HSTU_TRITON_HOME`, see deploy/setup_offline.sh)."""
    home = os.environ.get("HSTU_TRITON_HOME")
    if home:
        install = TritonInstall(Path(home) / "pytriton" / "tritonserver")
        if not install.binary.exists():
            raise RuntimeError(f"HSTU_TRITON_HOME={home}: no tritonserver at {install.binary}; "
                               "unpack the bundle with deploy/setup_offline.sh")
        return install
    try:
        import pytriton  # noqa: F401  (only its location is needed)
    except ImportError as e:
        raise RuntimeError(
            "nvidia-pytriton is not installed in this Python; run deploy/setup.sh "
            "(it pins nvidia-pytriton==0.7.0, which ships tritonserver 2.51)"
        ) from e
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    install = TritonInstall(root)
    if not install.binary.exists():
        raise RuntimeError(f"tritonserver binary missing at {install.binary}; reinstall nvidia-pytriton")
    return install


def install_stub(install: TritonInstall, python_version: str | None = None) -> Path:
    """Copy the Python backend stub matching this interpreter into backends/python (idempotent)."""
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    source = install.stub_source(version)
    if not source.exists():
        raise RuntimeError(f"no Python backend stub for Python {version} in the pytriton wheel ({source})")
    target = install.installed_stub
    if not target.exists() or target.stat().st_size != source.stat().st_size:
        shutil.copy2(source, target)
        logger.info("installed Python backend stub %s -> %s", source, target)
    return target


def triton_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its Python-backend stubs."""
    env = dict(os.environ if base is None else base)
    venv_bin = str(Path(sys.executable).parent)
    lib_dirs = [str(install.libs_dir), sysconfig.get_config_var("LIBDIR") or ""]
    cudart = _cuda_runtime_libdir()
    if cudart:
        lib_dirs.append(cudart)
    old_ld = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = ":".join(d for d in [*lib_dirs, old_ld] if d)
    # tritonserver's own bin dir too, so that a hand-started `tritonserver` is found by name.
    env["PATH"] = ":".join(d for d in [venv_bin, str(install.binary.parent), env.get("PATH", "")] if d)
    # The stub must import this venv's packages; a PYTHONPATH pointing elsewhere would shadow them.
    env.pop("PYTHONHOME", None)
    return env


def _cuda_runtime_libdir() -> str | None:
    """libcudart.so.12 from PyPI `nvidia-cuda-runtime-cu12` (perf_analyzer links it)."""
    try:
        import nvidia.cuda_runtime  # type: ignore[import-not-found]
    except ImportError:
        return None
    lib = Path(list(nvidia.cuda_runtime.__path__)[0]) / "lib"
    return str(lib) if lib.exists() else None
