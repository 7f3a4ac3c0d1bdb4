"""Import ``mooncake.store`` (PyPI ``mooncake-transfer-engine``) on any host: the store
server's Mooncake backing (``mooncake.py``) and the memory node (``deploy/mooncake_node.py``)
both load it here.

CPU hosts: the wheel links ``libcuda.so.1`` and ``libcudart.so.12``. Where the driver is
absent, ``load_mooncake`` preloads a no-device stub ``libcuda.so.1`` (every entry point
returns CUDA_ERROR_NO_DEVICE; built once with the C compiler into ``~/.cache/kvlifecycle``)
and the runtime from ``nvidia-cuda-runtime-cu12``; Mooncake's TCP path then runs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["MooncakeUnavailable", "load_mooncake"]

# Entry points of libcuda that mooncake's store.so links (nm -D --undefined-only store.so).
_CUDA_DRIVER_SYMBOLS = (
    "cuCtxGetDevice", "cuCtxSetCurrent", "cuDeviceGet", "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRetain", "cuGetErrorName", "cuGetErrorString",
    "cuInit", "cuMemAddressFree", "cuMemAddressReserve", "cuMemCreate", "cuMemExportToShareableHandle",
    "cuMemGetAddressRange_v2", "cuMemGetAllocationGranularity", "cuMemGetHandleForAddressRange",
    "cuMemImportFromShareableHandle", "cuMemMap", "cuMemRelease", "cuMemSetAccess", "cuMemUnmap",
    "cuPointerGetAttribute", "cuPointerSetAttribute",
)
_CUDA_ERROR_NO_DEVICE = 100
_STUB_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlifecycle"


class MooncakeUnavailable(RuntimeError):
    """``mooncake.store`` cannot be imported here; the message says why."""


def load_mooncake() -> Any:
    """The ``mooncake.store`` module, preloading CUDA stand-ins on a host without a driver.
    Raises MooncakeUnavailable naming the cause."""
    try:
        import mooncake.store as mstore
        return mstore
    except ImportError as e:
        if "libcuda.so.1" not in str(e) and "libcudart.so.12" not in str(e):
            raise MooncakeUnavailable(f"import mooncake.store failed: {e}") from e
        first_error = e
    try:
        _preload_cuda_standins()
        import mooncake.store as mstore
        logger.warning("mooncake: no CUDA driver on this host (%s); using a no-device libcuda stub",
                       first_error)
        return mstore
    except (ImportError, OSError, subprocess.CalledProcessError) as e:
        raise MooncakeUnavailable(
            f"import mooncake.store failed ({first_error}); the no-device CUDA stub did not help: {e}") from e


def _preload_cuda_standins() -> None:
    """Load a no-device libcuda.so.1 and the pip CUDA runtime so store.so's links resolve."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        ctypes.CDLL(str(_build_cuda_stub()), mode=ctypes.RTLD_GLOBAL)
    try:
        ctypes.CDLL("libcudart.so.12", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        import nvidia.cuda_runtime  # PyPI nvidia-cuda-runtime-cu12

        lib = Path(list(nvidia.cuda_runtime.__path__)[0]) / "lib" / "libcudart.so.12"
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def _build_cuda_stub() -> Path:
    target = _STUB_DIR / "libcuda.so.1"
    if target.exists():
        return target
    _STUB_DIR.mkdir(parents=True, exist_ok=True)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc/gcc) to build the no-device libcuda.so.1 stub")
    source = "\n".join(f"int {name}(void) {{ return {_CUDA_ERROR_NO_DEVICE}; }}" for name in _CUDA_DRIVER_SYMBOLS)
    with tempfile.TemporaryDirectory() as tmp:
        c_file = Path(tmp) / "cuda_stub.c"
        c_file.write_text(source + "\n")
        built = Path(tmp) / "libcuda.so.1"
        subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(built), str(c_file)],
                       check=True, capture_output=True)
        os.replace(built, target)  # atomic: concurrent builders agree
    return target
