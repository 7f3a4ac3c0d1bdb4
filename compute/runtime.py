"""Runners of the paged forward: ``run(kv_pool, batch) -> scores`` over the AOTI package or the
eager ``nn.Module``. Both promise the same thing (docs/ARCHITECTURE.md):

- ``kv_pool`` [L, P, 2, S, H, D] in the config's dtype on the runner's device, written in place:
  K/V of every new token for every layer, and nothing else. The compiled graph only reads the
  pool; the runner writes the rows the graph returns with one indexed copy
  (``compute.model.write_new_kv``), so a call costs its own tokens, never the pool's size;
- ``batch`` a ``PagedBatch``; it is checked against the pool and the token space first and a
  ``ValueError`` says what does not fit (nothing is written then);
- returns float32 [C, num_tasks] on the pool's device, in the order of ``batch.candidates``.

``load_compiled(..., cuda_graphs=N)`` on CUDA replays small batches from CUDA graphs at bucketed
shapes (``compute.graphs``), with the same promises.

``load_compiled`` refuses a package whose build key does not match the folder's current config,
weights, model source, torch version and device: serving stale weights under a new KV namespace
would break invariant 2 of docs/ARCHITECTURE.md (content addressing).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from compute.batch import PagedBatch
from compute.build import build_key, package_path, read_build_key
from compute.checkpoint import load_model
from compute.config import HSTUConfig
from compute.graphs import GRAPH_MAX_CELLS, GraphedForward, run_forward

logger = logging.getLogger(__name__)

__all__ = ["Runner", "load_compiled", "load_eager"]

Runner = Callable[[torch.Tensor, PagedBatch], torch.Tensor]


def load_eager(model_dir: str | os.PathLike, device: str = "cpu") -> Runner:
    """Runner over ``HSTUModel.forward`` on ``device`` (no compilation)."""
    model = load_model(model_dir, device)
    return _CheckedRunner(model, model.config)


def load_compiled(model_dir: str | os.PathLike, device: str = "cpu", cuda_graphs: int = 0,
                  graph_max_cells: int = GRAPH_MAX_CELLS) -> Runner:
    """Runner over the AOTI package ``hstu_<device>.pt2`` (``hstu-build`` writes it). Raises
    ``FileNotFoundError`` when it is missing and ``RuntimeError`` when it is stale.

    ``cuda_graphs`` > 0 on a CUDA device: batches of at most ``graph_max_cells`` padded replay
    CUDA graphs captured at bucketed shapes, at most ``cuda_graphs`` kept (``compute.graphs``);
    the runner is then for one thread."""
    folder = Path(model_dir)
    device_type = torch.device(device).type
    path = package_path(folder, device_type)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no AOTI package; run `hstu-build --model-dir {folder} --device {device_type}`")
    expected, found = build_key(folder, device_type), read_build_key(folder, device_type)
    if expected != found:
        raise RuntimeError(f"{path} is stale (build key differs from the folder's config/weights/torch); "
                           f"run `hstu-build --model-dir {folder} --device {device_type}`")
    config = HSTUConfig.load(folder)
    index = torch.device(device).index
    graphs = cuda_graphs if device_type == "cuda" else 0
    if device_type == "cuda":
        # run_single_threaded: no locking around a call, which a CUDA graph capture needs
        compiled = torch._inductor.aoti_load_package(str(path), device_index=index or 0,
                                                     run_single_threaded=graphs > 0)
    else:
        compiled = torch._inductor.aoti_load_package(str(path))
    logger.info("loaded AOTI package %s (CUDA graphs: %s)", path, f"up to {graphs}" if graphs else "off")
    if graphs:
        graphed = GraphedForward(compiled, config.num_layers, config.page_size, max_graphs=graphs,
                                 max_cells=graph_max_cells)
        return _CheckedRunner(graphed, config)
    return _CheckedRunner(compiled, config)


# ---------------------------------------------------------------------------------------
# helpers


class _CheckedRunner:
    """``run(kv_pool, batch)``: check the batch, then run it through ``graph`` (the compiled
    package or the module, which only reads the pool, then the write of the new tokens' K/V rows
    it returns; or a ``GraphedForward``, which does both itself). ``stats``: the CUDA graphs'
    counters, empty without them."""

    def __init__(self, graph: Callable, config: HSTUConfig) -> None:
        self.graph = graph
        self.config = config
        self._forward = graph if isinstance(graph, GraphedForward) else functools.partial(run_forward, graph)

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.graph.stats) if isinstance(self.graph, GraphedForward) else {}

    def __call__(self, kv_pool: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        _check(kv_pool, batch, self.config)
        with torch.no_grad():
            return self._forward(kv_pool, batch)


def _check(kv_pool: torch.Tensor, batch: PagedBatch, config: HSTUConfig) -> None:
    expected = (config.num_layers, 2, config.page_size, config.num_heads, config.head_dim)
    got = (kv_pool.shape[0], *kv_pool.shape[2:]) if kv_pool.dim() == 6 else tuple(kv_pool.shape)
    if got != expected:
        raise ValueError(f"kv_pool: expected shape [{config.num_layers}, P, 2, {config.page_size}, "
                         f"{config.num_heads}, {config.head_dim}], got {list(kv_pool.shape)}")
    if kv_pool.dtype != config.torch_dtype:
        raise ValueError(f"kv_pool: expected dtype {config.torch_dtype}, got {kv_pool.dtype}")
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool: expected a contiguous tensor (it is written through a flat view)")
    error = batch.check(kv_pool, config.page_size, config.vocab_size, config.item_vocab)
    if error is not None:
        raise ValueError(error)
