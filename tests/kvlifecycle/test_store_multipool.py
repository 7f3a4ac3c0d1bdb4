"""One embedded store server, several page pools: each client's transfers copy to/from its own
pool, stored pages are shared by all pools of the page geometry (the ensemble's pool, the
monolithic baseline's pool, and kv_offload putting from the ensemble's pool)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from kvlifecycle.pool import PagePool, PoolSpec
from kvlifecycle.store import Status, open_store
from kvlifecycle.store.embedded import StoreProcessClient
from kvlifecycle.store.processes import start_store_process
from kvlifecycle.store.protocol import pool_id

from tests.helpers import wait_for

from .conftest import run_child
from .store_harness import NS, SPEC, fill_random, slots, tokens

SENTINEL = 7.0  # pool B's initial content: any write a test did not expect shows up
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                               pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")])]


@pytest.fixture
def store_proc(endpoint: str) -> Iterator[Any]:
    proc = start_store_process(endpoint, dram_bytes=SPEC.page_bytes * 32)
    yield proc
    proc.kill()


def _client(endpoint: str, **cfg: Any) -> StoreProcessClient:
    client = open_store("embedded", endpoint=endpoint, page_size=SPEC.page_size, rpc_timeout_s=2.0, **cfg)
    assert isinstance(client, StoreProcessClient)
    return client


@pytest.mark.parametrize("device", DEVICES)
def test_each_client_copies_to_and_from_its_own_pool(endpoint, store_proc, device):
    spec = dataclasses.replace(SPEC, device=device)
    with PagePool.create(spec) as pool_a, PagePool.create(spec) as pool_b:
        # One pool, one id in every process: the store server and kv_offload name the owner's pool
        # from the handle they were given (on CUDA each handle() is a fresh IPC export).
        elsewhere = run_child("child_pool_id.py", {"handle": pool_a.handle()})
        assert elsewhere == dict.fromkeys(["of_handle", "of_attached"], pool_id(pool_a.handle())), elsewhere
        assert pool_id(pool_a.handle()) != pool_id(pool_b.handle())
        pool_b.tensor.fill_(SENTINEL)
        offloader = _client(endpoint, pool_handle=pool_a.handle())  # kv_offload: puts only, never registers
        owner_a, owner_b = _client(endpoint), _client(endpoint)
        try:
            # kv_offload puts before A's owner registered: its client attaches A lazily.
            expected_a = fill_random(pool_a, [1, 2, 3], seed=1).to(device)
            seq_a = tokens(3)
            put = offloader.put_async(seq_a, slots([1, 2, 3]), NS)
            assert offloader.wait([put], timeout_s=10) == {put: Status.SUCCESS}
            assert offloader.server_stats()["pools"] == 1
            assert owner_a.register_pool(pool_a.handle()), "A is already attached: registering reuses it"
            assert owner_b.register_pool(pool_b.handle())
            stats = owner_a.server_stats()
            assert stats["pools"] == 2 and stats["dram_pages"] == 3

            # B onboards A's pages: B gets A's bytes, A is untouched.
            a_before, b_before = pool_a.tensor.clone(), pool_b.tensor.clone()
            match, held = owner_b.get_prefix_async(seq_a, slots([5, 6, 7]), NS, first_page=0)
            assert held == 3 and match is not None, "pages put from pool A are matched by every client"
            assert owner_b.wait([match], timeout_s=10) == {match: Status.SUCCESS}
            assert torch.equal(pool_b.tensor[:, [5, 6, 7]], expected_a)
            assert torch.equal(pool_a.tensor, a_before), "B's get wrote into pool A"
            b_before[:, [5, 6, 7]] = expected_a
            assert torch.equal(pool_b.tensor, b_before), "B's get wrote outside its slots"

            # The reverse: B puts, A's owner gets; B is untouched.
            expected_b = fill_random(pool_b, [10, 11], seed=2).to(device)
            seq_b = tokens(2, start=1000)
            put = owner_b.put_async(seq_b, slots([10, 11]), NS)
            assert owner_b.wait([put], timeout_s=10) == {put: Status.SUCCESS}
            b_before = pool_b.tensor.clone()
            get = owner_a.get_async(seq_b, slots([20, 21]), NS, np.ones(seq_b.size, dtype=bool))
            assert owner_a.wait([get], timeout_s=10) == {get: Status.SUCCESS}
            assert torch.equal(pool_a.tensor[:, [20, 21]], expected_b)
            assert torch.equal(pool_a.tensor[:, [5, 6, 7]], a_before[:, [5, 6, 7]]), "A's get missed its slots"
            assert torch.equal(pool_b.tensor, b_before), "A's get wrote into pool B"

            by_pool = owner_a.server_stats()["by_pool"]
            assert by_pool[pool_id(pool_a.handle())] == {"num_pages": SPEC.num_pages, "put_success": 1,
                                                         "get_success": 1}
            assert by_pool[pool_id(pool_b.handle())] == {"num_pages": SPEC.num_pages, "put_success": 1,
                                                         "get_success": 1}
            assert offloader.stats().get("errors", 0) == 0
        finally:
            for client in (offloader, owner_a, owner_b):
                client.close()


def test_a_client_naming_no_pool_is_refused_when_the_server_has_none(endpoint, store_proc):
    """With several pools attached, "the pool registered last" is never a default."""
    with PagePool.create(SPEC) as pool_a, PagePool.create(SPEC) as pool_b:
        owner_a, owner_b = _client(endpoint, pool_handle=pool_a.handle()), _client(endpoint)
        anonymous = _client(endpoint)
        try:
            assert owner_b.register_pool(pool_b.handle())
            put = anonymous.put_async(tokens(1), slots([1]), NS)
            assert anonymous.wait([put], timeout_s=5) == {put: Status.FAILED}
            assert anonymous.stats()["rpc_no_pool"] == 1
            put = owner_a.put_async(tokens(1), slots([1]), NS)
            assert owner_a.wait([put], timeout_s=5) == {put: Status.SUCCESS}
            assert owner_a.server_stats()["dram_pages"] == 1, "only the named pool's put stored a page"
        finally:
            for client in (owner_a, owner_b, anonymous):
                client.close()


def test_pool_id_is_the_same_for_every_cuda_reexport_of_one_pool():
    """A CUDA owner exports a fresh IPC handle per ``handle()`` call; the pool id ignores the
    per-export fields, so registering again reuses the attached pool."""
    ipc = {"storage_handle": "aGFuZGxl", "storage_offset_bytes": 0, "offset": 0, "size": [4], "stride": [1],
           "dtype": "float32", "device": 0, "storage_size_bytes": 16}
    handle_1 = {"version": 1, "kind": "cuda_ipc", "spec": SPEC.to_dict(),
                "ipc": {**ipc, "ref_counter_handle": "cmVmMQ==", "ref_counter_offset": 0,
                        "event_handle": "ZXYx", "event_sync_required": True}}
    handle_2 = {**handle_1, "ipc": {**handle_1["ipc"], "ref_counter_handle": "cmVmMg==", "ref_counter_offset": 8,
                                    "event_handle": "ZXYy"}}
    other = {**handle_1, "ipc": {**handle_1["ipc"], "storage_offset_bytes": 4096}}
    assert pool_id(handle_1) == pool_id(handle_2)
    assert pool_id(handle_1) != pool_id(other)


def test_another_geometry_is_refused_until_the_pools_of_the_old_one_are_gone(endpoint, store_proc):
    other_spec = PoolSpec(num_layers=3, num_pages=8, page_size=SPEC.page_size, num_heads=2, head_dim=8)
    pool_a = PagePool.create(SPEC)
    client = _client(endpoint)
    try:
        assert client.register_pool(pool_a.handle())
        with PagePool.create(other_spec) as other:
            assert not client.register_pool(other.handle()), "a second geometry while pool A is attached"
            assert client.stats()["rpc_bad_request"] == 1
            assert client.server_stats()["pools"] == 1

            pool_a.close()  # the creator unlinks its file: the store detaches it at housekeeping
            wait_for(lambda: client.server_stats()["pools"] == 0, 5.0, "pool A detached")
            assert client.register_pool(other.handle()), "no pool of the old geometry is left"
            expected = fill_random_spec(other, [2], seed=3)
            put = client.put_async(tokens(1), slots([2]), NS)
            assert client.wait([put], timeout_s=10) == {put: Status.SUCCESS}
            stats = client.server_stats()
            assert stats["pools"] == 1 and stats["dram_pages"] == 1, "a fresh DRAM tier for the new geometry"
            other.tensor.zero_()
            get = client.get_async(tokens(1), slots([3]), NS, np.ones(SPEC.page_size, dtype=bool))
            assert client.wait([get], timeout_s=10) == {get: Status.SUCCESS}
            assert torch.equal(other.tensor[:, 3], expected[:, 0])
    finally:
        client.close()
        pool_a.close()


def fill_random_spec(pool: PagePool, pages: list[int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn((pool.spec.num_layers, len(pages), *pool.spec.shape[2:]), generator=gen)
    pool.tensor[:, pages] = values
    return values.clone()
