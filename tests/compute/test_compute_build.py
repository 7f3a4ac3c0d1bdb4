"""Checkpoints, fingerprint (the KV namespace), the build key, and loading the AOTI package in a
process that has only torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from compute import HSTUConfig, PagedBatch, build, fingerprint, load_compiled
from compute.batch import GRAPH_INPUT_NAMES
from compute.build import check_no_input_mutation
from compute.build import main as hstu_build_main
from compute.build import package_path
from compute.checkpoint import CHECKPOINT_FILENAME, load_model, save_checkpoint
from paged_helpers import PageAllocator, make_user, new_pool, suffix_request

CHILD = r"""
import sys, torch
inputs = torch.load(sys.argv[2], weights_only=True)
run = torch._inductor.aoti_load_package(sys.argv[1])
scores, kv_rows, kv_values = run(*inputs)
pool = inputs[0]
pool.view(-1, *pool.shape[-2:]).index_copy_(0, kv_rows, kv_values)  # what compute.model.write_new_kv does
torch.save({"scores": scores, "kv_pool": inputs[0]}, sys.argv[3])
assert not [m for m in sys.modules if m == "compute" or m.startswith("compute.")], "compute was imported"
"""


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".build-*"))
    return dst


def test_package_loads_in_a_process_with_only_torch(model_dir, config, compiled, tmp_path):
    rng = np.random.default_rng(21)
    pages = PageAllocator(32, rng)
    users = [make_user(rng, config, 40, 5, pages, cached_len=0), make_user(rng, config, 7, 2, pages, cached_len=0)]
    batch = PagedBatch.from_requests([suffix_request(u) for u in users])
    inputs = batch.graph_inputs(new_pool(config, 32))
    assert len(inputs) == len(GRAPH_INPUT_NAMES)
    torch.save(list(inputs), tmp_path / "inputs.pt")
    expected_pool = new_pool(config, 32)
    expected = compiled(expected_pool, batch)

    subprocess.run([sys.executable, "-I", "-c", CHILD, str(package_path(model_dir, "cpu")),
                    str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                   cwd=tmp_path, check=True, timeout=120)

    out = torch.load(tmp_path / "out.pt", weights_only=True)
    torch.testing.assert_close(out["scores"], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["kv_pool"], expected_pool, rtol=0, atol=1e-6, equal_nan=True)


def test_build_is_skipped_when_the_key_is_unchanged(model_dir):
    package = package_path(model_dir, "cpu")
    before = package.stat().st_mtime_ns
    assert build(model_dir, "cpu") == package
    assert hstu_build_main(["--model-dir", str(model_dir), "--device", "cpu"]) == 0
    assert package.stat().st_mtime_ns == before
    key = json.loads((model_dir / "build_key_cpu.json").read_text())
    assert key["fingerprint"] == fingerprint(model_dir) and key["torch_version"] == torch.__version__
    assert key["device"] == "cpu" and key["config"]["page_size"] == 32


def test_stale_package_is_refused(model_dir, tmp_path):
    folder = copy_model(model_dir, tmp_path / "model")
    model = load_model(folder)
    with torch.no_grad():
        model.task_heads[0].mlp[0].weight.add_(0.01)
    save_checkpoint(model, folder)
    with pytest.raises(RuntimeError, match="stale"):
        load_compiled(folder, "cpu")


def test_missing_package_is_reported(tmp_path):
    HSTUConfig(num_layers=1).save(tmp_path)
    with pytest.raises(FileNotFoundError, match="hstu-build"):
        load_compiled(tmp_path, "cpu")


def test_fingerprint_names_weights_and_config(model_dir, tmp_path):
    assert len(fingerprint(model_dir)) == 64

    other_seed = tmp_path / "seed1"
    HSTUConfig(seed=1).save(other_seed.mkdir() or other_seed)
    same_weights_new_config = copy_model(model_dir, tmp_path / "config")
    HSTUConfig(max_candidates=128).save(same_weights_new_config)

    assert fingerprint(other_seed) != fingerprint(model_dir)  # writes seed 1's checkpoint first
    assert fingerprint(same_weights_new_config) != fingerprint(model_dir)


def test_seeded_checkpoint_is_deterministic(model_dir, tmp_path):
    """Two processes that each write the missing checkpoint agree on the weights (and the namespace)."""
    HSTUConfig().save(tmp_path)
    assert not (tmp_path / CHECKPOINT_FILENAME).exists()
    other = subprocess.run([sys.executable, "-c", "import sys; from compute import fingerprint; print(fingerprint(sys.argv[1]))",
                            str(tmp_path)], check=True, capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[2])
    assert other.stdout.strip() == fingerprint(model_dir)
    assert fingerprint(tmp_path) == fingerprint(model_dir)


class _WritesItsInput(torch.nn.Module):
    def forward(self, pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        pool.index_copy_(0, rows, values)
        return values.sum()


class _ReturnsWhatToWrite(torch.nn.Module):
    def forward(self, pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return pool[rows].sum(), rows, values * 2


def test_a_graph_that_writes_its_input_is_refused():
    """The structural check behind "a call costs its tokens, not the pool": Inductor compiles a
    write into a graph input as a copy of the whole input (on CUDA), so the build refuses any
    export that mutates an input. Runs on the CPU, where the copy itself cannot be seen."""
    args = (torch.zeros(16, 4), torch.tensor([1, 3]), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match=r"writes its inputs \['pool'\]"):
        check_no_input_mutation(torch.export.export(_WritesItsInput(), args))
    check_no_input_mutation(torch.export.export(_ReturnsWhatToWrite(), args))


def test_the_served_forward_only_reads_the_pool(model_dir, config):
    """The real paged forward exports with no input mutated (``build`` also checks this)."""
    from compute.build import _dynamic_shapes, _sample_inputs
    model = load_model(model_dir).requires_grad_(False)
    with torch.no_grad():
        exported = torch.export.export(model, _sample_inputs(config, "cpu"), dynamic_shapes=_dynamic_shapes())
    check_no_input_mutation(exported)

