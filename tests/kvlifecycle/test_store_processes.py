"""The embedded store across processes and restarts (acceptance items 2 and 3 of issue 3), its
wire protocol's handling of bad input, and the argument checks shared by every backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from kvlifecycle.pool import PagePool
from kvlifecycle.store import Status, open_store
from kvlifecycle.store.api import select_pages
from kvlifecycle.store.processes import start_store_process
from kvlifecycle.store.protocol import pool_id
from kvlifecycle.rpc import RpcStatus, decode

from .store_harness import NS, SPEC, fill_random, slots, store_program, tokens

REPO_ROOT = Path(__file__).resolve().parents[2]

OWNER = """
import json, sys
from kvlifecycle.pool import PagePool, PoolSpec
pool = PagePool.create(PoolSpec(**json.loads(sys.argv[1])))
print(json.dumps(pool.handle()), flush=True)
sys.stdin.read()  # hold the pool until the test closes our stdin
pool.close()
"""

WRITER = """
import json, sys, torch
from kvlifecycle.pool import PagePool
pool = PagePool.attach(json.loads(sys.argv[1]))
pages = json.loads(sys.argv[2])
gen = torch.Generator().manual_seed(int(sys.argv[3]))
pool.tensor[:, pages] = torch.randn((pool.tensor.shape[0], len(pages), *pool.tensor.shape[2:]), generator=gen)
"""


def _python(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=REPO_ROOT, text=True, **kw)


def test_offload_and_onboard_across_three_processes(endpoint):
    """A creates the pool, B writes pages, C (the store server) copies them out on put_async;
    the pool is wiped and get_prefix_async/get_async bring back byte-identical pages."""
    owner = _python(OWNER, json.dumps(SPEC.to_dict()), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    store_proc = None
    try:
        handle = json.loads(owner.stdout.readline())
        writer = _python(WRITER, json.dumps(handle), json.dumps([3, 4, 5, 8]), "7")
        assert writer.wait(30) == 0, "writer process failed"
        store_proc = start_store_process(endpoint, dram_bytes=SPEC.page_bytes * 16)  # no pool yet
        pool = PagePool.attach(handle)  # this process: the offloader, then the onboarder
        expected = pool.tensor[:, [3, 4, 5, 8]].clone()
        assert expected.abs().sum() > 0, "writer wrote nothing"

        with open_store("embedded", endpoint=endpoint, page_size=SPEC.page_size) as store:
            assert store.register_pool(handle)
            seq = tokens(4, extra=3)
            put = store.put_async(seq, slots([3, 4, 5, 8]), NS, token_mask=np.arange(seq.size) < 16)
            assert store.wait([put], timeout_s=10) == {put: Status.SUCCESS}
            stats = store.server_stats()
            assert stats is not None and stats["put_pages"] == 4 and stats["dram_pages"] == 4

            pool.tensor.zero_()
            match, held = store.get_prefix_async(seq, slots([10, 11, 12, 13]), NS, first_page=0)
            assert held == 4 and match is not None
            get = store.get_async(seq, slots([20, 21]), NS, (np.arange(seq.size) >= 8) & (np.arange(seq.size) < 16))
            assert store.wait([match, get], timeout_s=10) == {match: Status.SUCCESS, get: Status.SUCCESS}
        assert torch.equal(pool.tensor[:, [10, 11, 12, 13]], expected)
        assert torch.equal(pool.tensor[:, [20, 21]], expected[:, 2:])
        pool.close()
    finally:
        if store_proc is not None:
            store_proc.kill()
        owner.stdin.close()
        owner.wait(30)


def test_disk_tier_survives_restart_and_a_corrupt_page_is_a_miss(endpoint, tmp_path):
    disk = tmp_path / "disk"
    with PagePool.create(SPEC) as pool:
        expected = fill_random(pool, [1, 2, 3], seed=11)
        seq = tokens(3)
        proc = start_store_process(endpoint, SPEC.page_bytes * 8, disk_dir=disk)
        try:
            with open_store("embedded", endpoint=endpoint, page_size=SPEC.page_size,
                            pool_handle=pool.handle()) as store:
                put = store.put_async(seq, slots([1, 2, 3]), NS)
                assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS
            assert proc.stop() == 0, "SIGTERM: the store exits 0 after flushing its write-behind queue"
            files = sorted(disk.rglob("*.kvp"))
            assert len(files) == 3, f"expected 3 page files after SIGTERM, got {files}"

            proc = start_store_process(endpoint, SPEC.page_bytes * 8, disk_dir=disk)
            pool.tensor.zero_()
            with open_store("embedded", endpoint=endpoint, page_size=SPEC.page_size,
                            pool_handle=pool.handle()) as store:
                task, held = store.get_prefix_async(seq, slots([5, 6, 7]), NS, first_page=0)
                assert held == 3 and task is not None, "pages written before the restart are found after it"
                assert store.wait([task], timeout_s=10)[task] is Status.SUCCESS
                assert torch.equal(pool.tensor[:, [5, 6, 7]], expected)
            proc.stop()

            # Corrupt page 1's file (one payload byte), restart: page 1 is a miss, never wrong data.
            key_files = {f.stem: f for f in files}
            from kvlifecycle.hashing import page_keys
            victim = key_files[page_keys(seq, NS, SPEC.page_size)[1].hex()]
            data = bytearray(victim.read_bytes())
            data[-5] ^= 0xFF
            victim.write_bytes(bytes(data))
            proc = start_store_process(endpoint, SPEC.page_bytes * 8, disk_dir=disk)
            pool.tensor.zero_()
            with open_store("embedded", endpoint=endpoint, page_size=SPEC.page_size,
                            pool_handle=pool.handle()) as store:
                get = store.get_async(seq, slots([5, 6, 7]), NS, np.ones(seq.size, dtype=bool))
                assert store.wait([get], timeout_s=10)[get] is Status.NOTFOUND
                get, held = store.get_prefix_async(seq, slots([5, 6, 7]), NS, first_page=0)
                assert held == 1 and get is not None, "after the checksum failure only page 0 is held"
                assert store.wait([get], timeout_s=10)[get] is Status.SUCCESS
                assert torch.equal(pool.tensor[:, 5], expected[:, 0])
                assert store.server_stats()["disk_corrupt_pages"] == 1
            assert not victim.exists(), "a corrupt page file is deleted"
        finally:
            proc.kill()


def test_task_in_flight_when_the_store_dies_times_out_then_fails(endpoint):
    """A task sent to a store that then died is in flight (TIMEOUT) until the store could no longer
    start it (start_by = task_start_timeout_s after sending, plus a grace for a copy that had just
    started), and FAILED from then on: never earlier, so its pages cannot be reused too soon."""
    start_timeout_s, grace_s = 0.5, 1.0
    with PagePool.create(SPEC) as pool:
        program, extra_args = store_program(copy_delay_s=5.0)
        proc = start_store_process(endpoint, SPEC.page_bytes * 8, extra_args=extra_args, program=program)
        try:
            store = open_store("embedded", endpoint=endpoint, page_size=SPEC.page_size, pool_handle=pool.handle(),
                               task_start_timeout_s=start_timeout_s, retry_interval_s=0.1)
            called = time.monotonic()
            put = store.put_async(tokens(1), slots([1]), NS)
            proc.kill()
            seen = []
            while not seen or seen[-1][1] is Status.TIMEOUT:
                status = store.wait([put], timeout_s=0.2)[put]
                seen.append((round(time.monotonic() - called, 2), status))
                assert seen[-1][0] < 30, f"still not FAILED 30 s after the store died: {seen}"
            assert seen[-1][1] is Status.FAILED, seen
            assert seen[-1][0] >= start_timeout_s + grace_s, f"FAILED while the store could still start it: {seen}"
            assert store.stats()["outages"] == 1, "one outage, counted once"
            store.close()
        finally:
            proc.kill()


def test_malformed_requests_get_a_status_and_the_server_lives(endpoint):
    with PagePool.create(SPEC) as pool:
        proc = start_store_process(endpoint, SPEC.page_bytes * 8)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            with open_store("embedded", endpoint=endpoint, page_size=SPEC.page_size) as store:
                assert store.register_pool(pool.handle())  # so a get_prefix of the wrong page size is checked
            bad = [
                [b"", b"not json"],
                [b"", json.dumps({"v": 1, "op": "get_prefix", "seq": 1, "arrays": ["tokens"]}).encode(), b"123"],
                [b"", json.dumps({"v": 1, "op": "explode", "seq": 2, "arrays": []}).encode()],
                [b"", json.dumps({"v": 1, "op": "get_prefix", "seq": 3, "ns": "x", "page_size": 6,
                                  "pool": pool_id(pool.handle()), "arrays": ["tokens"]}).encode(),
                 np.zeros(6, "<i8").tobytes()],
            ]
            for frames in bad:
                sock.send_multipart(frames)
                assert sock.poll(2000), "no reply to a malformed request"
                reply, _ = decode(sock.recv_multipart()[1:])
                assert RpcStatus(reply["rpc"]) is RpcStatus.BAD_REQUEST, reply
                assert reply["error"]
            with open_store("embedded", endpoint=endpoint, page_size=SPEC.page_size) as store:
                assert store.ping()
        finally:
            sock.close(0)
            ctx.term()
            proc.kill()


@pytest.mark.parametrize("case, seq, slot_mapping, mask, message", [
    ("mask cuts a page", tokens(2), slots([1])[:2], np.arange(8) < 2, "part of page 0"),
    ("mask on partial page", tokens(1, extra=2), slots([1, 2])[:6], np.arange(6) >= 0, "partial last page"),
    ("slot count", tokens(2), slots([1]), None, "slot_mapping has 4 entries"),
    ("slots not one page", tokens(1), np.array([4, 5, 6, 8]), None, "one whole pool page"),
    ("slots unaligned", tokens(1), np.array([5, 6, 7, 8]), None, "one whole pool page"),
    ("mask shape", tokens(1), slots([1]), np.ones(5, dtype=bool), "token_mask has shape"),
])
def test_bad_arguments_are_rejected_naming_the_field(case, seq, slot_mapping, mask, message):
    with pytest.raises(ValueError, match=message):
        select_pages(seq, slot_mapping, mask, SPEC.page_size, "put_async")


def test_none_backend_has_no_client():
    with pytest.raises(ValueError, match="has no client"):
        open_store("none", page_size=SPEC.page_size)