"""Export + AOTInductor build of the paged forward, cached by a build key.

Operations:
- ``build(model_dir, device, force)``: writes the seeded checkpoint if none exists, then, unless
  the build key on disk equals ``build_key(model_dir, device)``, exports ``HSTUModel.forward``
  with ``torch.export`` (dynamic users, tokens, pages, candidates) and compiles it with
  ``torch._inductor.aoti_compile_and_package`` into ``hstu_<device>.pt2``, then writes the key
  ``build_key_<device>.json``. Returns the package path.
- ``check_no_input_mutation(exported)``: refuses a graph that writes its inputs (called by
  ``build``; see its docstring for the whole-pool copy it prevents).
- ``build_key(model_dir, device)``: what the package depends on: config, weights fingerprint,
  the model's source, torch version, device.
- ``main()``: the ``hstu-build`` console script.

Dynamic shapes: every size that varies between calls is a named ``torch.export.Dim``: users
``B`` (``new_offsets`` and ``cand_offsets`` are ``B + 1``), new tokens ``T``, candidates ``C``,
pool pages ``P``, page-table width, and the two per-user maxima ``Mn``/``Mc``, which reach the
graph as the LENGTHS of two small carrier inputs (``PagedBatch.graph_inputs``), so the graph
never calls ``.item()``. Layers, page size, heads and head size are static (the config's).

The package embeds the weights and needs no Python classes to load
(``torch._inductor.aoti_load_package`` in a process that imports only torch).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch.export import Dim

from compute import model as model_module
from compute.batch import PagedBatch
from compute.checkpoint import ensure_checkpoint, fingerprint, load_model
from compute.config import DEFAULT_MODEL_DIR, HSTUConfig
from compute.files import replace_atomically

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL_DIR", "build", "build_key", "check_no_input_mutation", "main", "package_path", "read_build_key"]

GPU_HOST_CXX = "/usr/bin/g++"  # the GPU image's default compiler builds packages that segfault on load
GPU_HOST_CC = "/usr/bin/gcc"


def build(model_dir: str | os.PathLike = DEFAULT_MODEL_DIR, device: str = "cpu", force: bool = False) -> Path:
    """Path of an up-to-date ``hstu_<device>.pt2`` in ``model_dir``, building it when the build
    key changed, the package is missing, or ``force``. ``device`` is ``"cpu"`` or ``"cuda"``."""
    folder = Path(model_dir)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    ensure_checkpoint(folder)
    key = build_key(folder, device)
    target = package_path(folder, device)
    if not force and target.exists() and read_build_key(folder, device) == key:
        logger.info("%s is up to date (build key unchanged)", target)
        return target

    started = time.perf_counter()
    model = load_model(folder, device).requires_grad_(False)  # inference only: no autograd anywhere
    args = _sample_inputs(model.config, device)
    with torch.no_grad():
        exported = torch.export.export(model, args, dynamic_shapes=_dynamic_shapes())
    check_no_input_mutation(exported)
    logger.info("exported the paged forward in %.1f s", time.perf_counter() - started)

    with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as scratch, _compiler_env(), torch.no_grad():
        scratch_package = Path(scratch) / target.name
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(scratch_package), inductor_configs=_inductor_configs())
        os.replace(scratch_package, target)
    _write_json(folder / _key_filename(device), key)
    logger.info("built %s in %.1f s", target, time.perf_counter() - started)
    return target


def check_no_input_mutation(exported: torch.export.ExportedProgram) -> None:
    """Raise ``RuntimeError`` when the exported graph writes one of its inputs.

    Inductor turns an in-place write on a graph input into a copy of that whole input (seen on
    CUDA with torch 2.11: an out-of-place ``index_copy`` of the KV pool, then a copy back, 1.3 ms
    per GiB of pool per call; the CPU package happened not to copy). The paged forward must only
    read the pool and return what to write. This check runs on the export, so it holds on any
    machine, with or without a GPU. Export keeps in-place ops as they are written; the
    functional form that Inductor compiles (``run_decompositions``) names each written input."""
    signature = exported.run_decompositions({}).graph_signature
    mutated = sorted(set(signature.user_inputs_to_mutate.values()) | set(signature.buffers_to_mutate.values()))
    if mutated:
        raise RuntimeError(f"the exported forward writes its inputs {mutated}; the compiled package would copy "
                           "each of them whole on every call. Return the new values instead and write them "
                           "outside the graph (compute.model.write_new_kv)")


def build_key(model_dir: str | os.PathLike, device: str) -> dict:
    """The inputs a package depends on, JSON-safe; equal keys mean the package is current."""
    folder = Path(model_dir)
    config = HSTUConfig.load(folder)
    model_source = Path(model_module.__file__).read_bytes()
    return {
        "config": dataclasses.asdict(config),
        "fingerprint": fingerprint(folder),
        "model_source_sha256": hashlib.sha256(model_source).hexdigest(),
        "torch_version": torch.__version__,
        "device": device,
    }


def read_build_key(model_dir: str | os.PathLike, device: str) -> dict | None:
    """The key written by the last build for ``device``, or ``None``."""
    path = Path(model_dir) / _key_filename(device)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        logger.warning("unreadable build key %s; treating the package as stale", path, exc_info=True)
        return None


def package_path(model_dir: str | os.PathLike, device: str) -> Path:
    """``<model_dir>/hstu_<device>.pt2``."""
    return Path(model_dir) / f"hstu_{device}.pt2"


def main(argv: Sequence[str] | None = None) -> int:
    """``hstu-build [--model-dir DIR] [--device cpu|cuda] [--force]``."""
    parser = argparse.ArgumentParser(prog="hstu-build", description="Build the AOTI package of hstu_compute.")
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR),
                        help="folder with hstu_config.json (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--force", action="store_true", help="rebuild even when the build key is unchanged")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = build(options.model_dir, options.device, options.force)
    print(path)
    return 0


# ---------------------------------------------------------------------------------------
# helpers


def _key_filename(device: str) -> str:
    return f"build_key_{device}.json"


def _write_json(path: Path, data: dict) -> None:
    replace_atomically(path, lambda tmp: tmp.write_text(json.dumps(data, sort_keys=True, indent=2) + "\n"))


def _sample_inputs(config: HSTUConfig, device: str) -> tuple[torch.Tensor, ...]:
    """Example arguments with every dynamic size distinct and >= 2 (sizes 0 and 1, and equal
    sizes, would be specialised by export)."""
    s = config.page_size
    # (new_tokens, cached_len, page_row, candidates): B=3, T=14, C=10, Mn=8, Mc=5, page table 6 wide
    requests = [
        (torch.full((4,), 2), s, [5, 6], [1, 2, 3]),
        (torch.full((2,), 3), 0, [7], [4, 5]),
        (torch.full((8,), 4), 2 * s, [1, 2, 3, 8, 9, 10], [6, 7, 8, 9, 10]),
    ]
    batch = PagedBatch.from_requests(requests)
    pool = torch.zeros(config.num_layers, 11, 2, s, config.num_heads, config.head_dim,  # P=11
                       dtype=config.torch_dtype, device=device)
    return batch.graph_inputs(pool)


def _dynamic_shapes() -> tuple:
    users = Dim("users", min=1, max=1 << 16)
    pages = Dim("pages", min=1, max=1 << 24)
    new_tokens = Dim("new_tokens", min=0, max=1 << 24)
    candidates = Dim("candidates", min=1, max=1 << 24)
    table_width = Dim("table_width", min=1, max=1 << 16)
    max_new = Dim("max_new", min=0, max=1 << 20)
    max_cand = Dim("max_cand", min=1, max=1 << 20)
    return (
        {1: pages},  # kv_pool [L, P, 2, S, H, D]
        {0: new_tokens},  # new_tokens [T]
        {0: users + 1},  # new_offsets [B+1]
        {0: users},  # cached_lens [B]
        {0: users, 1: table_width},  # page_table [B, MP]
        {0: candidates},  # candidates [C]
        {0: users + 1},  # cand_offsets [B+1]
        {0: max_new},  # new_len_shape [Mn]
        {0: max_cand},  # cand_len_shape [Mc]
    )


def _inductor_configs() -> dict:
    # Compile time matters more than the last percent of speed for a model this small.
    # CUDA (torch 2.11, seen on the H200 host): coalesce_tiling_analysis trips an assertion on this
    # graph (tiling_utils.get_pw_red_splits; it only picks tile shapes), and compile-time
    # autotuning runs kernels on random intermediates, so gathers through page ids computed in the
    # graph fail their bounds asserts: tune on the real sample inputs instead.
    return {"aot_inductor.compile_wrapper_opt_level": "O0", "cpp.cxx": (None, _cxx()),
            "triton.coalesce_tiling_analysis": False, "triton.autotune_at_compile_time": False}


def _cxx() -> str:
    return GPU_HOST_CXX if Path(GPU_HOST_CXX).exists() else (shutil.which("g++") or "g++")


@contextlib.contextmanager
def _compiler_env() -> Iterator[None]:
    """CXX/CC set to the system gcc (when present) for the duration of the build: Triton's
    launcher stubs read CC, inductor's C++ wrapper uses ``cpp.cxx``."""
    saved = {name: os.environ.get(name) for name in ("CXX", "CC")}
    if Path(GPU_HOST_CXX).exists() and Path(GPU_HOST_CC).exists():
        os.environ["CXX"], os.environ["CC"] = GPU_HOST_CXX, GPU_HOST_CC
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
