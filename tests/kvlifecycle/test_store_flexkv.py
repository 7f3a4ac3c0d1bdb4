"""The ``flexkv`` backend against a built FlexKV, on a GPU: a FlexKV store process, the pool's
owner (which registers the pool's memory through FlexKV's KVTPClient) and a second process's
client that only names the owner's pool (kv_offload's role). Skipped, saying why, where FlexKV
is not importable or there is no CUDA device (deploy/gpu_run.sh flexkv runs it on the GPU host)."""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import pytest
import torch

from kvlifecycle.pool import PagePool, PoolSpec, slots_for_pages
from kvlifecycle.rpc import default_endpoint
from kvlifecycle.store import Status, open_store
from kvlifecycle.store.processes import start_store_process
from kvlifecycle.store.flexkv import flexkv_unavailable_reason

REASON = flexkv_unavailable_reason() or (None if torch.cuda.is_available() else "no CUDA device")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(REASON is not None, reason=f"flexkv store: {REASON}")]

SPEC = PoolSpec(num_layers=3, num_pages=256, page_size=32, num_heads=4, head_dim=128, dtype="bfloat16",
                device="cuda")


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    endpoint = default_endpoint("store.sock")
    proc = start_store_process(endpoint, dram_bytes=SPEC.page_bytes * 1024, program=("-m", "kvlifecycle.store.flexkv"),
                               ready_timeout_s=60)
    yield endpoint
    assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def pool() -> Iterator[PagePool]:
    with PagePool.create(SPEC) as p:
        yield p


@pytest.fixture(scope="module")
def owner(endpoint: str, pool: PagePool):
    client = open_store("flexkv", endpoint=endpoint, page_size=SPEC.page_size, owned_pool=pool)
    started = time.monotonic()
    assert client.register_pool(pool.handle()), "the owner's register_pool failed (see the store log)"
    print(f"flexkv pool ready in {time.monotonic() - started:.1f} s")
    yield client
    client.close()


def tokens(num_pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 40, size=num_pages * SPEC.page_size, dtype=np.int64)


def fill(pool: PagePool, pages: list[int], seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pool.tensor[:, pages] = torch.randn((SPEC.num_layers, len(pages), *SPEC.shape[2:]), generator=gen,
                                        device="cuda").to(pool.tensor.dtype)
    return pool.tensor[:, pages].clone()


def slots(pages: list[int]) -> np.ndarray:
    return slots_for_pages(pages, SPEC.page_size).numpy()


def test_owner_round_trip_is_byte_identical(owner, pool):
    seq = tokens(4, seed=1)
    expected = fill(pool, [3, 7, 8, 9], seed=1)
    put = owner.put_async(seq, slots([3, 7, 8, 9]), "ns-a")
    assert owner.wait([put], timeout_s=30) == {put: Status.SUCCESS}

    pool.tensor[:, 100:104].zero_()
    task, held = owner.get_prefix_async(seq, slots([100, 101, 102, 103]), "ns-a", first_page=0)
    assert held == 4 and task is not None
    assert owner.wait([task], timeout_s=30) == {task: Status.SUCCESS}
    torch.cuda.synchronize()
    assert torch.equal(pool.tensor[:, 100:104], expected)


def test_namespaces_are_isolated(owner, pool):
    seq = tokens(2, seed=2)
    fill(pool, [10, 11], seed=2)
    put = owner.put_async(seq, slots([10, 11]), "ns-b")
    assert owner.wait([put], timeout_s=30) == {put: Status.SUCCESS}
    assert owner.get_prefix_async(seq, slots([12, 13]), "ns-other", first_page=0) == (None, 0)


def test_a_second_process_client_offloads_into_the_owners_pool(endpoint, owner, pool):
    """kv_offload's role: it names the owner's pool and puts; the owner then finds and gets."""
    offloader = open_store("flexkv", endpoint=endpoint, page_size=SPEC.page_size, pool_handle=pool.handle())
    try:
        seq = tokens(3, seed=3)
        expected = fill(pool, [20, 21, 22], seed=3)
        put = offloader.put_async(seq, slots([20, 21, 22]), "ns-c")
        assert offloader.wait([put], timeout_s=30) == {put: Status.SUCCESS}
    finally:
        offloader.close()
    got = owner.get_async(seq, slots([30, 31, 32]), "ns-c", np.ones(seq.size, dtype=bool))
    assert owner.wait([got], timeout_s=30) == {got: Status.SUCCESS}
    torch.cuda.synchronize()
    assert torch.equal(pool.tensor[:, 30:33], expected)


def test_a_suffix_put_after_its_prefix_extends_the_match(owner, pool):
    """The offload path puts only a request's new pages, after its prefix is stored."""
    seq = tokens(5, seed=4)
    expected = fill(pool, [40, 41, 42, 43, 44], seed=4)
    first = owner.put_async(seq[: 3 * SPEC.page_size], slots([40, 41, 42]), "ns-d")
    assert owner.wait([first], timeout_s=30) == {first: Status.SUCCESS}
    suffix = np.arange(seq.size) >= 3 * SPEC.page_size
    second = owner.put_async(seq, slots([43, 44]), "ns-d", token_mask=suffix)
    assert owner.wait([second], timeout_s=30) == {second: Status.SUCCESS}
    task, held = owner.get_prefix_async(seq, slots([50, 51, 52, 53, 54]), "ns-d", first_page=0)
    assert held == 5 and task is not None
    assert owner.wait([task], timeout_s=30) == {task: Status.SUCCESS}
    torch.cuda.synchronize()
    assert torch.equal(pool.tensor[:, 50:55], expected)


def test_a_get_of_pages_never_stored_is_notfound(owner):
    seq = tokens(2, seed=5)
    got = owner.get_async(seq, slots([60, 61]), "ns-e", np.ones(seq.size, dtype=bool))
    assert owner.wait([got], timeout_s=30)[got] in (Status.NOTFOUND, Status.FAILED)
    assert owner.get_prefix_async(seq, slots([62, 63]), "ns-e", first_page=0) == (None, 0)


def test_get_prefix_copies_the_held_pages_in_one_round_trip(owner, pool):
    """The serving path's host hit: pages 1-3 asked for, FlexKV holds pages 0-1; page 1 is copied,
    the slots of pages 2-3 stay untouched, and the reply says 2 pages are held."""
    seq = tokens(4, seed=6)
    expected = fill(pool, [70, 71], seed=6)
    put = owner.put_async(seq[: 2 * SPEC.page_size], slots([70, 71]), "ns-f")
    assert owner.wait([put], timeout_s=30) == {put: Status.SUCCESS}
    pool.tensor[:, 72:75] = 0
    task, held = owner.get_prefix_async(seq, slots([72, 73, 74]), "ns-f", first_page=1)
    assert held == 2 and task is not None
    assert owner.wait([task], timeout_s=30) == {task: Status.SUCCESS}
    torch.cuda.synchronize()
    assert torch.equal(pool.tensor[:, 72], expected[:, 1])
    assert not pool.tensor[:, 73:75].any(), "pages FlexKV does not hold: slots untouched"
    assert owner.get_prefix_async(tokens(2, seed=7), slots([75]), "ns-f", first_page=1) == (None, 0)
