"""The device page pool: one tensor of KV pages shared by every process of a server.

Layout (docs/ARCHITECTURE.md)::

    pool.tensor: [num_layers, num_pages, 2, page_size, num_heads, head_dim]
                  K at index 0 and V at index 1 of dim 2 (as in recsys-examples)

Operations, in the order they are called:

1. ``PagePool.create(spec)`` in the owner process (``kv_lookup_alloc``). It allocates the
   memory once, zero-filled:
   - ``device="cpu"``: a file under /dev/shm (mode 0600) mapped shared with
     ``torch.from_file(shared=True)``; writes by any process that maps it are seen by all.
   - ``device="cuda[:i]"``: a CUDA tensor exported by CUDA IPC
     (``torch.multiprocessing.reductions.reduce_tensor``).
2. ``pool.handle()`` describes the memory as a JSON-safe dict (strings, ints, bools only;
   binary CUDA IPC handles are base64). It is computed once per pool and can be sent anywhere.
3. ``PagePool.attach(handle)`` in any other process of the same host maps the same memory.
   ``pool.tensor`` is then the same bytes as the creator's.
4. ``pool.close()``. The creator unlinks the shared-memory file (mappings that already exist
   stay valid until their tensors are dropped); attachers only drop their reference.
   The creator owns the memory; attachers never free it. ``close`` is idempotent. A CPU pool
   whose creator died without ``close`` (SIGKILL) is unlinked by the next ``create`` on the
   host (``sweep_orphaned_pools``): /dev/shm is RAM.

Slots: token position ``p`` of a user whose pages are ``page_row`` lives in slot
``page_row[p // page_size] * page_size + p % page_size`` (ARCHITECTURE.md). ``slots_for_pages``
and ``slots_for_positions`` compute slot mappings as int64 tensors; host store transfers and
compute index the pool with them.

This module knows nothing of which page holds what; that is ``kvlifecycle.manager``.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import math
import os
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "PoolSpec",
    "PagePool",
    "slots_for_pages",
]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvlifecycle-pool-"  # then the creator's pid, "-", a random suffix
_HANDLE_VERSION = 1

POOL_DTYPES = ("float32", "float16", "bfloat16", "float64", "uint8")  # torch dtype names a pool may hold


@dataclass(frozen=True)
class PoolSpec:
    """Geometry of the page pool. ``dtype`` is a name (``"float32"``, ``"bfloat16"``, ...)
    and ``device`` a torch device string (``"cpu"``, ``"cuda"``, ``"cuda:0"``), so a spec
    is JSON-safe and hashable."""

    num_layers: int
    num_pages: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "num_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"PoolSpec.{name}: expected a positive int, got {value!r}")
        if self.dtype not in POOL_DTYPES:
            raise ValueError(f"PoolSpec.dtype: expected one of {sorted(POOL_DTYPES)}, got {self.dtype!r}")
        kind = torch.device(self.device).type
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"PoolSpec.device: expected 'cpu' or 'cuda[:i]', got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """[num_layers, num_pages, 2, page_size, num_heads, head_dim]"""
        return (self.num_layers, self.num_pages, 2, self.page_size, self.num_heads, self.head_dim)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, K and V."""
        return self.num_layers * 2 * self.page_size * self.num_heads * self.head_dim * self.element_size

    @property
    def total_bytes(self) -> int:
        return self.numel * self.element_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PoolSpec":
        return cls(**data)


class PagePool:
    """The pool's memory in one process. Build with ``create`` (owner) or ``attach``."""

    def __init__(self, spec: PoolSpec, tensor: torch.Tensor, handle: dict[str, Any], owner: bool,
                 shm_path: str | None) -> None:
        assert tuple(tensor.shape) == spec.shape, (
            f"PagePool: expected tensor shape {spec.shape}, got {tuple(tensor.shape)}"
        )
        self.spec = spec
        self._tensor: torch.Tensor | None = tensor
        self._handle = handle
        self.owner = owner
        self._shm_path = shm_path

    # -- public API ---------------------------------------------------------------------

    @classmethod
    def create(cls, spec: PoolSpec) -> "PagePool":
        """Allocate a zero-filled pool on ``spec.device``."""
        if torch.device(spec.device).type == "cpu":
            return cls._create_shm(spec)
        return cls._create_cuda(spec)

    @classmethod
    def attach(cls, handle: dict[str, Any]) -> "PagePool":
        """Map the memory described by ``handle`` (from ``pool.handle()`` of the creator)."""
        if handle.get("version") != _HANDLE_VERSION:
            raise ValueError(
                f"PagePool.attach: expected handle version {_HANDLE_VERSION}, got {handle.get('version')!r}"
            )
        spec = PoolSpec.from_dict(handle["spec"])
        kind = handle.get("kind")
        if kind == "shm":
            path = handle["path"]
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"PagePool.attach: shared-memory file {path} is gone (creator closed the pool?)"
                )
            size = os.path.getsize(path)
            if size != spec.total_bytes:
                raise ValueError(
                    f"PagePool.attach: {path} has {size} bytes, expected {spec.total_bytes} for {spec}"
                )
            tensor = _map_shm(path, spec)
            return cls(spec, tensor, handle, owner=False, shm_path=None)
        if kind == "cuda_ipc":
            tensor = _rebuild_cuda(handle["ipc"])
            return cls(spec, tensor.view(spec.shape), handle, owner=False, shm_path=None)
        raise ValueError(f"PagePool.attach: expected handle kind 'shm' or 'cuda_ipc', got {kind!r}")

    @property
    def tensor(self) -> torch.Tensor:
        """[num_layers, num_pages, 2, page_size, num_heads, head_dim]"""
        if self._tensor is None:
            raise RuntimeError("PagePool.tensor: the pool was closed in this process")
        return self._tensor

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def handle(self) -> dict[str, Any]:
        """JSON-safe description of the memory for ``PagePool.attach``. On CUDA the owner
        exports a fresh IPC handle per call (each carries its own producer ref count)."""
        if self.owner and self._handle["kind"] == "cuda_ipc":
            return {**self._handle, "ipc": _export_cuda(self.tensor)}
        return dict(self._handle)

    def close(self) -> None:
        """Drop this process's reference; the creator also unlinks the shared-memory file."""
        self._tensor = None
        if self.owner and self._shm_path is not None:
            try:
                os.unlink(self._shm_path)
            except FileNotFoundError:
                pass
            self._shm_path = None

    def __enter__(self) -> "PagePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return f"PagePool({self.spec}, {self._handle.get('kind')}, {role}, closed={self.closed})"

    # -- helpers ------------------------------------------------------------------------

    @classmethod
    def _create_shm(cls, spec: PoolSpec) -> "PagePool":
        sweep_orphaned_pools()
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, spec.total_bytes)  # sparse, reads as zeros
        finally:
            os.close(fd)
        try:
            tensor = _map_shm(path, spec)
        except BaseException:
            os.unlink(path)
            raise
        handle = {"version": _HANDLE_VERSION, "kind": "shm", "path": path, "spec": spec.to_dict()}
        logger.info("created page pool %s at %s (%d bytes)", spec, path, spec.total_bytes)
        return cls(spec, tensor, handle, owner=True, shm_path=path)

    @classmethod
    def _create_cuda(cls, spec: PoolSpec) -> "PagePool":
        tensor = torch.zeros(spec.shape, dtype=spec.torch_dtype, device=spec.device)
        handle = {
            "version": _HANDLE_VERSION,
            "kind": "cuda_ipc",
            "spec": spec.to_dict(),
            "ipc": _export_cuda(tensor),
        }
        logger.info("created CUDA page pool %s (%d bytes)", spec, spec.total_bytes)
        return cls(spec, tensor, handle, owner=True, shm_path=None)


def slots_for_pages(page_ids: Sequence[int] | torch.Tensor, page_size: int) -> torch.Tensor:
    """int64 [len(page_ids) * page_size]: every slot of each page, page by page."""
    pages = torch.as_tensor(page_ids, dtype=torch.int64).reshape(-1, 1)  # [P, 1]
    offsets = torch.arange(page_size, dtype=torch.int64).reshape(1, -1)  # [1, S]
    return (pages * page_size + offsets).reshape(-1)  # [P * S]


def _map_shm(path: str, spec: PoolSpec) -> torch.Tensor:
    flat = torch.from_file(path, shared=True, size=spec.numel, dtype=spec.torch_dtype)
    return flat.view(spec.shape)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _export_cuda(tensor: torch.Tensor) -> dict[str, Any]:
    """Flatten ``reduce_tensor``'s rebuild arguments into JSON-safe fields."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(tensor)
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, storage_handle,
     storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
     ref_counter_offset, event_handle, event_sync_required) = args
    assert tensor_cls is type(tensor) or tensor_cls is torch.Tensor, (
        f"_export_cuda: expected a plain torch.Tensor, got {tensor_cls}"
    )
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": str(dtype).removeprefix("torch."),
        "device": int(device),
        "storage_handle": _b64(storage_handle),
        "storage_size_bytes": int(storage_size_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle) if event_handle is not None else None,
        "event_sync_required": bool(event_sync_required),
    }


def _rebuild_cuda(ipc: dict[str, Any]) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    event = ipc["event_handle"]
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(ipc["size"]),
        tuple(ipc["stride"]),
        ipc["offset"],
        torch.storage.TypedStorage,
        getattr(torch, ipc["dtype"]),
        ipc["device"],
        base64.b64decode(ipc["storage_handle"]),
        ipc["storage_size_bytes"],
        ipc["storage_offset_bytes"],
        False,
        base64.b64decode(ipc["ref_counter_handle"]),
        ipc["ref_counter_offset"],
        base64.b64decode(event) if event is not None else None,
        ipc["event_sync_required"],
    )


def sweep_orphaned_pools(shm_dir: str | None = None) -> list[str]:
    """Unlink the shared-memory pools whose creator process is gone: a creator killed with
    SIGKILL never unlinks its pool, and /dev/shm is RAM. A pool whose creator lives (or whose
    pid a process of another user now holds) is kept. Returns the paths removed."""
    shm_dir = SHM_DIR if shm_dir is None else shm_dir
    removed = []
    for name in os.listdir(shm_dir):
        pid = name[len(SHM_PREFIX):].split("-", 1)[0] if name.startswith(SHM_PREFIX) else ""
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(shm_dir, name)
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    if removed:
        logger.info("removed %d page pools left by processes that are gone: %s", len(removed), removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
